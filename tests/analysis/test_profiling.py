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


def test_live_peak_counts_what_is_live_at_once():
    """x·2 holds its argument and its output at once (8n bytes); returning x·3 as well holds
    one more output of n floats, and the table of the two outputs' addresses (8 bytes each)."""
    n = 1 << 14
    x = jnp.ones((n,), jnp.float32)
    compiled, one = profiling.live_peak(jax.jit(lambda x: x * 2).lower(x))
    _, two = profiling.live_peak(jax.jit(lambda x: (x * 2, x * 3)).lower(x))
    assert one == 8 * n and two - one == 4 * n + 2 * 8
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.full((n,), 2.0, np.float32))
