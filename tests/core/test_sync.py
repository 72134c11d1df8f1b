"""The outer side's dtype policy: islands train in their own dtype (float32, bfloat16,
float16), the outer model and its optimizer state stay float32, pseudo-gradients are formed
and averaged in float32, and the apply casts back — checked against the NumPy reference
with the same roundings written out."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from tests.reference import NpAdamW, NpScheduledSGD, NpSGD, make_toy, np_run, toy_loss, toy_to_numpy
from tests.helpers import N_LAYERS, WIDTH, batches, fast_and_slow

DTYPES = {"float32": (jnp.float32, None), "bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16),
          "float16": (jnp.float16, np.float16)}
MODES = {
    "vanilla": dict(sync_period=3),
    "streaming_v0": dict(streaming=True, sync_period=6, num_fragments=3, alpha=0.5),
    "streaming_v1": dict(streaming=True, sync_period=6, num_fragments=3, overlap_steps=1, alpha=0.5),
}
FORMATS = ["none", "bf16", "fp8", "fp4"]
GRID = list(itertools.product(DTYPES, FORMATS, MODES))
# the fast run takes each dtype with each mode once, compression formats cycling through
FAST = {(d, FORMATS[(i + j) % 4], m) for i, d in enumerate(DTYPES) for j, m in enumerate(MODES)}


def run_both(dtype, cfg, steps=12, lr=0.05):
    """(JAX state, its outer model, per-step losses) and the reference's (losses, outer,
    islands), from the same toy model stored in `dtype`."""
    jdt, ndt = DTYPES[dtype]
    model = make_toy(N_LAYERS, WIDTH, dtype=jdt)
    data = batches(steps)
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(lr))
    state = algo.init(model)
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
    ref = np_run(
        toy_to_numpy(model), data, k=cfg.num_replicas, h=cfg.sync_period, inner=NpSGD(lr, ndt),
        streaming=cfg.streaming, p=cfg.num_fragments, v=cfg.overlap_steps, alpha=cfg.alpha,
        compression=cfg.compression, dtype=ndt, outer_dtype=cfg.outer_dtype,
    )
    return state, algo.outer_model(state), np.array(losses), ref


@pytest.mark.parametrize(
    "dtype,fmt,mode",
    [g if g in FAST else pytest.param(*g, marks=pytest.mark.slow) for g in GRID],
)
def test_low_precision_matches_reference(dtype, fmt, mode):
    cfg = dl.DiLoCoConfig(num_replicas=2, compression=fmt, **MODES[mode])
    state, outer, losses, (ref_losses, ref_outer, ref_islands) = run_both(dtype, cfg)
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    for name, got in toy_to_numpy(outer).items():
        np.testing.assert_allclose(got, ref_outer[name], rtol=2e-5, atol=2e-5)
    for i, isl in enumerate(ref_islands):
        for name, got in toy_to_numpy(state.island(i)).items():
            # islands are stored in `dtype`: the reference rounds the same way, so they agree
            # to float32 rounding of values that are then rounded to `dtype`
            np.testing.assert_allclose(got, isl[name], rtol=2e-5, atol=2e-5)
    jdt = DTYPES[dtype][0]
    assert state.inner_model.embed.dtype == jdt and state.inner_model.layers.w.dtype == jdt
    assert outer.embed.dtype == jnp.float32 and outer.layers.w.dtype == jnp.float32
    trace = [x for x in jax.tree.leaves(state.outer_opt_state) if eqx.is_inexact_array(x)]
    assert trace and all(x.dtype == jnp.float32 for x in trace)


@pytest.mark.parametrize("dtype,mode", fast_and_slow(list(itertools.product(["bfloat16", "float16"], ["vanilla", "streaming_v1"])),
                                                     [("bfloat16", "streaming_v1"), ("float16", "vanilla")]))
def test_outer_in_parameter_dtype(dtype, mode):
    """outer_dtype="param" keeps the outer model and trace in the parameters' dtype."""
    cfg = dl.DiLoCoConfig(num_replicas=2, compression="fp8", outer_dtype="param", **MODES[mode])
    state, outer, losses, (ref_losses, ref_outer, _) = run_both(dtype, cfg)
    jdt = DTYPES[dtype][0]
    assert outer.embed.dtype == jdt
    assert all(x.dtype == jdt for x in jax.tree.leaves(state.outer_opt_state) if eqx.is_inexact_array(x))
    # XLA decides inside its fused outer update whether β·v is rounded to the trace's dtype,
    # so the two sides may sit a unit in the last place of `dtype` (at the trace's scale,
    # about 1) apart
    ulp = {"bfloat16": 2.0**-7, "float16": 2.0**-10}[dtype]
    np.testing.assert_allclose(losses, ref_losses, rtol=ulp)
    for name, got in toy_to_numpy(outer).items():
        np.testing.assert_allclose(got, ref_outer[name], rtol=ulp, atol=ulp)


