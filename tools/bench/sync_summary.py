"""The sync-cost figures from the timed repetitions: the vanilla sync against its floor and
the hand-written sync, Streaming's syncs per fragment and over a cycle of P, a second
fragment order and a delayed outer update against the first, paired.

`times` maps (mode, phase) to one time per repetition, phase 5 being a step without an
event, "sync" the step that ends on a fragment's sync (the stash with V >= 1) and "after" the
step that follows it (exchange and apply); `synced` says which fragment each repetition's
Streaming sync was of."""

from __future__ import annotations

from tools.bench import common


def _median_difference(times: dict, a, b) -> float:
    import numpy as np

    return float(np.median(np.subtract(times[a], times[b])))


def _ratio(times: dict, a, b) -> dict:
    """`common.time_ratio` of two timed lists, each a key of `times` or the list itself."""
    import numpy as np

    return common.time_ratio(a if isinstance(a, np.ndarray) else times[a], times[b])


def vanilla_summary(times: dict, sync_period: int, sync_reps, floor_bytes: int) -> dict:
    """The vanilla sync against its floor and the hand-written syncs, and each mode's step
    without an event against plain."""
    import numpy as np

    floor, by_hand, minimal = (float(np.median(times[r])) for r in ("floor", "by_hand", "minimal"))
    extra = _median_difference(times, ("diloco", sync_period), ("diloco", 5))
    return {"floor_s": floor, "floor_bytes": 2 * floor_bytes, "plain_s": float(np.median(times[("plain", None)])),
            "vanilla_sync_extra_s": extra, "vanilla_extra_over_floor": extra / floor,
            "handwritten_sync_s": by_hand, "handwritten_over_floor": by_hand / floor,
            "vanilla_extra_over_handwritten": extra / by_hand,
            "minimal_sync_s": minimal, "minimal_over_floor": minimal / floor,
            "diloco_nonsync_extra_s": _median_difference(times, ("diloco", 5), ("plain", None)),
            "streaming_nonsync_extra_s": _median_difference(times, ("streaming", 5), ("plain", None)),
            **{f"{mode}_nonsync_ratio": _ratio(times, (mode, 5), ("plain", None)) for mode in ("diloco", "streaming")},
            "paired": {"vanilla_extra_over_floor": _ratio(times, sync_reps, "floor"),
                       "handwritten_over_floor": _ratio(times, "by_hand", "floor"),
                       "minimal_over_floor": _ratio(times, "minimal", "floor"),
                       "vanilla_extra_over_handwritten": _ratio(times, sync_reps, "by_hand")}}


def streaming_summary(times: dict, synced: list[int], m, streaming, direct, vanilla_extra: float, sync_reps) -> dict:
    """Streaming's syncs, deferred (`streaming`, V >= 1) and not (`direct`, V = 0): per
    fragment, over a cycle of P, and against the vanilla sync."""
    p = streaming.num_fragments
    stash_extra = _median_difference(times, ("streaming", "sync"), ("streaming", 5))
    exchange_extra = _median_difference(times, ("streaming", "after"), ("streaming", 5))
    per_fragment = fragment_rows(times, synced, p, m, streaming, vanilla_extra)
    cycle = sum(f["stash_extra_s"] + f["exchange_apply_extra_s"] for f in per_fragment) / p
    v0_per_fragment = fragment_rows(times, synced, p, m, direct, vanilla_extra, mode="streaming_v0")
    v0_cycle = sum(f["stash_extra_s"] for f in v0_per_fragment) / p
    extras = {mode: sync_extras(times, mode) for mode in ("streaming", "streaming_v0")}
    return {"streaming_per_fragment": per_fragment, "streaming_cycle_extra_s": cycle,
            "streaming_cycle_over_vanilla": cycle / vanilla_extra,
            "streaming_v0_per_fragment": one_step_rows(v0_per_fragment),
            "streaming_v0_cycle_extra_s": v0_cycle, "streaming_v0_cycle_over_vanilla": v0_cycle / vanilla_extra,
            "cycle_over_vanilla_paired": {mode: cycle_ratio(e, sync_reps, p) for mode, e in extras.items()},
            "stash_extra_s": stash_extra, "exchange_apply_extra_s": exchange_extra,
            "streaming_sync_extra_s": stash_extra + exchange_extra,
            "streaming_over_vanilla": (stash_extra + exchange_extra) / vanilla_extra, "one_over_p": 1 / p}


def compared_order(times: dict, synced: list[int], m, cfg, vanilla_extra: float) -> dict:
    """The Streaming syncs on `cfg`'s order (timed as mode "compared") against the first
    order's, in the same repetitions: per fragment and over a cycle as for the first, and
    the mean over the layer fragments' repetitions of the difference of the two syncs'
    extras (first minus compared, seconds; stash plus exchange and apply, each over its own
    mode's no-event step) with its 95% interval and what it says of "the compared order
    costs less"."""
    import numpy as np

    per = fragment_rows(times, synced, cfg.num_fragments, m, cfg, vanilla_extra, mode="compared")
    cycle = sum(p["stash_extra_s"] + p["exchange_apply_extra_s"] for p in per) / cfg.num_fragments
    layers = np.asarray(synced) != 0
    d = common.paired_difference((sync_extras(times, "streaming") - sync_extras(times, "compared"))[layers])
    verdict = "holding" if d["low"] > 0 else "contradicted" if d["high"] < 0 else "unresolved"
    return {"fragment_order": cfg.fragment_order, "streaming_per_fragment": per, "streaming_cycle_extra_s": cycle,
            "streaming_cycle_over_vanilla": cycle / vanilla_extra, "layer_sync_difference_s": d,
            "compared_is_cheaper": verdict}


