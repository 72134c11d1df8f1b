"""Full-batch steps without a schedule event against the plain step (no mesh), the event
check that the syncs still run, and (on an accelerator) a trace of the steps.

DiLoCo and Streaming with V = 1 are each run at t = 5; Streaming as built by default (its
exchange waits for the inner step here, where the islands share one device) and with its
exchange free ("streaming_free", as on an island mesh). Every repetition runs the four back
to back, the first of them rotating, and each mode's result is the mean of its
per-repetition ratios to plain's with the 95% t-interval (the first repetition compiles and
is dropped)."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import time
from functools import partial

from tools.bench import common, steps

NONSYNC_MODES = ("plain", "diloco", "streaming", "streaming_free")


def nonsync_steps(m, k: int, sync_period: int, num_fragments: int) -> tuple[dict, dict]:
    """The steps by mode ([state, step], plain among them) and each DiLoCo mode's config."""
    import optax

    import diloco_eqx as dl

    inner = optax.adamw(1e-3)
    streaming = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True,
                                num_fragments=num_fragments, overlap_steps=1)
    cfgs = {"diloco": dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period), "streaming": streaming,
            "streaming_free": streaming}
    out = {"plain": steps.plain(m, inner, k)}
    for mode, cfg in cfgs.items():
        out[mode] = steps.diloco(m, inner, cfg, exchange_after_inner=False if mode == "streaming_free" else None)
    return out, cfgs


def nonsync(m, size, k: int, sync_period: int, num_fragments: int, reps: int, trace: str | None = None,
            report=lambda out: None) -> dict:
    """The timed steps, then the event check (`event_check`), and with `trace` three more
    repetitions under `jax.profiler` (`traced`). `report(out)` gets the result after each
    phase, so a later phase that fails or runs out of time loses nothing already measured."""
    import numpy as np

    from diloco_eqx.models.transformer import count_params
    from tools.bench.report import format_nonsync

    modes, cfgs = nonsync_steps(m, k, sync_period, num_fragments)
    full = common.batch(size)
    placed = {mode: step.place_batch(full) for mode, (_, step) in modes.items()}
    times = nonsync_times(size, modes, placed, reps)
    plain = times["plain"]
    results = {mode: {"median_s": float(np.median(times[mode])), **common.ratio_interval(times[mode], plain),
                      **({"exchange_after_inner": steps.exchange_after_inner(modes[mode][1])} if cfg.streaming else {})}
               for mode, cfg in cfgs.items()}
    out = {"params": count_params(m), "plain_s": float(np.median(plain)), "modes": results, "reps": reps}
    print(format_nonsync({size.name: out}), file=sys.stderr, flush=True)
    report(out)
    out["events"] = {mode: event_check(m, cfg, modes[mode], placed[mode]) for mode, cfg in cfgs.items()}
    report(out)
    if trace:
        out.update(traced(modes, placed, trace))
        report(out)
    return out