def test_outer_float32_keeps_small_updates_that_bfloat16_loses():
    """Why float32 is the default: with a tiny outer learning rate, the outer update is
    below half a unit in the last place of a bfloat16 outer model, which cannot move; a
    float32 one does."""
    moved = {}
    for policy in ("float32", "param"):
        cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=2, outer_lr=1e-3, outer_momentum=0.0,
                              outer_dtype=policy)
        state, outer, _, _ = run_both("bfloat16", cfg, steps=2)
        start = toy_to_numpy(make_toy(N_LAYERS, WIDTH, dtype=jnp.bfloat16))
        moved[policy] = np.mean([np.mean(toy_to_numpy(outer)[n] != start[n]) for n in start])
    assert moved["float32"] > 0.9 and moved["param"] < 0.1


def test_adamw_in_bfloat16_with_compression_stays_finite():
    """bfloat16 islands, AdamW and bf16 pseudo-gradients in every mode: the float32 outer side
    meets the bfloat16 islands with matching dtypes, every loss and outer value stays finite, and
    the islands stay bfloat16."""
    model = make_toy(N_LAYERS, WIDTH, dtype=jnp.bfloat16)
    inner = optax.adamw(0.01, weight_decay=1e-4)
    for mode in MODES.values():
        cfg = dl.DiLoCoConfig(num_replicas=2, compression="bf16", **mode)
        algo = dl.DiLoCo(cfg, toy_loss, inner)
        state = algo.init(model)
        for x in batches(13):
            state, m = algo.step(state, x)
            assert np.isfinite(m["loss"])
        assert state.inner_model.embed.dtype == jnp.bfloat16
        assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(algo.outer_model(state)))


def test_outer_dtype_knob_is_validated():
    with pytest.raises(ValueError, match=r"outer_dtype must be one of \('float32', 'param'\); got 'bf16'"):
        dl.DiLoCoConfig(outer_dtype="bf16")


# ---------------------------------------------------------------- pluggable outer optimizer

OUTER = {
    "adam": (lambda: optax.adam(0.1), lambda: NpAdamW(0.1, weight_decay=0.0)),
    "sgd_schedule": (lambda: optax.sgd(optax.linear_schedule(0.9, 0.3, 4)),
                     lambda: NpScheduledSGD(lambda c: 0.9 + (0.3 - 0.9) * min(c, 4) / 4)),
}


@pytest.mark.parametrize("name,v", fast_and_slow(list(itertools.product(OUTER, [0, 1])),
                                                  [("adam", 1), ("sgd_schedule", 0)]))
def test_any_outer_optimizer_with_one_state_per_fragment(name, v):
    """Outer Adam and outer SGD with a learning-rate schedule, streaming P=3: each fragment's
    optimizer state advances only on its own syncs (Adam's count is 3 per fragment after
    nine syncs, not 9), matching a reference that keeps one state per fragment."""
    make_jax, make_np = OUTER[name]
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3,
                          overlap_steps=v, alpha=0.5)
    inner = optax.sgd(0.05)
    data = batches(18)
    algo = dl.DiLoCo(cfg, toy_loss, inner, outer_optimizer=make_jax())
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m["loss_island_0"], m["loss_island_1"]])
    log = {}
    ref_losses, ref_outer, ref_islands = np_run(
        toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=2, h=6, inner=NpSGD(0.05), streaming=True,
        p=3, v=v, alpha=0.5, outer_opt=make_np(), log=log)
    np.testing.assert_allclose(np.array(losses), ref_losses, rtol=2e-5, atol=2e-5)
    for n, got in toy_to_numpy(algo.outer_model(state)).items():
        np.testing.assert_allclose(got, ref_outer[n], rtol=2e-5, atol=2e-5)
    counts = [int(optax.tree_utils.tree_get(s, "count")) for s in state.outer_opt_state]
    counts[0] += v  # with V = 1 fragment 0's sync at t = 18 is still in flight in the state
    assert counts == [3, 3, 3] == [s.get("t", s.get("count")) for _, s in sorted(log["outer_states"].items())]
    if name == "sgd_schedule":  # one count shared by every fragment gives other numbers
        shared = np_run(toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=2, h=6, inner=NpSGD(0.05),
                        streaming=True, p=3, v=v, alpha=0.5, outer_opt=_SharedCount(make_np()))[1]
        assert any(not np.allclose(shared[n], ref_outer[n], rtol=1e-4) for n in shared)


