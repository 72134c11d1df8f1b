"""DiLoCo's step against the independent NumPy reference, and its degenerate cases (the
compiled step's structure: tests/perf/test_step_hlo.py)."""

import itertools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from tests.helpers import (N_LAYERS, WIDTH, batches, count_compilations, fast_and_slow, make_diloco, reference_run,
                           run_jax)
from tests.reference import NpAdamW, NpSGD, make_toy, toy_loss, toy_to_numpy

def assert_matches_reference(cfg, inner_jax, inner_np, steps):
    data = batches(steps)
    losses, state = run_jax(cfg, inner_jax, data)
    ref_losses, ref_outer, ref_islands = reference_run(cfg, data, inner_np)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    outer = toy_to_numpy(state.outer)  # run_jax's state has every sync folded in
    for name in outer:
        np.testing.assert_allclose(outer[name], ref_outer[name], rtol=2e-5, atol=2e-5)
    for i, isl in enumerate(ref_islands):
        got = toy_to_numpy(state.island(i))
        for name in got:
            np.testing.assert_allclose(got[name], isl[name], rtol=2e-5, atol=2e-5)
    assert int(state.outer.calls) == 7 and np.all(np.asarray(state.inner_model.calls) == 7)
    assert int(state.step) == steps


STREAMING_GRID = list(
    itertools.product([1, 2, 4], ["interleaved", "sequential"], [0, 1, 2], [0.0, 0.5, 1.0])
)


# by default every pair of knob values once (9 configs); the slow set runs all 54
@pytest.mark.parametrize("k,order,v,alpha", fast_and_slow(STREAMING_GRID))
def test_streaming_matches_reference_sgd(k, order, v, alpha):
    # H=6, P=3: Δh=2, H_eff=6; 3·H_eff = 18 steps.
    cfg = dl.DiLoCoConfig(
        num_replicas=k, sync_period=6, streaming=True, num_fragments=3,
        fragment_order=order, overlap_steps=v, alpha=alpha, outer_lr=0.7, outer_momentum=0.9,
    )
    assert_matches_reference(cfg, optax.sgd(0.05), NpSGD(0.05), steps=18)


@pytest.mark.parametrize(
    "k,order,v,alpha",
    [(1, "interleaved", 1, 0.5), (4, "interleaved", 2, 0.5), (4, "sequential", 1, 1.0),
     pytest.param(1, "sequential", 2, 0.0, marks=pytest.mark.slow),
     pytest.param(4, "interleaved", 0, 0.0, marks=pytest.mark.slow)],
)
def test_streaming_matches_reference_adamw(k, order, v, alpha):
    # H=10, P=5: Δh=2, H_eff=10 (fragments of one layer each); 3·H_eff = 30 steps.
    cfg = dl.DiLoCoConfig(
        num_replicas=k, sync_period=10, streaming=True, num_fragments=5,
        fragment_order=order, overlap_steps=v, alpha=alpha, outer_lr=0.5, outer_momentum=0.8,
    )
    assert_matches_reference(cfg, optax.adamw(0.01, weight_decay=1e-4), NpAdamW(0.01), steps=30)


def blocks_of_one_and_two(n, p):
    """Fragment 1 owns layers 0, 1 and 3 (a block of two and a block of one), fragment 2 layer 2."""
    return ((0, 1, 3), (2,))


@pytest.mark.parametrize("v,alpha", [(0, 0.5), (1, 0.0)])
def test_fragment_of_several_blocks_matches_reference(v, alpha):
    """A fragment whose layers form blocks of unequal length is averaged, stepped and applied
    block by block; the result is the reference's, which updates the layers by index."""
    cfg = dl.DiLoCoConfig(
        num_replicas=2, sync_period=6, streaming=True, num_fragments=3, fragment_order=blocks_of_one_and_two,
        overlap_steps=v, alpha=alpha, outer_lr=0.5, outer_momentum=0.8,
    )
    assert_matches_reference(cfg, optax.adamw(0.01, weight_decay=1e-4), NpAdamW(0.01), steps=18)


@pytest.mark.parametrize("k,opt", fast_and_slow(list(itertools.product([1, 2, 4], ["sgd", "adamw"])),
                                              [(1, "sgd"), (2, "adamw"), (4, "sgd")]))
def test_vanilla_matches_reference(k, opt):
    cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=5, outer_lr=0.7, outer_momentum=0.9)
    inner = (optax.sgd(0.05), NpSGD(0.05)) if opt == "sgd" else (
        optax.adamw(0.01, weight_decay=1e-4), NpAdamW(0.01))
    assert_matches_reference(cfg, *inner, steps=15)


