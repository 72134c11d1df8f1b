"""The stash on an island mesh (read from the compiled round trip): packing and unpacking a
fragment moves nothing between devices."""

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import diloco_eqx as dl
from diloco_eqx import mesh as mesh_lib
from diloco_eqx import stash as stash_lib
from diloco_eqx.analysis import comms
from diloco_eqx.models.transformer import Transformer, TransformerConfig
from tests.core.test_stash import fragment_sizes


def test_packing_and_unpacking_on_an_island_mesh_move_nothing_between_devices():
    """Leaves laid out like the outer model go to their device's own row and back: the
    compiled round trip has no collective."""
    model = Transformer(TransformerConfig(num_layers=4, width=16, num_heads=2, seq_len=8), jax.random.key(0))
    frags, _ = fragment_sizes(model)
    mesh = dl.make_mesh(diloco=2, data=2, fsdp=2)
    params = eqx.filter(model, eqx.is_inexact_array)
    stash = stash_lib.for_model(params, frags, mesh)
    specs = mesh_lib.default_outer_specs(mesh)
    part = frags.take(params, 1)
    layout = jax.tree.map(lambda x: NamedSharding(mesh, mesh_lib.canonical(specs(x), mesh)), part)
    row_layout = NamedSharding(mesh, mesh_lib.canonical(P(*stash_lib.GRID), mesh))
    part = jax.device_put(part, layout)

    @jax.jit
    def round_trip(tree):
        row = jax.lax.with_sharding_constraint(stash.pack(tree), row_layout)
        return jax.lax.with_sharding_constraint(stash.unpack(row, tree), layout)

    hlo = round_trip.lower(part).compile().as_text()
    assert comms.collectives(hlo) == []
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), round_trip(part), part)
