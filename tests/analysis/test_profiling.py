"""profiling: compile counts, memory and FLOPs of a compiled function."""

import jax
import jax.numpy as jnp
import numpy as np

from diloco_eqx.analysis import profiling


def test_counts_each_new_shape_once():
    f = jax.jit(lambda x: x @ x)
    with profiling.count_compilations() as c:
        f(np.ones((3, 3), np.float32))
        f(np.ones((3, 3), np.float32))
        f(np.ones((4, 4), np.float32))
    assert c.count == 2 and c.seconds > 0


def test_memory_and_flops_of_a_matmul():
    n = 64
    compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((n, n)), jnp.ones((n, n))).compile()
    mem = profiling.memory(compiled)
    assert mem["argument_bytes"] == 2 * n * n * 4 and mem["output_bytes"] == n * n * 4
    assert profiling.flops(compiled) == 2 * n**3
