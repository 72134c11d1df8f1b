"""What `python -m tools.benchmark` prints of each section's result."""

from __future__ import annotations


def _ms(seconds: float, digits: int = 1) -> str:
    return f"{1e3 * seconds:.{digits}f} ms"


def _interval(r: dict, digits: int = 2) -> str:
    return f"{r['mean']:.{digits}f} [{r['low']:.{digits}f}, {r['high']:.{digits}f}]"


def format_table(result: dict) -> str:
    """The step table's rows, compile counts, memory and FLOP rates, sync cost and memory modes."""
    lines = [f"{'size':>5} {'mesh':>13} {'mode':>16} {'phase':>9} {'median ms':>10} "
             f"{'p10-p90 ms':>15} {'ratio':>7}  paired ratio [95%]"]
    for r in result["rows"]:
        paired = (f"  {r['paired_ratio']:.3f} [{r['paired_ratio_low']:.3f}, {r['paired_ratio_high']:.3f}]"
                  if "paired_ratio" in r else "")
        lines.append(f"{r['size']:>5} {r['mesh']:>13} {r['mode']:>16} {r['phase']:>9} "
                     f"{1e3 * r['median_s']:>10.2f} {1e3 * r['p10_s']:>7.2f}-{1e3 * r['p90_s']:<7.2f}"
                     f"{r['ratio_to_plain']:>7.3f}{paired}")
    lines.append("")
    for key, c in result["compile"].items():
        lines.append(f"compilations of the step over {c['steps']} steps (>= 2·H_eff), {key}: "
                     f"{c['count']} ({c['compile_s']:.1f} s to compile)")
    for key, m in result["memory"]["all"].items():
        lines.append(f"memory {key}: args {m['argument_bytes']:,} temps {m['temp_bytes']:,} "
                     f"resident {m['resident_bytes']:,} B")
    lines += _format_sizes(result)
    lines += format_sync_cost(result.get("sync_cost", {}))
    lines += _format_memory_modes(result["memory"])
    return "\n".join(lines)


def _format_sizes(result: dict) -> list[str]:
    """Per size and mesh: DiLoCo's extra memory against its formula, and the FLOP rates."""
    lines, everything = [], result["memory"]["all"]
    for key, s in result["sizes"].items():
        plain = everything[f"{key}/plain"]["resident_bytes"]
        for mode in [m for m in ("diloco", "diloco_drjax") if f"{key}/{m}" in everything]:
            extra = everything[f"{key}/{mode}"]["resident_bytes"] - plain
            lines.append(f"{key} {mode}: extra resident {extra:,} B per device vs 2·|Θ|·4/(n·m) = "
                         f"{s['expected_extra_bytes']:,} B (ratio {extra / s['expected_extra_bytes']:.3f})")
        lines.append(f"{key}: {s['params']:,} params, inner step {s['inner_flops_per_s'] / 1e9:.2f} "
                     f"GFLOP/s vs matmul {s['matmul_flops_per_s'] / 1e9:.2f} GFLOP/s: "
                     f"utilisation {s['utilisation']:.2f}; model FLOPs {s['model_flops_per_step'] / 1e9:.1f} G "
                     f"per step = {s['model_flops_utilisation']:.3f} of the matmul's rate (MFU)")
    return lines


def _format_memory_modes(memory: dict) -> list[str]:
    lines = []
    for key, m in memory["modes"].items():
        live = m.get("live_extra_bytes")
        lines.append(f"memory mode {key}: extra {m['extra_bytes']:,} B vs expected {m['expected_extra_bytes']:,} B "
                     f"(ratio {m['extra_bytes'] / m['expected_extra_bytes']:.3f})" + (
                         "" if live is None else f"; live at the peak {live:,} B "
                                                 f"(ratio {live / m['expected_extra_bytes']:.4f})"))
    low = memory.get("bfloat16")
    if low:
        lines.append(f"bfloat16 islands, float32 outer (vanilla, no mesh): extra resident "
                     f"{low['extra_bytes']:,} B vs 2·|Θ|·4 = {low['expected_extra_bytes']:,} B "
                     f"(ratio {low['extra_bytes'] / low['expected_extra_bytes']:.3f}; "
                     f"2·|Θ|·2 would be {2 * low['param_bytes_bfloat16']:,} B)")
    return lines


def format_sync_cost(costs: dict) -> list[str]:
    """Per size: the vanilla sync against its references, Streaming's syncs per fragment (V = 1
    and V = 0), and a delayed outer update or a second order, where timed."""
    lines = []
    for name, c in costs.items():
        lines += [_format_vanilla_sync(name, c), _format_streaming_syncs(name, c), _format_v0_syncs(name, c)]
        if "delayed" in c:
            lines.append(_format_delayed(name, c["delayed"]))
        if "compared_order" in c:
            lines.append(_format_compared_order(name, c))
    return lines


