"""Where a traced step's time goes on an accelerator: kernels, or the gaps between them.

    python -m tools.trace_gaps TRACE.trace.json.gz [--prefix mode_] [--start-at MemcpyH2D]

Reads a `jax.profiler` trace (the `*.trace.json.gz` beside its `.xplane.pb`) in which every
step was run inside a host annotation named `{prefix}{mode}_{rep}` (`tools.benchmark
--nonsync --trace DIR` writes one) and prints, per step: the device's busy time (the sum of
its kernels and copies), the span from the step's first device event to its last, the idle
gaps inside that span, the device-to-host copies (each a loop predicate XLA:GPU reads on the
host) and the gaps right after them, and the host's time after the last device event. Two
steps whose busy times agree but whose spans differ differ in how the host feeds the device,
not in what the device computes. `--start-at NAME` begins each step at the last device event
of that name inside its annotation (for annotations that also cover work before the step).
A last column counts the host's notes inside the step that a command buffer ran kernel by
kernel because the profiler was on: where it is above 0 the trace shows another program
than the one timed without it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict

D2H = "MemcpyD2H"
GRAPHS_OFF = ("CommandBuffer disabled when profiling", "(disabled for profiling)")
"""Host events by which XLA:GPU notes a command buffer (a CUDA graph) run kernel by kernel
because a profiler is on (unless `--xla_enable_command_buffers_during_profiling=true`): the
first as it runs one, the second in the name of one compiled under the profiler. Such a
trace does not show how the untraced step runs."""


def load(path: str) -> tuple[list[dict], list[dict]]:
    """(every complete ("X") trace event, the device's ones by start time)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in trace
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    events = [e for e in trace if e.get("ph") == "X"]
    device = sorted((e for e in events if "/device:" in processes.get(e["pid"], "")), key=lambda e: e["ts"])
    return events, device


def step_summary(annotation: dict, device: list[dict], start_at: str | None = None) -> dict[str, float]:
    """The device events inside one annotated step (from the last `start_at` event, if
    given), summarized (microseconds). Events may overlap (copies on other streams): busy
    time is the union of their intervals, and a gap is idle time before an event, after
    every event that started earlier has ended."""
    lo, hi = annotation["ts"], annotation["ts"] + annotation["dur"]
    inside = [e for e in device if lo <= e["ts"] < hi]
    if start_at is not None:
        starts = [i for i, e in enumerate(inside) if e["name"] == start_at]
        inside = inside[starts[-1]:] if starts else []
    if not inside:
        raise ValueError(f"{annotation['name']}: no device events inside the annotation"
                         + (f" from a {start_at!r} on" if start_at else ""))
    busy, gaps, reach = 0.0, [], inside[0]["ts"]
    for e in inside:
        start, end = e["ts"], e["ts"] + e["dur"]
        gaps.append(max(0.0, start - reach))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return {"busy": busy, "span": reach - inside[0]["ts"], "gaps": sum(gaps),
            "d2h": sum(e["name"] == D2H for e in inside),
            "after_d2h": sum(g for e, g in zip(inside, gaps[1:]) if e["name"] == D2H),
            "host_after": hi - reach, "events": len(inside)}


def summarize(path: str, prefix: str = "mode_", start_at: str | None = None) -> dict[str, dict[str, float]]:
    """Per mode, the median over its annotated steps of each `step_summary` figure and of
    `graphs_off`, the host events inside the step that say a command buffer ran unrecorded."""
    events, device = load(path)
    on_device = {id(e) for e in device}
    host = [e for e in events if id(e) not in on_device]
    steps = defaultdict(list)
    for a in events:
        if a["name"].startswith(prefix):
            mode = a["name"][len(prefix):].rsplit("_", 1)[0]
            lo, hi = a["ts"], a["ts"] + a["dur"]
            off = sum(lo <= e["ts"] < hi and any(n in e["name"] for n in GRAPHS_OFF) for e in host)
            steps[mode].append(step_summary(a, device, start_at) | {"graphs_off": off})
    if not steps:
        raise ValueError(f"{path}: no host annotation starts with {prefix!r}")
    return {m: {k: statistics.median(s[k] for s in rows) for k in rows[0]} | {"steps": len(rows)}
            for m, rows in steps.items()}


def format_summary(summary: dict[str, dict[str, float]], base: str | None = None) -> str:
    base = base if base in summary else next(iter(summary))
    lines = [f"{'mode':14s} {'busy ms':>9s} {'span ms':>9s} {'span-' + base:>12s} {'gaps us':>8s} "
             f"{'D2H':>4s} {'after D2H us':>13s} {'host after us':>14s} {'events':>7s} {'graphs off':>10s}"]
    for m, s in summary.items():
        lines.append(f"{m:14s} {s['busy'] / 1e3:9.3f} {s['span'] / 1e3:9.3f} "
                     f"{(s['span'] - summary[base]['span']):10.0f}us {s['gaps']:8.0f} {s['d2h']:4.0f} "
                     f"{s['after_d2h']:13.0f} {s['host_after']:14.0f} {s['events']:7.0f} "
                     f"{s.get('graphs_off', 0):10g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a jax.profiler *.trace.json.gz")
    parser.add_argument("--prefix", default="mode_", help="the step annotations' common prefix")
    parser.add_argument("--base", default="plain", help="the mode whose span the others are compared with")
    parser.add_argument("--start-at", default=None, help="begin each step at the last device event of this name")
    args = parser.parse_args(argv)
    print(format_summary(summarize(args.trace, args.prefix, args.start_at), args.base))


if __name__ == "__main__":
    main()
