"""What a sync adds to a step, against the floor of the bytes it must touch (no mesh).

The batch is 2 sequences of 8 tokens, so the inner step is short and the differences are
resolved: each repetition times, back to back, the plain step, DiLoCo on a step without an
event and on a sync, Streaming (V = 1) without an event, on a sync (the stash) and on the
step after it (exchange, outer step and apply), and Streaming with V = 0 (`streaming_v0`:
no stash, the sync and apply in one step) without an event and on a sync; the results are
medians of paired differences. The repetitions cycle through the fragments' syncs, each
equally often, so each fragment's cost is reported too, and their mean over a cycle: P
Streaming syncs touch the model once, as one vanilla sync does, so it is that mean which
1/P of the vanilla sync's cost measures (`cycle_over_vanilla_paired`: one ratio per cycle of
P repetitions, with its interval).

Each repetition first times the references (`tools.bench.references`: the floor, the
deferred sync's own floor, the vanilla sync written by hand with and without its norms),
then an untimed plain step, then the steps; the ratios to the references are medians of
each, and under "paired" the mean of each repetition's ratio with its 95% interval. They
hold 2K + 4 model-sized float32 buffers and the deferred floor's besides the steps' states
(1.1 GB at 30M, K = 2, P = 5).

Streaming's fragments follow `fragment_order` (the config's default when None); with
`compare_order`, Streaming on that order is timed in the same repetitions too and its syncs
compared with the first order's, paired (`compared_order`). With `delayed_outer` ("naive"
or "eager"), V = 0 with that delayed outer update is timed in the same repetitions too
(`delayed`): each island keeps its own outer copy, so its sync moves more bytes than V = 0's.
"""

from __future__ import annotations

import dataclasses

from tools.bench import common, references, steps, sync_summary


def sync_cost(m, k: int, sync_period: int, num_fragments: int, reps: int, fragment_order: str | None = None,
              compare_order: str | None = None, delayed_outer: str | None = None) -> dict:
    """The sync-cost figures of model `m` (see the module's docstring)."""
    import numpy as np

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import count_params

    vanilla = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period)
    streaming = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True,
                                num_fragments=num_fragments, overlap_steps=1,
                                **({} if fragment_order is None else {"fragment_order": fragment_order}))
    streamings = {"streaming": streaming}
    if compare_order is not None:
        streamings["compared"] = dataclasses.replace(streaming, fragment_order=compare_order)
    direct = dataclasses.replace(streaming, overlap_steps=0)
    delayed = None if delayed_outer is None else dataclasses.replace(direct, delayed_outer=delayed_outer)
    floor_bytes, stream_bytes, refs = references.sync_references(m, k, vanilla, num_fragments)
    times, synced, reps = sync_cost_times(m, k, vanilla, streamings, refs, reps, direct, delayed)
    del refs
    sync_reps = np.subtract(times[("diloco", sync_period)], times[("diloco", 5)])  # each repetition's
    out = sync_summary.vanilla_summary(times, sync_period, sync_reps, floor_bytes)
    vanilla_extra = out["vanilla_sync_extra_s"]
    out.update(sync_summary.streaming_summary(times, synced, m, streaming, direct, vanilla_extra, sync_reps))
    out.update(streaming_floor_bytes=stream_bytes, streaming_floor_s=float(np.median(times["stream_floor"])),
               streaming_floor_over_vanilla_floor=stream_bytes / (2 * floor_bytes), params=count_params(m),
               fragment_order=streaming.fragment_order, reps=reps)
    out["streaming_cycle_over_floor"] = out["streaming_cycle_extra_s"] / out["streaming_floor_s"]
    if compare_order is not None:
        out["compared_order"] = sync_summary.compared_order(times, synced, m, streamings["compared"], vanilla_extra)
    if delayed is not None:
        out["delayed"] = sync_summary.delayed_syncs(times, synced, m, delayed, vanilla_extra)
    return out


def sync_cost_steps(m, k: int, vanilla, streamings: dict, v0_forms: list) -> dict[str, list]:
    """[state, step] by mode: plain, vanilla DiLoCo, each Streaming order and each V = 0 form."""
    import optax

    inner = optax.adamw(1e-3)
    out = {"plain": steps.plain(m, inner, k)}
    for name, cfg in (("diloco", vanilla), *streamings.items(), *v0_forms):
        out[name] = steps.diloco(m, inner, cfg)
    return out


def sync_cost_times(m, k: int, vanilla, streamings: dict, refs: dict, reps: int,
                    direct, delayed=None) -> tuple[dict, list[int], int]:
    """(seconds of every phase and reference in each timed repetition, the fragment each
    repetition's Streaming sync was of, the repetitions timed: `reps` rounded up to a
    multiple of P so every fragment's sync is timed equally often). Two repetitions before
    them warm up. With two Streaming modes (two fragment orders), they take turns going first;
    `direct` (V = 0) syncs and applies the same fragment in the step that ends at the stash's t,
    and so does `delayed` (V = 0 with a delayed outer update), when given."""
    import diloco_eqx as dl

    v0_forms = [("streaming_v0", direct)] + ([] if delayed is None else [("delayed", delayed)])
    modes = sync_cost_steps(m, k, vanilla, streamings, v0_forms)
    tiny = common.batch(rows=2, seq_len=8)
    placed = {mode: step.place_batch(tiny) for mode, (_, step) in modes.items()}
    first = next(iter(streamings.values()))  # the orders share the schedule
    schedule, h, p = dl.Schedule.from_config(first), vanilla.sync_period, first.num_fragments
    dh = schedule.steps_between_syncs

    def phases(rep):  # two Streaming modes take turns going first
        order = list(streamings)[::-1 if rep % 2 else 1]
        return [("plain", None), ("diloco", 5), ("diloco", h), *[(s, t) for s in order for t in (5, "sync", "after")],
                *[(name, t) for name, _ in v0_forms for t in (5, "sync")]]

    times, synced = {key: [] for key in [*phases(0), *refs]}, []
    reps = -(-reps // p) * p
    for rep in range(reps + 2):
        j = 1 + rep % p  # cycle through every fragment's sync
        for name, (timer, which) in refs.items():
            times[name].append(timer(which))
        steps.time_step(modes["plain"], placed["plain"])  # untimed: the references' passes are behind it
        for mode, t in phases(rep):  # "after" is the step that follows the stash, as in a run
            t_end = {None: None, "sync": dh * j, "after": None}.get(t, t)
            times[(mode, t)].append(steps.time_step(modes[mode], placed[mode], t_end))
        synced.append(int(schedule.fragment_at(dh * j)))
        assert dl.Schedule.from_config(direct).fragment_at(dh * j) == synced[-1]
    return {key: ts[2:] for key, ts in times.items()}, synced[2:], reps


def run_sync_cost(sizes, reps: int, sync_period: int, num_fragments: int, dtype: str = "float32",
                  fragment_order: str | None = None, compare_order: str | None = None,
                  delayed_outer: str | None = None) -> dict:
    """`sync_cost` of every size, with the settings and machine."""
    costs = {size.name: sync_cost(common.model(size, dtype), common.K, sync_period, num_fragments, reps,
                                  fragment_order, compare_order, delayed_outer) for size in sizes}
    return {"sync_cost": costs, **common.settings_and_machine(sync_period, num_fragments, reps), "dtype": dtype}
