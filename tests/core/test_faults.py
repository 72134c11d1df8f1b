"""Island faults: dropped islands and non-finite pseudo-gradients leave the mean, against the
NumPy reference with the same drops; an all-dropped sync changes nothing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from tests.reference import NpAdamW, NpSGD, make_toy, toy_loss, toy_to_numpy
from tests.helpers import N_LAYERS, WIDTH, alternating, batches, fast_and_slow, make_diloco, reference_run


def reference(cfg, data, dropped, log=None):
    return reference_run(cfg, data, NpSGD(0.05), dropped=dropped, log=log)


def coin_drops(cfg):
    """The drop_prob coins, drawn here the way the config documents them."""
    probs = np.asarray(cfg.island_drop_probs)

    def dropped(t, i):
        u = jax.random.uniform(jax.random.fold_in(jax.random.key(cfg.fault_seed), t), (len(probs),))
        return bool(np.asarray(u)[i] < probs[i])

    return dropped


def run_and_record(cfg, data, mesh=None):
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05), mesh=mesh)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    losses, counts = [], {}
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
        if "islands_contributed" in m:
            counts[m["step"] - int(algo.plan.deferred)] = m["islands_contributed"]
    return np.array(losses), toy_to_numpy(algo.outer_model(state)), counts


LISTED = ((4, 1), (8, 0), (8, 3), (12, 2), (16, 0), (16, 1), (16, 2), (16, 3))


DROP_GRID = [(*c, kind) for c in [(False, 0, "none"), (True, 0, "none"), (True, 1, "none"), (True, 2, "fp4")]
             for kind in ["listed", "coin"]]


# by default each config once, listed and coin drops in turn; the slow set runs both on each
@pytest.mark.parametrize("streaming,v,fmt,kind", fast_and_slow(DROP_GRID, alternating(DROP_GRID)))
def test_drops_match_reference(streaming, v, fmt, kind):
    common = dict(num_replicas=4, sync_period=4, compression=fmt)
    if streaming:
        common.update(streaming=True, sync_period=6, num_fragments=3, overlap_steps=v, alpha=0.5)
    if kind == "listed":
        sched = dl.Schedule.from_config(dl.DiLoCoConfig(**common))
        cfg = dl.DiLoCoConfig(**common, drops=[d for d in LISTED if sched.sync_fragment(d[0]) is not None])
        dropped = lambda t, i: (t, i) in cfg.drops  # noqa: E731
    else:
        cfg = dl.DiLoCoConfig(**common, drop_prob=[0.0, 0.5, 0.25, 0.9], fault_seed=3)
        dropped = coin_drops(cfg)
    data = batches(24)
    log = {}
    ref_losses, ref_outer, _ = reference(cfg, data, dropped, log)
    mesh = None if kind == "listed" else dl.make_mesh(2)  # each config meets both (with the slow set)
    losses, outer, counts = run_and_record(cfg, data, mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    for name in outer:
        np.testing.assert_allclose(outer[name], ref_outer[name], rtol=2e-5, atol=2e-5)
    assert {t: c for t, c in log["contributed"] if t in counts} == counts
    assert min(c for _, c in log["contributed"]) < 4  # some sync really lost islands
    plain = reference(dl.DiLoCoConfig(**common), data, None)[1]
    assert any(not np.allclose(plain[n], ref_outer[n], rtol=1e-4) for n in plain)


def test_all_dropped_sync_changes_nothing():
    # vanilla, H=3: the sync at t=6 loses both islands
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=3, drops=[(6, 0), (6, 1)])
    inner = optax.sgd(0.05)
    algo = dl.DiLoCo(cfg, toy_loss, inner)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    data = batches(6)
    for x in data[:5]:
        state, _ = algo.step(state, x)
    before = jax.tree.map(np.asarray, (algo.outer_model(state), state.outer_opt_state))
    state, m = algo.step(state, data[5])
    after = jax.tree.map(np.asarray, (algo.outer_model(state), state.outer_opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    assert m["islands_contributed"] == 0 and m["outer_update_norm"] == 0.0
    # and the islands still received the (unchanged) outer model: they rejoin
    for i in range(2):
        for name, want in toy_to_numpy(algo.outer_model(state)).items():
            np.testing.assert_array_equal(toy_to_numpy(state.island(i))[name], want)


# the NumPy reference steps the poisoned island too: inf - inf is its NaN, on purpose
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("mesh_size", [None, 2])
def test_non_finite_island_is_dropped_and_rejoins(bad, mesh_size):
    """Island 1 sees a NaN/Inf batch at t=5, so its parameters (and pseudo-gradient at the
    sync t=6) are non-finite: the sync averages island 0 alone, reports 1 contributor, and
    the apply hands island 1 finite outer parameters again."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=3)
    data = batches(9)
    data[4] = data[4].copy()
    data[4][4:] = bad  # island 1's rows
    mesh = None if mesh_size is None else dl.make_mesh(mesh_size)
    losses, outer, counts = run_and_record(cfg, data, mesh)
    log = {}
    ref_losses, ref_outer, _ = reference(cfg, data, None, log)
    assert counts == {3: 2, 6: 1, 9: 2} == dict(log["contributed"])
    assert all(np.all(np.isfinite(v)) for v in outer.values())
    for name in outer:
        np.testing.assert_allclose(outer[name], ref_outer[name], rtol=2e-5, atol=2e-5)
    assert np.isfinite(losses[6:]).all()  # island 1 is back after the apply at t=6


