"""The Data-Parallel baseline equals plain full-batch training, on any diloco axis (its
all-reduce in the compiled step: tests/perf/test_ddp_hlo.py)."""

import equinox as eqx
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from tests.helpers import alternating, fast_and_slow
from tests.reference import make_toy, toy_loss


def data(steps):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(steps)]


ISLAND_MESHES = [dict(diloco=2, data=2), dict(diloco=2, fsdp=2), dict(diloco=2, data=2, fsdp=2)]


MESHES = [(1, None), (2, None), (4, None), (4, 2), (4, 4)] + [(2, sizes) for sizes in ISLAND_MESHES]
OPTS = {"adamw": optax.adamw(0.01), "sgd": optax.sgd(0.1)}
GRID = [(k, devices, opt) for k, devices in MESHES for opt in OPTS]


# by default every mesh once, AdamW and SGD in turn; the slow set runs both on every mesh
@pytest.mark.parametrize("k,devices,opt", fast_and_slow(GRID, alternating(GRID)))
def test_ddp_is_full_batch_training(k, devices, opt):
    # SGD is not scale-invariant, so it catches a gradient summed instead of averaged
    opt = OPTS[opt]
    mesh = (None if devices is None else dl.make_mesh(**devices) if isinstance(devices, dict)
            else dl.make_mesh(devices))
    ddp = dl.DDP(k, toy_loss, opt, mesh=mesh)
    state = ddp.init(make_toy(4, 3))
    model = make_toy(4, 3)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    for x in data(10):
        shard_losses = [float(toy_loss(model, s)) for s in np.split(x, k)]
        loss, grads = eqx.filter_value_and_grad(toy_loss)(model, x)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        state, m = ddp.step(state, x)
        assert m["loss"] == pytest.approx(float(loss), rel=1e-5)
        assert [m[f"loss_island_{i}"] for i in range(k)] == pytest.approx(shard_losses, rel=1e-5)
    for got, want in zip(jax_leaves(ddp.outer_model(state)), jax_leaves(model)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 10 and m["grad_norm"] > 0 and "sync_fragment" not in m


def jax_leaves(model):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
