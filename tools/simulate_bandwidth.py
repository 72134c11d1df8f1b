"""Bandwidth each method needs for a compute utilization, from the event model in
diloco_eqx/analysis/simulator.py; by default the Streaming DiLoCo paper's Table 4 setting.

    python -m tools.simulate_bandwidth                       # 1B, 24 layers, 0.1 s/step, H=100
    python -m tools.simulate_bandwidth --plot util.png --json table.json
    python -m tools.simulate_bandwidth --params 35e6 --layers 12 --step-time 0.02 --sync-period 30
    python -m tools.simulate_bandwidth --bandwidth 10 --steps 1000   # one run: wall-clock, utilization

Methods: Data-Parallel (every step), vanilla DiLoCo (every H), Streaming DiLoCo
(`--layers-per-fragment` layers every round(H/P) steps), + overlap (V steps), + overlap + FP4.
"""

from __future__ import annotations

import argparse
import json
import sys

# The paper's 1B rows (Gbit/s for 50/80/90/95/99% compute utilization), for comparison.
PAPER_TABLE4 = {
    "Data-Parallel": [86.8, 152.6, 184.2, 222.3, 569.0],
    "DiLoCo": [1.4, 6.2, 13.3, 23.3, 86.8],
    "Streaming DiLoCo": [1.4, 5.2, 9.1, 16.0, 28.1],
    "+ overlap": [1.4, 4.3, 6.2, 9.1, 11.0],
    "+ overlap + FP4": [0.4, 0.9, 1.7, 2.0, 3.0],
}
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)


def build_parser() -> argparse.ArgumentParser:
    from diloco_eqx.config import DiLoCoConfig
    from diloco_eqx.training.cli import add_flags

    p = argparse.ArgumentParser(prog="python -m tools.simulate_bandwidth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--params", type=float, default=1e9, help="total parameters (default: 1e9)")
    a("--layers", type=int, default=24, help="layers; parameters split evenly (default: 24)")
    a("--layer-params", type=int, nargs="+", default=None,
      help="per-layer parameter counts instead of --params/--layers")
    a("--step-time", type=float, default=0.1, help="seconds of pure compute per step (default: 0.1)")
    add_flags(p, DiLoCoConfig(sync_period=100, streaming=True, overlap_steps=1),
              only=("sync_period", "fragment_order", "overlap_steps"))
    a("--layers-per-fragment", type=int, default=3, help="streaming fragment size (default: 3)")
    a("--bits", type=int, default=16, help="bits per value on the wire (default: 16, bf16)")
    a("--low-bits", type=int, default=4, help="bits for the compressed row (default: 4, FP4)")
    a("--latency", type=float, default=0.0, help="seconds per transfer (default: 0)")
    a("--workers", type=int, default=2, help="M workers in the ring (default: 2)")
    a("--bandwidth", type=float, default=None,
      help="simulate one run at this Gbit/s instead of the table")
    a("--steps", type=int, default=None, help="steps to simulate (default: 4 sync periods)")
    a("--json", default=None, help="write the table here")
    a("--plot", default=None, help="write utilization against bandwidth here (PNG)")
    return p


def methods(args) -> list[tuple[str, object]]:
    from diloco_eqx.analysis.simulator import Method

    n_layers = len(args.layer_params) if args.layer_params else args.layers
    if args.layers_per_fragment < 1 or n_layers % args.layers_per_fragment:
        raise ValueError(f"--layers-per-fragment must divide the {n_layers} layers; "
                         f"got {args.layers_per_fragment}")
    p = n_layers // args.layers_per_fragment
    h, v, order = args.sync_period, args.overlap_steps, args.fragment_order
    return [
        ("Data-Parallel", Method("ddp", bits=args.bits)),
        ("DiLoCo", Method("diloco", h, bits=args.bits)),
        ("Streaming DiLoCo", Method("streaming", h, p, 0, args.bits, order)),
        ("+ overlap", Method("streaming", h, p, v, args.bits, order)),
        ("+ overlap + FP4", Method("streaming", h, p, v, args.low_bits, order)),
    ]


def workload(args):
    from diloco_eqx.analysis.simulator import Workload, uniform_layers

    layers = tuple(args.layer_params) if args.layer_params else uniform_layers(args.params, args.layers)
    return Workload(layers, args.step_time, num_workers=args.workers)


def plot(path: str, w, ms, latency: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from diloco_eqx.analysis.simulator import simulate

    bws = np.logspace(-1, 3, 81)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, m in ms:
        ax.plot(bws, [100 * simulate(w, m, b, latency).utilization for b in bws], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth between workers (Gbit/s)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_title(f"{sum(w.layer_params) / 1e9:.2g}B params, {len(w.layer_params)} layers, "
                 f"{w.step_time} s/step", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from diloco_eqx.analysis.simulator import bandwidth_table, simulate

    try:
        w, ms = workload(args), methods(args)
        if args.bandwidth is not None:
            for name, m in ms:
                r = simulate(w, m, args.bandwidth, args.latency, args.steps)
                print(f"{name:>17}: wall {r.wall_time:10.2f} s for {r.compute_time:.2f} s of compute, "
                      f"utilization {100 * r.utilization:5.1f}%, {r.bits_sent / 8e9:.3f} GB sent")
            return 0
        table = bandwidth_table(w, ms, TARGETS, args.latency)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    defaults = build_parser().parse_args([])
    setting = ("params", "layers", "layer_params", "step_time", "sync_period", "layers_per_fragment",
               "fragment_order", "overlap_steps", "bits", "low_bits", "latency", "workers")
    paper = all(getattr(args, k) == getattr(defaults, k) for k in setting)  # the paper's setting
    head = "".join(f"{int(100 * u):>9}%" for u in TARGETS)
    print(f"Gbit/s needed for compute utilization ({sum(w.layer_params):.3g} params, "
          f"{len(w.layer_params)} layers, {w.step_time} s/step, H={args.sync_period})")
    print(f"{'':>26}{head}")
    for name, row in table.items():
        print(f"{name + ' (ours)':>26}" + "".join(f"{x:>10.1f}" for x in row))
        if paper:
            print(f"{name + ' (paper)':>26}" + "".join(f"{x:>10.1f}" for x in PAPER_TABLE4[name]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"targets": TARGETS, "ours": table,
                       "paper": PAPER_TABLE4 if paper else None}, fh, indent=1)
    if args.plot:
        plot(args.plot, w, ms, args.latency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
