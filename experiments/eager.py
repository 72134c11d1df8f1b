"""Eager updates: DiLoCo's exchange left in flight for a whole round, applied naively one
round late or eagerly (each island's fresh pseudo-gradient in place of its stale share),
against the blocking exchange; and Streaming DiLoCo with eager updates. 5 seeds.

    python -m experiments.eager --out runs/eager                 # 40 runs of 600 steps + 10 of 1800
    python -m experiments.eager --out runs/eager --quick         # 5 runs of 60 steps
    python -m experiments.eager --out runs/eager --parallel 2

K = 2 islands, H = 30, Nesterov outer (η = 0.7, β = 0.9), the 2-layer × 64 byte-level
transformer, GBS 8 × 64 bytes; streaming: P = 3, V = 0, α = 0. Claims (seed-paired 95%
t-intervals): the naive one-round delay costs loss; eager beats naive; eager is within 1%
of the blocking exchange, for DiLoCo and for Streaming DiLoCo, and for DiLoCo again at three
times the steps (60 rounds instead of 20); and the DiLoCo comparisons again without outer
momentum (η = 1, β = 0), to see how much of the delay's cost comes through the momentum.
"""

from __future__ import annotations

import dataclasses
import sys

from experiments.variants import Claim, Method, Study, build_parser as study_parser, main as study_main

K = 2
BASE_KNOBS = {"outer_lr": 0.7, "outer_momentum": 0.9, "steps": 600}
METHODS = (
    Method("diloco", {"streaming": False, "delayed_outer": "none", **BASE_KNOBS}, ("--no-streaming",)),
    Method("diloco_naive", {"streaming": False, "delayed_outer": "naive", **BASE_KNOBS}, ("--no-streaming", "--delayed-outer", "naive")),
    Method("diloco_eager", {"streaming": False, "delayed_outer": "eager", **BASE_KNOBS}, ("--no-streaming", "--delayed-outer", "eager")),
    Method("streaming", {"streaming": True, "delayed_outer": "none", **BASE_KNOBS}, ("--streaming", "--num-fragments", "3")),
    Method("streaming_eager", {"streaming": True, "delayed_outer": "eager", **BASE_KNOBS},
           ("--streaming", "--num-fragments", "3", "--delayed-outer", "eager")),
)
AVERAGING = tuple(  # the same without outer momentum (η = 1, β = 0: plain averaging)
    Method(f"{m.name}_avg", {**m.knobs, "outer_lr": 1.0, "outer_momentum": 0.0},
           (*m.flags, "--outer-lr", "1.0", "--outer-momentum", "0.0"))
    for m in METHODS if not m.knobs["streaming"])
LONG = tuple(  # three times the steps (60 rounds): does eager's gap shrink with training?
    Method(f"{m.name}_1800", {**m.knobs, "steps": 1800}, (*m.flags, "--steps", "1800", "--eval-every", "300"))
    for m in METHODS if m.name in ("diloco", "diloco_eager"))
CLAIMS = (
    Claim("no overlap below naive one-round delay (paper: 2.67 vs 3.01)", "diloco", "diloco_naive"),
    Claim("eager below naive delay (paper: 2.69 vs 3.01)", "diloco_eager", "diloco_naive"),
    Claim("eager within 1% of no overlap (paper: +0.7%)", "diloco_eager", "diloco", 1.0),
    Claim("Streaming eager within 1% of Streaming without overlap", "streaming_eager", "streaming", 1.0),
    Claim("eager within 1% of no overlap at 1800 steps (60 rounds)", "diloco_eager_1800", "diloco_1800", 1.0),
    Claim("averaging: no overlap below naive delay", "diloco_avg", "diloco_naive_avg"),
    Claim("averaging: eager below naive delay", "diloco_eager_avg", "diloco_naive_avg"),
    Claim("averaging: eager within 1% of no overlap", "diloco_eager_avg", "diloco_avg", 1.0),
)
FULL = Study(
    name="eager", doc=__doc__, methods=METHODS + LONG + AVERAGING, claims=CLAIMS, seeds=(0, 1, 2, 3, 4), steps=600,
    base=("--num-replicas", str(K), "--sync-period", "30", "--overlap-steps", "0", "--outer-lr", "0.7",
          "--outer-momentum", "0.9"),
    title="eager updates: K=2, H=30, 2L×64 byte LM, {steps} steps × 8 × 64 bytes, {seeds} seed(s) (band: ± std)")
QUICK = dataclasses.replace(FULL, methods=METHODS, claims=CLAIMS[:4], seeds=(0,), steps=60)


def build_parser():
    return study_parser(FULL)


def main(argv: list[str] | None = None) -> int:
    return study_main(FULL, QUICK, argv)


if __name__ == "__main__":
    sys.exit(main())