def test_h_not_multiple_of_p_matches_reference():
    # H=7, P=3: Δh=round(2.33)=2, H_eff=6 (with a warning).
    with pytest.warns(UserWarning, match="H_eff=6"):
        cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=7, streaming=True, num_fragments=3,
                              overlap_steps=1, alpha=0.5)
    assert_matches_reference(cfg, optax.sgd(0.05), NpSGD(0.05), steps=18)


def test_one_island_every_step_is_plain_training():
    """K=1, H=1, η_outer=1, β=0: the outer step copies the island, i.e. plain training."""
    cfg = dl.DiLoCoConfig(num_replicas=1, sync_period=1, outer_lr=1.0, outer_momentum=0.0)
    inner = optax.adamw(0.01)
    data = batches(12)
    losses, state = run_jax(cfg, inner, data)

    model = make_toy(N_LAYERS, WIDTH)
    params = model
    opt_state = inner.init(eqx.filter(params, eqx.is_inexact_array))
    plain = []
    for x in data:
        loss, grads = eqx.filter_value_and_grad(toy_loss)(params, x)
        updates, opt_state = inner.update(grads, opt_state, eqx.filter(params, eqx.is_inexact_array))
        params = eqx.apply_updates(params, updates)
        plain.append(float(loss))
    np.testing.assert_allclose(losses[:, 0], plain, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(state.outer), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("deferred", [False, True])
def test_alpha_one_islands_train_independently_while_outer_moves(deferred):
    """Streaming with α=1: islands equal K separate plain runs; the outer model still moves
    (deferred: in the step after the sync, when the exchange runs)."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3,
                          overlap_steps=1, alpha=1.0)
    inner = optax.sgd(0.05)
    data = batches(12)
    model = make_toy(N_LAYERS, WIDTH)
    algo = make_diloco(cfg, inner, deferred=deferred)
    state = algo.init(model)
    outer_before = toy_to_numpy(state.outer)
    for t, x in enumerate(data, start=1):
        prev = toy_to_numpy(state.outer)
        state, m = algo.step(state, x)
        now = toy_to_numpy(state.outer)
        moved = {n for n in now if not np.array_equal(now[n], prev[n])}
        f = dl.Schedule.from_config(cfg).sync_fragment(t - int(deferred))
        if f is None:
            assert not moved, f"outer params moved without a sync at t={t}"
        else:
            expected = {"embed", "head"} if f == 0 else {"w", "b"}
            assert moved == expected, (t, f, moved)
    assert not np.allclose(toy_to_numpy(state.outer)["embed"], outer_before["embed"])
    for i in range(2):
        params = model
        for x in data:
            grads = eqx.filter_grad(toy_loss)(params, x[i * 4:(i + 1) * 4])
            params = eqx.apply_updates(params, jax.tree.map(lambda g: -0.05 * g, grads))
        got = toy_to_numpy(state.island(i))
        for name, want in toy_to_numpy(params).items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)


def test_gbs_not_divisible_by_k():
    cfg = dl.DiLoCoConfig(num_replicas=3, sync_period=2)
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.1))
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    with pytest.raises(ValueError, match=r"global batch size \(GBS\)=8 .*num_replicas \(K\)=3"):
        algo.step(state, batches(1)[0])


def test_state_is_donated_and_model_untouched():
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=2)
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.1))
    model = make_toy(N_LAYERS, WIDTH)
    state = algo.init(model)
    x = batches(1)[0]
    new_state, _ = algo.step(state, x)
    assert state.outer.embed.is_deleted()
    assert not model.embed.is_deleted() and np.isfinite(np.asarray(x)).all()
    algo.step(new_state, x)


def test_metrics_report_sync_and_apply():
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=12, streaming=True, num_fragments=4,
                          overlap_steps=1)
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05))
    state = algo.init(make_toy(3, WIDTH))
    seen = {}
    for x in batches(13):
        state, m = algo.step(state, x)
        seen[m["step"]] = dict(m)
    assert seen[3]["sync_fragment"] == 1 and "apply_fragment" not in seen[3]
    assert seen[4]["apply_fragment"] == 1 and "sync_fragment" not in seen[4]
    assert seen[12]["sync_fragment"] == 0 and seen[13]["apply_fragment"] == 0
    # V=1: the exchange (and its diagnostics) comes in the step after the sync
    assert "pseudo_grad_norm" not in seen[3] and seen[4]["exchanged_fragment"] == 1
    assert seen[4]["pseudo_grad_norm"] > 0 and seen[4]["outer_update_norm"] > 0
    assert seen[4]["islands_contributed"] == 2
    assert "pseudo_grad_norm" not in seen[5]
    assert seen[5]["loss"] == pytest.approx((seen[5]["loss_island_0"] + seen[5]["loss_island_1"]) / 2)


@pytest.mark.parametrize("mesh_size", [None, 2])
def test_compiles_once_over_three_periods(mesh_size):
    """3·H_eff steps crossing every sync/apply position trigger exactly one compilation."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=12, streaming=True, num_fragments=4,
                          overlap_steps=1, alpha=0.5)
    mesh = None if mesh_size is None else dl.make_mesh(mesh_size)
    algo = dl.DiLoCo(cfg, toy_loss, optax.adamw(0.01), mesh=mesh)
    state = algo.init(make_toy(3, WIDTH))
    data = batches(36)
    with count_compilations() as compiles:
        for x in data:
            state, m = algo.step(state, x)
            m["loss"]  # fetching metrics must not compile anything either
    assert compiles.count == 1