def delayed_syncs(times: dict, synced: list[int], m, cfg, vanilla_extra: float) -> dict:
    """The V = 0 syncs with `cfg.delayed_outer` (timed as mode "delayed") against plain V = 0's
    in the same repetitions: per fragment and over a cycle, and the mean over the layer
    fragments' repetitions of the difference of the two syncs' extras (delayed minus V = 0,
    seconds, each over its own mode's no-event step) with its 95% interval, and their ratio
    of means."""
    import numpy as np

    per = fragment_rows(times, synced, cfg.num_fragments, m, cfg, vanilla_extra, mode="delayed")
    extras = {mode: sync_extras(times, mode) for mode in ("delayed", "streaming_v0")}
    layers = np.asarray(synced) != 0
    return {"delayed_outer": cfg.delayed_outer,
            "per_fragment": one_step_rows(per),
            "cycle_extra_s": sum(p["stash_extra_s"] for p in per) / cfg.num_fragments,
            "layer_sync_minus_v0_s": common.paired_difference((extras["delayed"] - extras["streaming_v0"])[layers]),
            "layer_sync_over_v0": float(np.mean(extras["delayed"][layers]) / np.mean(extras["streaming_v0"][layers]))}


def one_step_rows(per: list[dict]) -> list[dict]:
    """`fragment_rows` for a form that syncs and applies in one step (V = 0): that step's
    extra as `sync_apply_extra_s`, and no exchange column."""
    return [{"fragment": p["fragment"], "layers": p["layers"], "param_fraction": p["param_fraction"],
             "reps": p["reps"], "sync_apply_extra_s": p["stash_extra_s"], "over_vanilla": p["over_vanilla"]}
            for p in per]


def fragment_rows(times: dict, synced: list[int], num_fragments: int, m, cfg, vanilla_extra: float,
                  mode: str = "streaming") -> list[dict]:
    """Each fragment's Streaming sync (stash, then exchange and apply; with V = 0 the one step
    that syncs and applies, as "stash", and no second) over the non-sync step of the same
    repetition: medians over that fragment's repetitions, its share of the parameters, and
    its extra over the vanilla sync's (a fragment that costs in proportion to its size has
    the two equal)."""
    import numpy as np

    import diloco_eqx as dl

    fragments = dl.Fragmentation.from_model(m, cfg)
    counts = common.fragment_params(m, cfg)
    base = np.asarray(times[(mode, 5)])
    out = []
    for f in range(num_fragments):
        mine = np.asarray(synced) == f
        stash = float(np.median(np.asarray(times[(mode, "sync")])[mine] - base[mine]))
        exchange = float(np.median(np.asarray(times[(mode, "after")])[mine] - base[mine])) if (mode, "after") in times else 0.0
        out.append({"fragment": f, "layers": list(fragments.layer_indices(f)) if f else [],
                    "param_fraction": counts[f] / sum(counts), "reps": int(mine.sum()),
                    "stash_extra_s": stash, "exchange_apply_extra_s": exchange,
                    "over_vanilla": (stash + exchange) / vanilla_extra})
    return out


def sync_extras(times: dict, mode: str):
    """Each repetition's Streaming sync over its no-event step: the stash and the step after
    it (exchange and apply) where the mode has that step, else the one step (V = 0)."""
    import numpy as np

    base = np.asarray(times[(mode, 5)])
    extra = np.asarray(times[(mode, "sync")]) - base
    return extra + np.asarray(times[(mode, "after")]) - base if (mode, "after") in times else extra


def cycle_ratio(streaming_extras, vanilla_extras, num_fragments: int) -> dict:
    """A cycle of P Streaming syncs over one vanilla sync, paired by cycle: the repetitions,
    taken P at a time in order (each P consecutive ones sync every fragment once), give one
    ratio each, Σ Streaming extras ÷ Σ vanilla extras over those P; their mean with its 95%
    t-interval, and the verdict on 1/P ("holding": the whole interval at or below it)."""
    import numpy as np

    from experiments.stats import interval

    s, v = (np.asarray(x, np.float64).reshape(-1, num_fragments) for x in (streaming_extras, vanilla_extras))
    d = interval(list(s.sum(axis=1) / v.sum(axis=1)))
    one_over_p = 1 / num_fragments
    verdict = "holding" if d["hi"] <= one_over_p else "contradicted" if d["lo"] > one_over_p else "unresolved"
    return {"mean": d["mean"], "low": d["lo"], "high": d["hi"], "cycles": d["n"], "at_most_one_over_p": verdict}
