"""The deferred exchange's stash: sized to the largest fragment, an exact round trip for every
fragment, and a fragment packed block by block is the fragment packed whole (packed without
communication on an island mesh: tests/perf/test_stash_hlo.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import diloco_eqx as dl
from diloco_eqx import mesh as mesh_lib
from diloco_eqx import stash as stash_lib
from diloco_eqx.fragments import Blocks
from diloco_eqx.models.transformer import Transformer, TransformerConfig, loss_fn

CFG = dl.DiLoCoConfig(num_replicas=2, sync_period=9, streaming=True, num_fragments=3, overlap_steps=1)


def fsdp_only(leaf):
    """A user layout that splits the largest axis over "fsdp" only: pieces replicated over "data"."""
    return mesh_lib.leaf_spec(leaf, 2)


@pytest.fixture(scope="module")
def model():
    return Transformer(TransformerConfig(num_layers=4, width=16, num_heads=2, seq_len=8), jax.random.key(0))


def fragment_sizes(model):
    frags = dl.Fragmentation.from_model(model, CFG)
    return frags, frags.param_counts(eqx.filter(model, eqx.is_inexact_array))


def test_row_is_the_largest_fragment_and_the_state_holds_one_per_island(model):
    frags, sizes = fragment_sizes(model)
    assert len(set(sizes)) > 1  # fragment 0 (embeddings, head) differs from the layer groups
    state = dl.DiLoCo(CFG, loss_fn, optax.sgd(0.1)).init(model)
    assert state.pending.shape == (2, 1, 1, max(sizes))
    assert state.pending.dtype == jnp.float32
    mesh = dl.make_mesh(diloco=2, data=2, fsdp=2)
    stash = stash_lib.for_model(eqx.filter(model, eqx.is_inexact_array), frags, mesh)
    assert stash.grid == (2, 2) and stash.size == max(sizes) // 4  # every leaf split 4 ways here


@pytest.mark.parametrize("layout", ["none", "2x2datax2fsdp", "fsdp_only"])
def test_every_fragment_round_trips_exactly(model, layout):
    frags, _ = fragment_sizes(model)
    mesh = None if layout == "none" else dl.make_mesh(diloco=2, data=2, fsdp=2)
    specs = fsdp_only if layout == "fsdp_only" else None
    params = eqx.filter(model, eqx.is_inexact_array)
    stash = stash_lib.for_model(params, frags, mesh, specs)
    rng = np.random.default_rng(0)
    for f in range(frags.num_fragments):
        part = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), frags.take(params, f))
        old = jnp.asarray(rng.normal(size=(*stash.grid, stash.size)), stash.dtype)  # the last fragment's
        row = stash.pack(part, old)
        assert row.shape == (*stash.grid, stash.size)
        back = stash.unpack(row, part)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, part)
        # the fragment is written over the front of the row; what lies past it is left as it was
        used = sum(stash._piece_size(x) for x in jax.tree.leaves(part))
        np.testing.assert_array_equal(np.asarray(row)[..., used:], np.asarray(old)[..., used:])
        assert not np.any(np.asarray(stash.pack(part))[..., used:])


def layers_split(leaf):
    """A user layout that splits the layer axis (axis 0) over "fsdp" where it divides."""
    return P("fsdp") if np.ndim(leaf) and np.shape(leaf)[0] % 2 == 0 else P()


@pytest.mark.parametrize("layout", ["none", "2x2datax2fsdp", "fsdp_only", "layers_split"])
def test_a_fragment_packed_block_by_block_is_the_fragment_packed_whole(model, layout):
    """An interleaved fragment handed over as `Blocks` (each run of consecutive layers read
    where it lies) packs to the very row its joined leaves pack to, on every layout: block by
    block where no device splits the layer axis, joined first where one does. Without a mesh
    the row is the fragment's leaves raveled one after another (numpy)."""
    frags, _ = fragment_sizes(model)
    assert frags.layer_indices(1) == (0, 2)  # two blocks of one layer
    mesh = None if layout == "none" else dl.make_mesh(diloco=2, data=2, fsdp=2)
    specs = {"fsdp_only": fsdp_only, "layers_split": layers_split}.get(layout)
    params = eqx.filter(model, eqx.is_inexact_array)
    stash = stash_lib.for_model(params, frags, mesh, specs)
    rng = np.random.default_rng(1)
    noisy = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    whole, blocks = frags.take(noisy, 1), frags.take(noisy, 1, blocks=True)
    assert any(isinstance(x, Blocks) for x in jax.tree.leaves(blocks, is_leaf=lambda x: isinstance(x, Blocks)))
    row = stash.pack(blocks)
    np.testing.assert_array_equal(np.asarray(row), np.asarray(stash.pack(whole)))
    if mesh is None:
        flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(whole)])
        np.testing.assert_array_equal(np.asarray(row)[0, 0, :flat.size], flat)
