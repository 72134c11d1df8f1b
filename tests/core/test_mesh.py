"""The diloco mesh axis: same numbers for any axis size (where the collectives run:
tests/perf/test_mesh_hlo.py)."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import diloco_eqx as dl
from tests.reference import make_toy, toy_loss, toy_to_numpy

CFG = dl.DiLoCoConfig(num_replicas=4, sync_period=6, streaming=True, num_fragments=3,
                      overlap_steps=1, alpha=0.5)


def run(cfg, mesh, steps):
    inner = optax.adamw(0.01)
    algo = dl.DiLoCo(cfg, toy_loss, inner, mesh=mesh)
    state = algo.init(make_toy(4, 3))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        state, m = algo.step(state, rng.normal(size=(8, 3)).astype(np.float32))
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
    return np.array(losses), state


@pytest.mark.parametrize("cfg", [CFG, dl.DiLoCoConfig(num_replicas=4, sync_period=5)],
                         ids=["streaming", "vanilla"])
def test_same_numbers_for_every_axis_size(cfg):
    assert len(jax.devices()) >= 4
    ref_losses, ref = run(cfg, None, 20)
    for d in (2, 4):
        losses, state = run(cfg, dl.make_mesh(d), 20)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        for name, x in toy_to_numpy(state.outer).items():
            np.testing.assert_allclose(x, toy_to_numpy(ref.outer)[name], rtol=1e-5, atol=1e-6)
        for i in range(4):
            for name, x in toy_to_numpy(state.island(i)).items():
                np.testing.assert_allclose(x, toy_to_numpy(ref.island(i))[name], rtol=1e-5, atol=1e-6)
        # each island lives on its own slice of the axis
        assert state.inner_model.embed.sharding.spec == dl.mesh.ISLANDS


def test_k_not_divisible_by_axis_size():
    cfg = dl.DiLoCoConfig(num_replicas=3, sync_period=4)
    with pytest.raises(ValueError, match=r"num_replicas \(K\)=3 .*diloco mesh axis size 2"):
        dl.DiLoCo(cfg, toy_loss, optax.sgd(0.1), mesh=dl.make_mesh(2))


def test_make_mesh_rejects_too_many_devices():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"num_devices must be in 1..{n}"):
        dl.make_mesh(n + 1)


@pytest.mark.parametrize("shape,data,fsdp,want", [
    ((8, 6), 2, 2, P(("fsdp", "data"))),     # the fsdp-split axis, split further over data
    ((3, 8), 2, 2, P(None, ("fsdp", "data"))),
    ((6, 2), 2, 2, P("fsdp")),                # 6 is not divisible by 4: the island's layout
    ((5, 6), 2, 1, P(None, "data")),          # no fsdp: the largest axis data divides
    ((5, 3), 2, 1, P()),
    ((8, 6), 1, 2, P("fsdp")),
])
def test_outer_layout_refines_the_island_layout(shape, data, fsdp, want):
    """Fsdp-major: each device's outer piece lies inside its own island shard, so moving
    between the two layouts never permutes data between devices."""
    from diloco_eqx.mesh import leaf_spec, outer_leaf_spec

    leaf = np.zeros(shape, np.float32)
    assert outer_leaf_spec(leaf, data, fsdp) == want
    island = leaf_spec(leaf, fsdp)
    if island and fsdp > 1:  # same axis, with fsdp first
        entry = want[len(island) - 1]
        assert entry == island[-1] or entry[0] == island[-1]