def _format_vanilla_sync(name: str, c: dict) -> str:
    paired = ", ".join(f"{key} {_interval(r)}" for key, r in c["paired"].items())
    ratios = "".join(f"; {m} non-sync / plain {_interval(c[f'{m}_nonsync_ratio'], 4)}" for m in ("diloco", "streaming"))
    return (f"{name} sync cost (no mesh, 2x8-token batch, paired medians): floor {_ms(c['floor_s'])} "
            f"for {c['floor_bytes'] / 1e6:.0f} MB; vanilla sync +{_ms(c['vanilla_sync_extra_s'])} "
            f"= {c['vanilla_extra_over_floor']:.2f}x floor ({c['vanilla_extra_over_handwritten']:.2f}x the "
            f"same sync written by hand, {_ms(c['handwritten_sync_s'])} = {c['handwritten_over_floor']:.2f}x floor; "
            f"without its two norms {_ms(c['minimal_sync_s'])} = {c['minimal_over_floor']:.2f}x floor; "
            f"paired, mean [95%]: {paired}); streaming sync (stash + exchange) "
            f"+{_ms(c['streaming_sync_extra_s'])} = {c['streaming_over_vanilla']:.2f} of vanilla's "
            f"(1/P = {c['one_over_p']:.2f}); non-sync step +{_ms(c['diloco_nonsync_extra_s'])} / "
            f"+{_ms(c['streaming_nonsync_extra_s'])} over plain ({_ms(c['plain_s'], 0)}){ratios}")


def _per_fragment(rows: list[dict]) -> str:
    return ", ".join(f"{p['fragment']}: {1e3 * p['stash_extra_s']:.1f} + {_ms(p['exchange_apply_extra_s'])} = "
                     f"{p['over_vanilla']:.2f} ({p['param_fraction']:.2f})" for p in rows)


def _format_streaming_syncs(name: str, c: dict) -> str:
    return (f"{name} streaming sync per fragment ({c['fragment_order']} order; stash + exchange and apply, "
            f"÷ vanilla's; share of Θ): {_per_fragment(c['streaming_per_fragment'])}; mean over a cycle "
            f"{_ms(c['streaming_cycle_extra_s'])} = {c['streaming_cycle_over_vanilla']:.2f} of vanilla's "
            f"(1/P = {c['one_over_p']:.2f}); its own floor {_ms(c['streaming_floor_s'])} for "
            f"{c['streaming_floor_bytes'] / 1e6:.0f} MB ({c['streaming_floor_over_vanilla_floor']:.2f} of vanilla's "
            f"bytes): cycle = {c['streaming_cycle_over_floor']:.2f}x its floor")


def _format_v0_syncs(name: str, c: dict) -> str:
    rows = ", ".join(f"{p['fragment']}: {_ms(p['sync_apply_extra_s'])} = {p['over_vanilla']:.2f} "
                     f"({p['param_fraction']:.2f})" for p in c["streaming_v0_per_fragment"])
    cycles = ", ".join(f"{m} {_interval(r)} over {r['cycles']} cycles (≤ 1/P = {c['one_over_p']:.2f}: "
                       f"{r['at_most_one_over_p']})" for m, r in c["cycle_over_vanilla_paired"].items())
    return (f"{name} streaming V = 0 sync per fragment (sync and apply in one step, ÷ vanilla's; share of Θ): "
            f"{rows}; mean over a cycle {_ms(c['streaming_v0_cycle_extra_s'])} = "
            f"{c['streaming_v0_cycle_over_vanilla']:.2f} of vanilla's; a cycle ÷ vanilla's, paired by cycle, "
            f"mean [95%]: {cycles}")


def _format_delayed(name: str, d: dict) -> str:
    diff = d["layer_sync_minus_v0_s"]
    rows = ", ".join(f"{p['fragment']}: {_ms(p['sync_apply_extra_s'])} = {p['over_vanilla']:.2f}"
                     for p in d["per_fragment"])
    return (f"{name} V = 0 sync per fragment with delayed_outer={d['delayed_outer']!r} (÷ vanilla's): {rows}; "
            f"mean over a cycle {_ms(d['cycle_extra_s'])}; a layer fragment's sync minus V = 0's: "
            f"{1e3 * diff['mean']:+.2f} ms [{1e3 * diff['low']:+.2f}, {1e3 * diff['high']:+.2f}] over {diff['n']} "
            f"reps ({d['layer_sync_over_v0']:.2f}x V = 0's)")