def nonsync_times(size, modes: dict, placed: dict, reps: int) -> dict[str, list[float]]:
    """Each mode's step times over `reps` rotating repetitions after one that compiles."""
    times, start = {mode: [] for mode in NONSYNC_MODES}, time.perf_counter()
    for rep in range(reps + 1):
        turn = rep % len(NONSYNC_MODES)
        for mode in NONSYNC_MODES[turn:] + NONSYNC_MODES[:turn]:
            elapsed = nonsync_step(modes[mode], placed[mode], mode != "plain")
            if rep:
                times[mode].append(elapsed)
        if rep % max(reps // 4, 1) == 0:  # progress: a GPU process spends minutes before the first timed step
            print(f"{size.name} --nonsync: repetition {rep} of {reps} done at {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    return times


def traced(modes: dict, placed: dict, folder: str) -> dict:
    """Three repetitions of each mode under `jax.profiler` into `folder`, each step in a host
    annotation `mode_{mode}_{rep}`: {"trace": `tools.trace_gaps` summary}, or, when tracing or
    reading the trace fails, {"trace_error": what failed} (the timings stand either way)."""
    import jax

    from tools import trace_gaps

    pattern = os.path.join(folder, "plugins", "profile", "*", "*.trace.json.gz")
    earlier = set(glob.glob(pattern))  # a reused folder's traces are not this run's
    try:
        with jax.profiler.trace(folder):
            for rep in range(3):
                for mode in NONSYNC_MODES:
                    nonsync_step(modes[mode], placed[mode], mode != "plain", f"mode_{mode}_{rep}")
        found = sorted(set(glob.glob(pattern)) - earlier)
        if not found:
            raise FileNotFoundError(f"no new *.trace.json.gz under {folder}/plugins/profile")
        return {"trace": trace_gaps.summarize(found[-1])}
    except Exception as e:  # noqa: BLE001 - a failed trace must not cost the measured timings
        print(f"--trace: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return {"trace_error": f"{type(e).__name__}: {e}"}


def nonsync_step(state_and_step: list, batches, reset_t: bool, annotation: str | None = None) -> float:
    """One step (from t = 4, so it ends at t = 5 without an event, where `reset_t`), timed
    from its call until its new state is ready; the state is replaced in place."""
    import jax

    state, step = state_and_step
    if reset_t:
        state = steps.ending_at(state, 5)
    with jax.profiler.TraceAnnotation(annotation) if annotation else contextlib.nullcontext():
        t0 = time.perf_counter()
        state, _ = step.step_placed(state, batches)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - t0
    state_and_step[0] = state
    return elapsed


def event_check(m, cfg, state_and_step: list, batches) -> dict:
    """The steps that end at H_eff − 1 through H_eff + V, fragment 0's sync and its apply:
    after each, the largest difference between islands over fragment 0 (every parameter for
    vanilla DiLoCo), the largest change of the outer model's fragment 0 in that step, and
    the outer model's Σ|θ| after the last. With α = 0 the apply makes the islands' fragment 0
    equal, and the outer fragment 0 moves in the step that applies it (its sync with V = 0,
    its exchange with V = 1) and in no step before: both, exactly, show that the sync's and
    the apply's loops ran on the device; Σ|θ| compares runs under other XLA flags."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import diloco_eqx as dl

    schedule, fragments = dl.Schedule.from_config(cfg), dl.Fragmentation.from_model(m, cfg)
    first = schedule.period - 1
    ends = list(range(first, schedule.period + cfg.overlap_steps + 1))
    state, step = state_and_step
    state, spreads, moves = steps.ending_at(state, first), [], []
    outer0 = lambda s: jax.tree.leaves(fragments.take(eqx.filter(s.outer, eqx.is_inexact_array), 0))  # noqa: E731
    for _ in ends:
        before = [np.asarray(x, np.float64) for x in outer0(state)]
        state, _ = step.step_placed(state, batches)
        part = fragments.take(eqx.filter(state.inner_model, eqx.is_inexact_array), 0)
        spreads.append(max(float(jnp.max(jnp.abs(x - x[:1]))) for x in jax.tree.leaves(part)))
        moves.append(max(float(np.max(np.abs(np.asarray(x, np.float64) - b))) for x, b in zip(outer0(state), before)))
    state_and_step[0] = state
    outer = sum(float(np.abs(np.asarray(x, np.float64)).sum())
                for x in jax.tree.leaves(eqx.filter(state.outer, eqx.is_inexact_array)))
    return {"ends": ends, "applied_at": schedule.period + cfg.overlap_steps, "fragment0_spread": spreads,
            "outer_fragment0_change": moves, "outer_abs_sum": outer}


def run_nonsync(sizes, reps: int, sync_period: int, num_fragments: int, dtype: str = "float32",
                trace: str | None = None, save=lambda result: None) -> dict:
    """`nonsync` per size; `save(result)` gets the whole result so far after each phase."""
    if trace is not None:
        import jax

        if jax.default_backend() == "cpu":
            raise SystemExit("--trace: needs an accelerator (XLA:CPU's trace has no device timeline to "
                             "summarize); this machine's backend is cpu")
    out, settings = {}, {**common.settings_and_machine(sync_period, num_fragments, reps), "dtype": dtype}

    def report(name, result):
        out[name] = result
        save({"nonsync": out, **settings})

    for size in sizes:
        folder = None if trace is None else os.path.join(trace, size.name)
        out[size.name] = nonsync(common.model(size, dtype), size, common.K, sync_period, num_fragments, reps, folder,
                                 report=partial(report, size.name))
    return {"nonsync": out, **settings}
