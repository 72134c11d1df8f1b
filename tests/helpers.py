"""Test helpers: the toy runs the step tests share, and settings for subprocesses."""

import dataclasses
import os

import numpy as np
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis.profiling import count_compilations
from diloco_eqx.diloco import with_plan
from tests.conftest import QUICK_COMPILE
from tests.reference import make_toy, np_run, toy_loss, toy_to_numpy

__all__ = ["GBS", "N_LAYERS", "WIDTH", "alternating", "batches", "count_compilations", "drops_of", "fast_and_slow",
           "make_diloco", "pairwise", "reference_run", "run_counting_compilations", "run_jax", "subprocess_env"]



def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment for a Python subprocess a test starts: the tests' compile settings,
    and `devices` simulated CPU devices if given (else the process asks for its own)."""
    flags = QUICK_COMPILE + (f" --xla_force_host_platform_device_count={devices}" if devices else "")
    return {**os.environ, "XLA_FLAGS": flags, **extra}


def pairwise(grid: list[tuple]) -> list[tuple]:
    """A subset of `grid` (a full product of knob values) in which every pair of values of
    any two knobs still appears together: picked greedily, in grid order, each time the point
    covering the most pairs not yet seen (9 of the 54 points of a 3×2×3×3 grid)."""
    def pairs(point):
        return {(i, a, j, b) for i, a in enumerate(point) for j, b in enumerate(point) if i < j}

    todo, chosen = set().union(*map(pairs, grid)), []
    while todo:
        best = max(grid, key=lambda p: len(pairs(p) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return [p for p in grid if p in chosen]


def alternating(grid: list[tuple]) -> list[tuple]:
    """One point per setting of all knobs but the last, which has two values: the last knob's
    values in turn (`grid` ordered as a product, the last knob fastest)."""
    return [grid[2 * j + j % 2] for j in range(len(grid) // 2)]


def fast_and_slow(grid: list[tuple], fast: list[tuple] | None = None) -> list:
    """`grid` as pytest parameters: the points in `fast` (default: a pairwise cover) run by
    default, the rest only in the slow set (`pytest -m slow`)."""
    fast = pairwise(grid) if fast is None else fast
    return [p if p in fast else pytest.param(*p, marks=pytest.mark.slow) for p in grid]


N_LAYERS, WIDTH, GBS = 4, 3, 8


def batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(GBS, WIDTH)).astype(np.float32) for _ in range(steps)]


def make_diloco(cfg, inner, mesh=None, deferred=None, exchange_after_inner=None, **kwargs):
    """`dl.DiLoCo` on the toy loss; `deferred` / `exchange_after_inner` (when given) pick a
    form of the step that computes the same numbers (`diloco.with_plan`)."""
    algo = dl.DiLoCo(cfg, toy_loss, inner, mesh=mesh, **kwargs)
    changes = {k: v for k, v in [("deferred", deferred), ("exchange_after_inner", exchange_after_inner)]
               if v is not None}
    if changes.get("deferred") is False:
        changes.setdefault("exchange_after_inner", False)
    return with_plan(algo, **changes) if changes else algo


def run_jax(cfg, inner, data, mesh=None, model=None, deferred=None, **kwargs):
    """Per-step island losses, and the final state with any pending sync folded into its
    outer model (the deferred exchange of a sync at the last step happens in the next)."""
    model = make_toy(N_LAYERS, WIDTH) if model is None else model
    algo = make_diloco(cfg, inner, mesh, deferred, **kwargs)
    state = algo.init(model)
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
    # the settled state: the outer model with every sync folded in, nothing in flight
    return np.array(losses), dataclasses.replace(state, outer=algo.outer_model(state), pending=None)


def reference_run(cfg, data, inner_np, **extra):
    """np_run with the config's knobs, from the same initial toy model as run_jax."""
    return np_run(
        toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=cfg.num_replicas, h=cfg.sync_period,
        inner=inner_np, streaming=cfg.streaming, p=cfg.num_fragments, order=cfg.fragment_order,
        v=cfg.overlap_steps, alpha=cfg.alpha, outer_lr=cfg.outer_lr,
        momentum=cfg.outer_momentum, compression=cfg.compression,
        error_feedback=cfg.error_feedback, **extra,
    )


def run_counting_compilations(algo, state, data):
    """(final state, the state before the last step, compilations) of `algo` over `data`,
    fetching each step's metrics as a training loop does."""
    with count_compilations() as compiles:
        for x in data:
            old = state
            state, m = algo.step(state, x)
            m["loss"]
    return state, old, compiles.count


def drops_of(cfg):
    """The reference's `dropped(t, i)` for a config's listed drops and drop_prob coins (drawn
    the way the config documents them), or None without faults."""
    import jax

    if not (cfg.drops or cfg.drop_prob):
        return None
    probs = np.asarray(cfg.island_drop_probs)

    def dropped(t, i):
        coin = jax.random.uniform(jax.random.fold_in(jax.random.key(cfg.fault_seed), t), (len(probs),))
        return (t, i) in cfg.drops or bool(np.asarray(coin)[i] < probs[i])

    return dropped