def test_fault_knobs_are_validated():
    with pytest.raises(ValueError, match="drops step 5 is not a sync step"):
        dl.DiLoCoConfig(num_replicas=2, sync_period=3, drops=[(5, 0)])
    with pytest.raises(ValueError, match=r"drops island must be in 0..K-1 = 0..1; got 2"):
        dl.DiLoCoConfig(num_replicas=2, sync_period=3, drops=[(3, 2)])
    with pytest.raises(ValueError, match=r"drop_prob needs one value per island \(K=2\); got 3"):
        dl.DiLoCoConfig(num_replicas=2, drop_prob=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"drop_prob must be a number in \[0, 1\]; got 1.5"):
        dl.DiLoCoConfig(num_replicas=2, drop_prob=1.5)
    with pytest.raises(ValueError, match="drops must be a list of"):
        dl.DiLoCoConfig(num_replicas=2, drops=[3])


RESET_MODES = {
    "vanilla": dict(sync_period=3),
    "streaming_v0": dict(streaming=True, sync_period=6, num_fragments=3),
    "streaming_v2": dict(streaming=True, sync_period=6, num_fragments=3, overlap_steps=2, alpha=0.5),
    "streaming_v2_free": dict(streaming=True, sync_period=6, num_fragments=3, overlap_steps=2, alpha=0.5),
}


@pytest.mark.parametrize("mode", list(RESET_MODES))
def test_non_finite_island_is_reset_and_rejoins_under_adamw(mode):
    """Island 1 sees a NaN batch at t=5, which poisons its AdamW moments too. At the next
    apply (t=6 in each mode) it is reset: the outer model and fresh moments (the step count
    kept), so it trains finitely again from t=7 and contributes to every later sync."""
    cfg = dl.DiLoCoConfig(num_replicas=2, **RESET_MODES[mode])
    inner, inner_np = optax.adamw(0.01, weight_decay=1e-4), NpAdamW(0.01)
    data = batches(18)
    data[4] = data[4].copy()
    data[4][4:] = np.nan
    # "_free": the deferred exchange free of the inner step, as on an accelerator
    algo = make_diloco(cfg, inner, exchange_after_inner=False if mode.endswith("_free") else None)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    losses, resets, contributed = [], {}, {}
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m["loss_island_0"], m["loss_island_1"]])
        if "islands_reset" in m:
            resets[m["step"]] = m["islands_reset"]
        if "islands_contributed" in m:
            contributed[m["step"] - int(algo.plan.deferred)] = m["islands_contributed"]
    log = {}
    ref_losses, ref_outer, ref_islands = reference_run(cfg, data, inner_np, log=log)
    assert log["resets"] == [(6, 1)]
    assert {t: n for t, n in resets.items() if n} == {6: 1}
    losses = np.array(losses)
    assert np.isnan(losses[4, 1]) and np.isfinite(losses[6:]).all()
    assert all(n == 2 for t, n in contributed.items() if t > 6)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    for name, got in toy_to_numpy(algo.outer_model(state)).items():
        np.testing.assert_allclose(got, ref_outer[name], rtol=2e-5, atol=2e-5)
    for i, isl in enumerate(ref_islands):
        for name, got in toy_to_numpy(state.island(i)).items():
            np.testing.assert_allclose(got, isl[name], rtol=2e-5, atol=2e-5)
    mu = state.inner_opt_state[0].mu
    assert np.isfinite(np.asarray(mu.embed)).all()
    assert np.asarray(state.inner_opt_state[0].count).tolist() == [18, 18]  # schedules continue


