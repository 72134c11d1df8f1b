"""Delayed outer updates (naive and eager): the step against the NumPy reference's own
per-island reading of the rule, the rule on hand-worked numbers, and the knobs' errors."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx import delayed
from tests.helpers import N_LAYERS, WIDTH, batches
from tests.reference import NpAdamW, NpNesterov, NpSGD, make_toy, np_run_delayed, toy_loss, toy_to_numpy

CASES = {
    "naive": dict(delayed_outer="naive"),
    "eager": dict(delayed_outer="eager"),
    "eager_d2": dict(delayed_outer="eager", outer_delay=2),
    "eager_streaming": dict(delayed_outer="eager", streaming=True, num_fragments=3, alpha=0.5),
    "naive_streaming_sequential_d2": dict(delayed_outer="naive", streaming=True, num_fragments=3, alpha=0.3,
                                          fragment_order="sequential", outer_delay=2),
    "eager_tokens_drop": dict(delayed_outer="eager", island_speed=(1.0, 0.5, 1.0, 0.25), island_weighting="tokens",
                              drops=((6, 2),)),
}


def run(cfg, data, inner, **kwargs):
    algo = dl.DiLoCo(cfg, toy_loss, inner, **kwargs)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
    return np.array(losses), state, algo


@pytest.mark.parametrize("case", list(CASES))
def test_step_matches_reference(case):
    """AdamW islands, Nesterov outer copies: losses, the evaluated model (the islands'
    mean) and every island's own outer copy equal the reference's."""
    k = 4 if "drop" in case else 2
    cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=3, **CASES[case])
    data = batches(12)
    losses, state, algo = run(cfg, data, optax.adamw(0.02, weight_decay=1e-4))
    dropped = (lambda t, i: (t, i) in cfg.drops) if cfg.drops else None
    ref_losses, ref_mean, ref_outers = np_run_delayed(
        toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=k, h=3, inner=NpAdamW(0.02), mode=cfg.delayed_outer,
        delay=cfg.outer_delay, streaming=cfg.streaming, p=cfg.num_fragments, order=cfg.fragment_order, alpha=cfg.alpha,
        outer_opt=NpNesterov(0.7, 0.9), speeds=cfg.island_steps, weighting=cfg.island_weighting, dropped=dropped)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for n, got in toy_to_numpy(algo.outer_model(state)).items():
        np.testing.assert_allclose(got, ref_mean[n], rtol=2e-5, atol=2e-5)
    copies = toy_to_numpy(state.island_outer.params)  # leaves with an island axis
    for i in range(k):
        for n, got in copies.items():
            np.testing.assert_allclose(got[i], ref_outers[i][n], rtol=2e-5, atol=2e-5)


# the NumPy reference steps the poisoned island too; its NaN stays out of every mean
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_island_is_reset_to_its_own_outer_copy():
    """Island 1 sees a NaN batch at t = 5: the sync at t = 6 leaves it out (1 contributor),
    and the apply resets it to its own outer copy, as the reference has it when island 1 is
    dropped from that sync (naive, SGD: the reset island then trains as the reference's)."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=3, delayed_outer="naive")
    data = batches(12)
    data[4] = data[4].copy()
    data[4][4:] = np.nan  # island 1's rows
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05))
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    losses, resets, contributed = [], {}, {}
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m["loss_island_0"], m["loss_island_1"]])
        resets[int(m["step"])] = int(m.get("islands_reset", 0))
        contributed[int(m["step"])] = int(m.get("islands_contributed", 0))
    assert {t: n for t, n in resets.items() if n} == {6: 1}
    assert [contributed[t] for t in (3, 6, 9, 12)] == [2, 1, 2, 2]
    ref_losses, ref_mean, _ = np_run_delayed(
        toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=2, h=3, inner=NpSGD(0.05), mode="naive",
        dropped=lambda t, i: (t, i) == (6, 1))
    losses = np.array(losses)
    assert np.isnan(losses[4:6, 1]).all() and np.isfinite(losses[6:]).all()  # back after the apply at t = 6
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for n, got in toy_to_numpy(algo.outer_model(state)).items():
        np.testing.assert_allclose(got, ref_mean[n], rtol=2e-5, atol=2e-5)


def test_modes_differ_and_eager_copies_drift_apart():
    """The comparison above is not vacuous: none, naive and eager give different losses;
    naive islands keep identical outer copies, eager ones do not."""
    data, inner = batches(9), optax.sgd(0.05)
    got = {}
    for mode in ("none", "naive", "eager"):
        losses, state, _ = run(dl.DiLoCoConfig(num_replicas=2, sync_period=3, delayed_outer=mode), data, inner)
        got[mode] = losses
        if mode != "none":
            w = np.asarray(state.island_outer.params.layers.w)
            assert (np.array_equal(w[0], w[1])) == (mode == "naive")
    assert not np.allclose(got["none"][3:], got["naive"][3:], rtol=1e-4)
    assert not np.allclose(got["naive"][3:], got["eager"][3:], rtol=1e-4)
    # until the first sync every mode is the same inner training
    np.testing.assert_array_equal(got["none"][:3], got["eager"][:3])


