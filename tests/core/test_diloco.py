"""The DiLoCo object: everything given once, the state it makes, its step against the NumPy
reference with AdamW, and an outer model that folds in a sync still in flight."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.diloco import with_plan
from tests.helpers import GBS, N_LAYERS, WIDTH, batches, reference_run
from tests.reference import NpAdamW, make_toy, toy_loss, toy_to_numpy

ADAMW = dict(learning_rate=0.02, b1=0.9, b2=0.99, eps=1e-8, weight_decay=1e-3)


def adamw():
    return optax.adamw(**ADAMW), NpAdamW(ADAMW["learning_rate"], ADAMW["b1"], ADAMW["b2"], ADAMW["eps"],
                                         ADAMW["weight_decay"])


def params_np(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float64) for k, v in toy_to_numpy(model).items()}


def test_init_gives_every_island_the_model_and_the_outer_model_is_the_model():
    cfg = dl.DiLoCoConfig(num_replicas=3, sync_period=4)
    algo = dl.DiLoCo(cfg, toy_loss, optax.adamw(1e-2))
    model = make_toy(N_LAYERS, WIDTH)
    state = algo.init(model)
    for k in range(3):
        assert eqx.tree_equal(state.island(k), model)
    assert eqx.tree_equal(algo.outer_model(state), model)
    assert int(state.step) == 0
    assert algo.config is cfg and algo.schedule == cfg.schedule


@pytest.mark.parametrize("streaming, v, alpha", [(False, 0, 0.0), (True, 1, 0.5)])
def test_step_with_adamw_matches_the_reference(streaming, v, alpha):
    """Per-step island losses and the final outer model against tests/reference.py's np_run,
    with AdamW as the inner optimizer (its moments carried across syncs)."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4, streaming=streaming, num_fragments=2,
                          overlap_steps=v, alpha=alpha)
    tx, np_tx = adamw()
    algo = dl.DiLoCo(cfg, toy_loss, tx)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    data = batches(10)
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m["loss_island_0"], m["loss_island_1"]])
    ref_losses, ref_outer, _ = reference_run(cfg, data, np_tx)
    np.testing.assert_allclose(np.array(losses), np.array(ref_losses), rtol=2e-5)
    got = params_np(algo.outer_model(state))
    for name, want in ref_outer.items():
        np.testing.assert_allclose(got[name], want, rtol=2e-5, atol=1e-6, err_msg=name)


def test_outer_model_folds_in_the_sync_of_the_last_step():
    """With V = 1 a sync at the last step is still in flight in the state; outer_model takes
    it, so it equals the outer model of the direct form, which exchanges in the same step."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4, streaming=True, num_fragments=2, overlap_steps=1)
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05))
    direct = with_plan(algo, deferred=False, exchange_after_inner=False)
    a, b = algo.init(make_toy(N_LAYERS, WIDTH)), direct.init(make_toy(N_LAYERS, WIDTH))
    for x in batches(6):  # t = 6 is a sync (Δh = 2)
        a, _ = algo.step(a, x)
        b, _ = direct.step(b, x)
    assert cfg.schedule.sync_fragment(6) is not None
    stored, folded = params_np(a.outer), params_np(algo.outer_model(a))
    want = params_np(direct.outer_model(b))
    assert any(not np.allclose(stored[n], want[n]) for n in want)  # the stored one misses it
    for name in want:
        np.testing.assert_allclose(folded[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_state_made_by_another_diloco_is_refused():
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4)
    nesterov = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05))
    adam = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05), outer_optimizer=optax.adam(0.1))
    state = nesterov.init(make_toy(N_LAYERS, WIDTH))
    with pytest.raises(ValueError, match="outer_optimizer.*this DiLoCo's init"):
        adam.step(state, batches(1)[0])


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(TypeError, match="cfg must be a DiLoCoConfig"):
        dl.DiLoCo({"num_replicas": 2}, toy_loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match="backend"):
        dl.DiLoCo(dl.DiLoCoConfig(num_replicas=2), toy_loss, optax.sgd(0.1), backend="nccl")
    with pytest.raises(ValueError, match="deferred=True needs streaming=True"):
        with_plan(dl.DiLoCo(dl.DiLoCoConfig(num_replicas=2), toy_loss, optax.sgd(0.1)), deferred=True)


def test_ddp_step_is_one_adamw_update_on_the_islands_mean_gradient():
    """DDP: the mean of the islands' gradients (rows split as DiLoCo splits them), then one
    optax update, computed here directly with jax.grad."""
    tx = optax.adamw(1e-2)
    ddp = dl.DDP(2, toy_loss, tx)
    model = make_toy(N_LAYERS, WIDTH)
    state = ddp.init(model)
    x = batches(1)[0]
    state, m = ddp.step(state, x)
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = [eqx.filter_grad(toy_loss)(model, x[k * GBS // 2:(k + 1) * GBS // 2]) for k in range(2)]
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
    updates, _ = tx.update(mean, tx.init(params), params)
    want = params_np(eqx.apply_updates(model, updates))
    got = params_np(ddp.outer_model(state))
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    assert m["step"] == 1