def _format_compared_order(name: str, c: dict) -> str:
    o = c["compared_order"]
    d = o["layer_sync_difference_s"]
    return (f"{name} streaming sync per fragment, {o['fragment_order']} order in the same repetitions: "
            f"{_per_fragment(o['streaming_per_fragment'])}; mean over a cycle {_ms(o['streaming_cycle_extra_s'])} = "
            f"{o['streaming_cycle_over_vanilla']:.2f} of vanilla's; a layer fragment's sync, "
            f"{c['fragment_order']} minus {o['fragment_order']}: {1e3 * d['mean']:+.2f} ms "
            f"[{1e3 * d['low']:+.2f}, {1e3 * d['high']:+.2f}] over {d['n']} reps "
            f"({o['fragment_order']} cheaper: {o['compared_is_cheaper']})")


def format_nonsync(result: dict) -> str:
    from tools import trace_gaps

    lines = []
    for size, c in result.items():
        lines.append(f"{size} non-sync step / plain (full batch, mean [95%], {c['reps']} paired reps; plain "
                     f"{1e3 * c['plain_s']:.2f} ms): " + ", ".join(
                         f"{m} {r['ratio']:.4f} [{r['ratio_low']:.4f}, {r['ratio_high']:.4f}]"
                         for m, r in c["modes"].items()))
        lines += [format_events(size, m, e) for m, e in c.get("events", {}).items()]
        if "trace" in c:
            lines += [f"{size} traced steps (medians of 3):", trace_gaps.format_summary(c["trace"])]
        if "trace_error" in c:
            lines.append(f"{size} trace failed: {c['trace_error']}")
    return "\n".join(lines)


def format_events(size: str, mode: str, e: dict) -> str:
    figures = lambda xs: ", ".join(f"{x:.3g}" for x in xs)  # noqa: E731
    return (f"{size} events at t = {e['ends'][0]}..{e['ends'][-1]}, {mode}: islands' largest difference over "
            f"fragment 0 after each step {figures(e['fragment0_spread'])} (expected 0 at the apply, "
            f"t = {e['applied_at']}, and only there); outer fragment 0's change in each step "
            f"{figures(e['outer_fragment0_change'])} (expected above 0 at t = {e['applied_at']} and only there); "
            f"outer Σ|θ| {e['outer_abs_sum']:.6g}")


def format_exchange_placement(result: dict) -> str:
    lines = []
    for size, c in result.items():
        lines.append(f"{size} extra / expected, allocated (live at the peak): " + ", ".join(
            f"{v} {m['extra_bytes'] / m['expected_extra_bytes']:.4f}"
            + ("" if m["live_extra_bytes"] is None else f" ({m['live_extra_bytes'] / m['expected_extra_bytes']:.4f})")
            for v, m in c["memory"].items()))
        lines.append(f"{size} step time, after_inner / free (mean [95%], {c['reps']} paired reps): " + ", ".join(
            f"{name} {t['time_ratio']:.3f} [{t['time_ratio_low']:.3f}, {t['time_ratio_high']:.3f}] "
            f"({1e3 * t['free_s']:.0f} ms)" for name, t in c["times"].items()))
    return "\n".join(lines)


def format_host_memory(costs: dict) -> str:
    lines = []
    for name, c in costs.items():
        for phase, p in c["phases"].items():
            k, d = p["keep"], p["default"]
            lines.append(f"{name} {phase}: kept {1e3 * k['s']:.0f} ms ({k['faults']:.0f} page faults, "
                         f"{1e3 * k['sys_s']:.0f} ms system), glibc's default {1e3 * d['s']:.0f} ms "
                         f"({d['faults']:.0f} page faults, {1e3 * d['sys_s']:.0f} ms system); default ÷ kept "
                         f"{p['ratio_mean']:.3f} [{p['ratio_low']:.3f}, {p['ratio_high']:.3f}] over {c['pairs']} pairs")
    return "\n".join(lines)


def format_orders(orders: dict) -> str:
    lines = []
    for size, c in orders.items():
        for order, modes in c["modes"].items():
            lines.append(f"{size} {order} order: plain resident {c['resident_bytes'][order]['plain']:,} B; extra / "
                         "expected: " + ", ".join(f"{m} {v['extra_bytes'] / v['expected_extra_bytes']:.3f}"
                                                  for m, v in modes.items()))
        lines.append(f"{size} step time, memory / concurrency order (mean [95%], {c['reps']} paired reps): " + ", ".join(
            f"{k} {v['time_ratio']:.3f} [{v['time_ratio_low']:.3f}, {v['time_ratio_high']:.3f}]"
            for k, v in c["times"].items()))
    return "\n".join(lines)