def _exchange(islands, drops=()):
    """One vanilla sync at t=3 of K=3 islands holding `islands` (one toy model's arrays per
    island, stacked), taken unchecked and checked: (outer, outer optimizer states, residual,
    report, finite, trusted) of each, and the outer model before."""
    from diloco_eqx import exchange

    cfg = dl.DiLoCoConfig(num_replicas=3, sync_period=3, outer_lr=0.7, outer_momentum=0.9,
                          drops=[(3, i) for i in drops])
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.1))
    arrays = eqx.filter(algo.init(make_toy(N_LAYERS, WIDTH)), eqx.is_array)
    plan = algo.plan.for_model(arrays.outer)

    def sync(checked):
        return jax.jit(lambda inner: exchange.sync_fragment(
            plan, 0, jnp.int32(3), inner, arrays.outer, arrays.outer_opt_state, None, checked=checked))(islands)

    return sync(False), sync(True), arrays.outer


def _islands(bad=None):
    """Three different toy models stacked as islands; island `bad` with one NaN weight."""
    toys = [make_toy(N_LAYERS, WIDTH, seed=s) for s in (1, 2, 3)]
    if bad is not None:
        toys[bad] = eqx.tree_at(lambda m: m.layers.w, toys[bad], toys[bad].layers.w.at[1, 0].set(jnp.nan))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[eqx.filter(t, eqx.is_array) for t in toys])
    return stacked, [toy_to_numpy(t) for t in toys]


def _nesterov_first_step(outer, toys, which):
    """The first Nesterov step (η = 0.7, β = 0.9, zero trace) on the mean pseudo-gradient of
    the islands in `which`, by hand: θ − η(1 + β)·Δ̄."""
    return {n: o - 0.7 * 1.9 * np.mean([o - toys[i][n] for i in which], axis=0) for n, o in outer.items()}


@pytest.mark.parametrize("case", ["healthy", "nan_island", "dropped_island"])
def test_unchecked_sync_is_trusted_only_when_its_norm_is_finite_and_every_island_sent(case):
    """The exchange first averages as if every island were finite and trusts the result only
    when the mean's norm is finite and every island sent (then it steps the outer model and
    knows every island finite without reading a fragment twice); otherwise it changes nothing
    and the checked pass gives the numbers of checking first."""
    bad, drops = {"healthy": (None, ()), "nan_island": (1, ()), "dropped_island": (None, (2,))}[case]
    stacked, toys = _islands(bad)
    (u_outer, u_opt, _, u_report, u_finite, trusted), (c_outer, _, _, c_report, c_finite, c_trusted), before = (
        _exchange(stacked, drops))
    outer0 = toy_to_numpy(before)
    which = [i for i in range(3) if i != bad and i not in drops]
    want = _nesterov_first_step(outer0, toys, which)
    checked = toy_to_numpy(c_outer)
    for name in want:
        np.testing.assert_allclose(checked[name], want[name], rtol=1e-6, atol=1e-6)
    assert bool(c_trusted) and int(c_report.islands_contributed) == len(which)
    assert np.asarray(c_finite).tolist() == [i != bad for i in range(3)]
    unchecked = toy_to_numpy(u_outer)
    if case == "healthy":
        assert bool(trusted) and np.asarray(u_finite).tolist() == [True] * 3
        for name in want:  # the same numbers, bit for bit
            np.testing.assert_array_equal(unchecked[name], checked[name])
        assert float(u_report.outer_update_norm) == float(c_report.outer_update_norm) > 0
    else:
        assert not bool(trusted)
        assert np.isfinite(float(u_report.pseudo_grad_norm)) == (case == "dropped_island")
        for name in want:  # nothing stepped: the outer model and its trace are as they were
            np.testing.assert_array_equal(unchecked[name], outer0[name])
        assert float(u_report.outer_update_norm) == 0.0
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u_opt))