def test_the_rule_on_numbers_worked_by_hand():
    """K = 2, island 0 of a scalar fragment: fresh Δ_0 = 0.4 at round r, the mean of round
    r − 1 was 0.3 with island 0's share 0.5·0.2 = 0.1 of it, so eager steps on
    0.5·0.4 + 0.3 − 0.1 = 0.4 and naive on 0.3; what stays in flight from a mean 0.5 is
    0.5 − 0.5·0.4 = 0.3 (eager) or 0.5 (naive)."""
    fresh, half = jnp.array(0.4), jnp.array(0.5)
    arrived_eager = jnp.array(0.3 - 0.1)
    assert float(delayed.outer_delta("eager", fresh, half, arrived_eager)) == pytest.approx(0.4)
    assert float(delayed.outer_delta("naive", fresh, half, jnp.array(0.3))) == pytest.approx(0.3)
    assert float(delayed.in_flight_part("eager", jnp.array(0.5), fresh, half)) == pytest.approx(0.3)
    assert float(delayed.in_flight_part("naive", jnp.array(0.5), fresh, half)) == pytest.approx(0.5)


def test_slots_cycle_over_rounds():
    sched = dl.DiLoCoConfig(sync_period=4, streaming=True, num_fragments=2).schedule  # H_eff 4
    assert [int(delayed.slot(sched, 2, t)) for t in (2, 4, 6, 8, 10, 12)] == [0, 1, 1, 0, 0, 1]


def test_knob_errors_are_named():
    with pytest.raises(ValueError, match=r"delayed_outer must be one of \('none', 'naive', 'eager'\); got 'lazy'"):
        dl.DiLoCoConfig(delayed_outer="lazy")
    with pytest.raises(ValueError, match=r"outer_delay must be an integer >= 1"):
        dl.DiLoCoConfig(delayed_outer="eager", outer_delay=0)
    with pytest.raises(ValueError, match=r"delayed_outer='eager' needs overlap_steps \(V\) = 0"):
        dl.DiLoCoConfig(delayed_outer="eager", streaming=True, num_fragments=2, sync_period=4, overlap_steps=1)
    with pytest.raises(ValueError, match=r"delayed_outer='naive' supports compression='none' only"):
        dl.DiLoCoConfig(delayed_outer="naive", compression="fp4")


def test_stored_outer_is_not_the_model_to_evaluate():
    """With delayed outer updates the stored outer model stays the initial one: after a sync
    algo.outer_model(state) is the islands' mean of their outer copies, not state.outer. A
    step of a DiLoCo without delayed updates refuses the state by name."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=3, delayed_outer="eager")
    _, state, algo = run(cfg, batches(3), optax.sgd(0.1))
    start, stored = toy_to_numpy(make_toy(N_LAYERS, WIDTH)), toy_to_numpy(state.outer)
    mean = toy_to_numpy(algo.outer_model(state))
    copies = toy_to_numpy(state.island_outer.params)
    for n in start:
        np.testing.assert_array_equal(stored[n], start[n])
        np.testing.assert_allclose(mean[n], copies[n].mean(axis=0), rtol=1e-6, atol=1e-7)
    assert any(not np.allclose(mean[n], stored[n]) for n in start)
    other = dl.DiLoCo(dl.DiLoCoConfig(num_replicas=2, sync_period=3), toy_loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match="delayed_outer: the state was made by a DiLoCo with another delayed_outer"):
        other.step(state, batches(1)[0])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mesh2", "drjax"])
def test_same_numbers_on_a_mesh_and_on_drjax(where):
    """Eager, token-weighted, streaming: islands on 2 device slices (the sums cross devices)
    or the drjax backend give the numbers of the single-device run."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4, streaming=True, num_fragments=2, delayed_outer="eager",
                          island_speed=(1.0, 0.5), island_weighting="tokens")
    inner, data = optax.adamw(0.02, weight_decay=1e-4), batches(8)
    base, base_state, base_algo = run(cfg, data, inner, backend="shard_map")
    mesh = dl.make_mesh(2) if where == "mesh2" else None
    losses, state, algo = run(cfg, data, inner, mesh=mesh, backend="drjax" if where == "drjax" else "shard_map")
    np.testing.assert_allclose(losses, base, rtol=1e-6)
    for n, got in toy_to_numpy(algo.outer_model(state)).items():
        np.testing.assert_allclose(got, toy_to_numpy(base_algo.outer_model(base_state))[n], rtol=1e-6, atol=1e-7)