class _SharedCount:
    """The mistake per-fragment states avoid: one step count for all fragments."""

    def __init__(self, opt):
        self.opt, self.count = opt, 0

    def init(self, p):
        return None

    def step(self, p, g, s):
        new, state = self.opt.step(p, g, {"count": self.count})
        self.count = state["count"]
        return new, None


def test_a_state_of_another_outer_optimizer_is_refused_by_name():
    """A state made by a DiLoCo with outer Adam, stepped by one with the default Nesterov
    SGD: the step names the outer optimizer and the init to make the state with."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=2)
    inner = optax.sgd(0.05)
    state = dl.DiLoCo(cfg, toy_loss, inner, outer_optimizer=optax.adam(0.1)).init(make_toy(N_LAYERS, WIDTH))
    nesterov = dl.DiLoCo(cfg, toy_loss, inner)
    with pytest.raises(ValueError, match="outer_optimizer: .* make the state with this DiLoCo's init"):
        nesterov.step(state, batches(1)[0])


# ---------------------------------------------------------------- outer optimizers by name

@pytest.mark.parametrize("name, knobs, make_np", [
    ("adam", {"outer_lr": 0.05, "outer_momentum": 0.8, "outer_b2": 0.95},
     lambda: NpAdamW(0.05, b1=0.8, b2=0.95, weight_decay=0.0)),
    ("average", {"outer_lr": 0.3, "outer_momentum": 0.5}, lambda: NpSGD(1.0)),
])
def test_outer_optimizer_by_name_matches_its_rule(name, knobs, make_np):
    """`outer_optimizer="adam"` / `"average"` in the config alone (no optax object passed)
    step the outer model by the NumPy rule: Adam from the config's η, β1, β2; averaging as
    θ <- θ - Δ, whatever η and β say."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3,
                          overlap_steps=1, alpha=0.5, outer_optimizer=name, **knobs)
    inner, data = optax.sgd(0.05), batches(18)
    algo = dl.DiLoCo(cfg, toy_loss, inner)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m["loss_island_0"], m["loss_island_1"]])
    ref_losses, ref_outer, _ = np_run(toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=2, h=6,
                                      inner=NpSGD(0.05), streaming=True, p=3, v=1, alpha=0.5,
                                      outer_opt=make_np())
    np.testing.assert_allclose(np.array(losses), ref_losses, rtol=2e-5, atol=2e-5)
    for n, got in toy_to_numpy(algo.outer_model(state)).items():
        np.testing.assert_allclose(got, ref_outer[n], rtol=2e-5, atol=2e-5)


def test_averaging_makes_the_outer_model_the_islands_mean():
    """Vanilla DiLoCo with outer_optimizer="average": after a sync the outer model is the
    plain mean of the islands' parameters just before it (computed here from the islands)."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=3, outer_optimizer="average")
    inner, data = optax.sgd(0.05), batches(3)
    algo = dl.DiLoCo(cfg, toy_loss, inner)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    for x in data[:2]:
        state, _ = algo.step(state, x)
    # the third step's inner update, by hand, on each island; then the sync averages them
    islands = [toy_to_numpy(state.island(i)) for i in range(2)]
    rows = np.asarray(data[2]).reshape(2, -1, *np.asarray(data[2]).shape[1:])
    from tests.reference import np_loss_and_grad

    moved = [{n: p[n] - 0.05 * np_loss_and_grad(p, rows[i])[1][n] for n in p} for i, p in enumerate(islands)]
    state, _ = algo.step(state, data[2])
    for n, got in toy_to_numpy(state.outer).items():
        np.testing.assert_allclose(got, (moved[0][n] + moved[1][n]) / 2, rtol=1e-5, atol=1e-6)


def test_unknown_outer_optimizer_is_named():
    with pytest.raises(ValueError, match=r"outer_optimizer must be one of \('nesterov', 'adam', 'average'"):
        dl.DiLoCoConfig(outer_optimizer="lion")
    with pytest.raises(ValueError, match=r"outer_b2"):
        dl.DiLoCoConfig(outer_b2=1.0)
