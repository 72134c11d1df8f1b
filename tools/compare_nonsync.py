"""`tools.benchmark --nonsync` runs side by side, e.g. under two settings of XLA's flags.

    python -m tools.compare_nonsync default.json graphs.json

Per run, its XLA flags (the simulated-device count left out); then per size and mode the
no-event step's ratio to plain with its 95% interval and its verdict on the 1% line
(holding: the whole interval below 1.01; contradicted: above it; unresolved: across it); the
traced steps' device-to-host copies (each a loop predicate read on the host) and their span
over plain's, where the run was traced (with the steps' notes of command buffers run kernel
by kernel for the profiler, where there are any, or why the trace failed); and the event
check: whether the islands' fragment 0 agreed exactly after the apply and only then, and the
outer fragment 0 moved in that step and not before, and the outer model's Σ|θ| relative to
the first run's. The runs are separate processes, so their ratios are compared, not paired.
A run whose file cannot be read (a stage that failed) is named and the others compared.
"""

from __future__ import annotations

import argparse
import json
import os

LINE = 1.01
"""The line a step without an event is judged against: within 1% of plain's."""


class Unreadable(SystemExit):
    """A run's file is missing or not JSON: the stage that writes it failed."""


def load(path: str) -> dict:
    """A `--nonsync` JSON, or SystemExit naming the file and what it lacks (`Unreadable`
    where there is no file to read)."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise Unreadable(f"compare_nonsync: cannot read {path}: {e}") from None
    if "nonsync" not in result:
        raise SystemExit(f"compare_nonsync: {path} is not a `tools.benchmark --nonsync` JSON "
                         f"(it has {sorted(result)}, no 'nonsync')")
    return result


def verdict(r: dict, line: float = LINE) -> str:
    if r["ratio_high"] < line:
        return "holding"
    return "contradicted" if r["ratio_low"] > line else "unresolved"


def events_ran(e: dict) -> bool:
    """Fragment 0 equal across islands after the apply (the last step) and after no step
    before; and, where the run recorded it, the outer fragment 0 moved in the apply's step
    (by its sync or exchange) and in no step before: an apply alone would equalize the
    islands without a sync."""
    *before, after = e["fragment0_spread"]
    applied = after == 0 and all(d > 0 for d in before)
    if "outer_fragment0_change" not in e:
        return applied
    *still, moved = e["outer_fragment0_change"]
    return applied and moved > 0 and all(d == 0 for d in still)


def flags(result: dict) -> str:
    given = result.get("machine", {}).get("xla_flags", "").split()
    return " ".join(f for f in given if not f.startswith("--xla_force_host_platform_device_count")) or "(default)"


def compare(runs: dict[str, dict]) -> str:
    """The runs (name: JSON), per size present in all of them."""
    first = next(iter(runs.values()))
    sizes = [s for s in first["nonsync"] if all(s in r["nonsync"] for r in runs.values())]
    lines = [f"{name}: XLA flags {flags(r)}; {r['machine'].get('device', '?')}, jax {r['machine']['jax']}"
             for name, r in runs.items()]
    for size in sizes:
        base = first["nonsync"][size]
        for name, r in runs.items():
            c = r["nonsync"][size]
            lines.append(f"{size} {name}: plain {1e3 * c['plain_s']:.2f} ms, {c['reps']} pairs")
            trace = c.get("trace", {})
            for mode, m in c["modes"].items():
                text = (f"  {mode:14s} {m['ratio']:.4f} [{m['ratio_low']:.4f}, {m['ratio_high']:.4f}] "
                        f"{verdict(m)} at {LINE}")
                if mode in trace and "plain" in trace:
                    text += (f"; traced: {trace[mode]['d2h']:.0f} D2H, span − plain's "
                             f"{trace[mode]['span'] - trace['plain']['span']:.0f} us")
                    if trace[mode].get("graphs_off"):
                        text += f" (command buffers off for the profiler: {trace[mode]['graphs_off']:g})"
                elif "trace_error" in c:
                    text += f"; trace failed: {c['trace_error']}"
                if mode in c.get("events", {}):
                    e, e0 = c["events"][mode], base.get("events", {}).get(mode)
                    text += f"; events {'ran' if events_ran(e) else 'DID NOT RUN as scheduled'}"
                    if e0 is not None:
                        text += f", outer Σ|θ| ÷ first run's − 1 = {e['outer_abs_sum'] / e0['outer_abs_sum'] - 1:+.2e}"
                lines.append(text)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="JSON", help="`tools.benchmark --nonsync --json` outputs")
    return parser


def main(argv: list[str] | None = None) -> str:
    args = build_parser().parse_args(argv)
    runs, missing = {}, []
    for path in args.runs:  # a stage that failed or ran out of time leaves no JSON: compare the others
        try:
            runs[os.path.basename(path).removesuffix(".json")] = load(path)
        except Unreadable as e:
            missing.append(str(e))
    if not runs:
        raise SystemExit("\n".join(missing))
    text = "\n".join([*(f"{m} (not compared)" for m in missing), compare(runs)])
    print(text)
    return text


if __name__ == "__main__":
    main()
