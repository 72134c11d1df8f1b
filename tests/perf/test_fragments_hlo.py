"""Fragments written in place (read from the compiled program and its buffers): a strided
group is read and written back without a copy of the layer stack, and `update` writes it
block by block with no temporary."""

import jax

from diloco_eqx.analysis import comms
from diloco_eqx.fragments import Fragmentation
from tests.core.test_fragments import cfg, params
from tests.reference import make_toy


def test_interleaved_fragment_is_updated_in_place():
    """Reading a strided group and writing it back compiles without a copy of the stack."""
    frags = Fragmentation.from_model(make_toy(6, 3), cfg(3, "interleaved"))
    p = params(make_toy(6, 3))
    update = jax.jit(lambda t: frags.put(t, 1, jax.tree.map(lambda x: 2.0 * x + 1.0, frags.take(t, 1))),
                     donate_argnums=0)
    hlo = update.lower(p).compile().as_text()
    assert frags.layer_indices(1) == (0, 2, 4)
    assert comms.every_step_copy_bytes(hlo) == 0


def test_update_of_an_interleaved_fragment_is_in_place():
    """`update` writes a strided group block by block, in place: no copy of the stack and no
    temporary, where `put` of the same function of `take` first writes the fragment out."""
    frags = Fragmentation.from_model(make_toy(6, 64), cfg(3, "interleaved"))
    p = params(make_toy(6, 64))
    u = frags.take(p, 1)

    def compiled(fn):
        return jax.jit(fn, donate_argnums=0).lower(p, u).compile()

    by_blocks = compiled(lambda t, u: frags.update(t, 1, lambda x, v: 2.0 * x + v, u))
    copied = compiled(lambda t, u: frags.put(t, 1, jax.tree.map(lambda x, v: 2.0 * x + v, frags.take(t, 1), u)))
    assert comms.every_step_copy_bytes(by_blocks.as_text()) == 0
    assert by_blocks.memory_analysis().temp_size_in_bytes == 0
    assert copied.memory_analysis().temp_size_in_bytes >= sum(x.nbytes for x in jax.tree.leaves(u))