def _mse(model, batch):
    x, y = batch[:, :4], batch[:, 4:6]
    return jax.numpy.mean((jax.vmap(model)(x) - y) ** 2)


class _ListModel(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.tanh(layer(x))
        return self.layers[-1](x)


@pytest.mark.parametrize("kind", ["mlp", "list"])
def test_vanilla_trains_any_equinox_model(kind):
    """eqx.nn.MLP and a model holding a plain list of layers, no `layers=` argument: every
    step equals two islands trained by hand with optax, averaged and moved by a NumPy
    Nesterov step at each sync."""
    keys = jax.random.split(jax.random.key(1), 3)
    if kind == "mlp":
        model = eqx.nn.MLP(4, 2, 16, 2, key=keys[0])
    else:
        model = _ListModel([eqx.nn.Linear(4, 8, key=keys[0]), eqx.nn.Linear(8, 8, key=keys[1]),
                            eqx.nn.Linear(8, 2, key=keys[2])])
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=3, outer_lr=0.7, outer_momentum=0.9)
    inner = optax.sgd(0.1)
    rng = np.random.default_rng(0)
    data = [rng.normal(size=(8, 6)).astype(np.float32) for _ in range(9)]
    algo = dl.DiLoCo(cfg, _mse, inner)
    state = algo.init(model)
    got = []
    for x in data:
        state, m = algo.step(state, x)
        got.append([m["loss_island_0"], m["loss_island_1"]])

    leaves, treedef = jax.tree.flatten(eqx.filter(model, eqx.is_inexact_array))
    outer = [np.asarray(v, np.float64) for v in leaves]
    trace = [np.zeros_like(v) for v in outer]
    islands = [list(outer), list(outer)]
    want = []
    for t, x in enumerate(data, start=1):
        row = []
        for k in range(2):
            m_k = eqx.combine(jax.tree.unflatten(treedef, [jax.numpy.asarray(v, jax.numpy.float32) for v in islands[k]]), model)
            loss, g = eqx.filter_value_and_grad(_mse)(m_k, x[4 * k:4 * k + 4])
            islands[k] = [v - 0.1 * np.asarray(gv, np.float64) for v, gv in zip(islands[k], jax.tree.leaves(g))]
            row.append(float(loss))
        want.append(row)
        if t % 3 == 0:
            delta = [np.mean([o - isl[j] for isl in islands], axis=0) for j, o in enumerate(outer)]
            trace = [d + 0.9 * v for d, v in zip(delta, trace)]
            outer = [o - 0.7 * (d + 0.9 * v) for o, d, v in zip(outer, delta, trace)]
            islands = [list(outer), list(outer)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(eqx.filter(algo.outer_model(state), eqx.is_inexact_array)), outer):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


def test_outer_model_folds_in_a_sync_still_in_flight():
    """With V >= 1 the exchange of a sync at the last step is still in flight: the stored
    outer model misses it, and algo.outer_model(state) folds it in: right after the sync it
    differs from the stored value and is the outer model the next step stores (that step
    runs the exchange and syncs nothing). Vanilla DiLoCo has nothing in flight: its outer
    model is the stored one."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4, streaming=True, num_fragments=2, overlap_steps=1)
    inner = optax.sgd(0.05)
    algo = dl.DiLoCo(cfg, toy_loss, inner)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    data = batches(3)
    for x in data[:2]:  # t = 2 is a sync step (Δh = 2): its exchange runs at t = 3
        state, _ = algo.step(state, x)
    folded, stored = toy_to_numpy(algo.outer_model(state)), toy_to_numpy(state.outer)
    assert any(not np.array_equal(folded[n], stored[n]) for n in folded)
    state, _ = algo.step(state, data[2])
    for n, got in toy_to_numpy(state.outer).items():
        np.testing.assert_allclose(got, folded[n], rtol=1e-6, atol=1e-7)
    vanilla = dl.DiLoCo(dl.DiLoCoConfig(num_replicas=2, sync_period=4), toy_loss, inner)
    state = vanilla.init(make_toy(N_LAYERS, WIDTH))
    assert vanilla.outer_model(state) is state.outer  # nothing can be in flight
