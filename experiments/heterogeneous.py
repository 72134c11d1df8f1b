"""Heterogeneous islands: K = 4 islands of speeds (1, 1, 0.5, 0.25) — island k takes
⌊s_k·H⌋ of every H inner steps — averaged uniformly, weighted by the tokens each trained
on, or with the two slow islands dropped; against four equal islands. 5 seeds.

    python -m experiments.heterogeneous --out runs/heterogeneous              # 20 runs of 600 steps
    python -m experiments.heterogeneous --out runs/heterogeneous --quick      # 4 runs of 60 steps
    python -m experiments.heterogeneous --out runs/heterogeneous --parallel 2

Vanilla DiLoCo, H = 30 (inner steps per round 30, 30, 15, 7), Nesterov outer (η = 0.7,
β = 0.9), the 2-layer × 64 byte-level transformer, GBS 8 × 64 bytes (2 sequences per
island). "dropped" is speeds (1, 1, 0, 0) token-weighted: the slow islands never train
and never enter the mean, as if only the fast two existed. Claims (seed-paired 95%
t-intervals): token weighting beats the uniform mean; token weighting beats dropping the
slow islands.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from experiments.variants import Claim, Method, Study, build_parser as study_parser, main as study_main

H = 30
SPEEDS = {"equal": (1, 1, 1, 1), "uniform": (1, 1, 0.5, 0.25), "tokens": (1, 1, 0.5, 0.25), "dropped": (1, 1, 0, 0)}
WEIGHTING = {"equal": "uniform", "uniform": "uniform", "tokens": "tokens", "dropped": "tokens"}
METHODS = tuple(
    Method(name, {"island_speed": " ".join(map(str, s)), "island_weighting": WEIGHTING[name]},
           ("--island-speed", *map(str, s), "--island-weighting", WEIGHTING[name]))
    for name, s in SPEEDS.items())
CLAIMS = (
    Claim("token-weighted mean below the uniform mean", "tokens", "uniform"),
    Claim("token-weighted mean below dropping the slow islands", "tokens", "dropped"),
    Claim("uniform mean below dropping the slow islands", "uniform", "dropped"),
    Claim("equal islands below token-weighted slow ones (the cost of slowness)", "equal", "tokens"),
    Claim("slow islands averaged uniformly within 1% of equal islands", "uniform", "equal", 1.0),
)


def trained_tokens(method: Method, summary: dict) -> dict:
    """Tokens the islands trained on (idle steps' batches are not used)."""
    steps = [math.floor(float(s) * H + 1e-9) for s in method.knobs["island_speed"].split()]
    return {"tokens_trained": round(summary["tokens"] * sum(steps) / (H * len(steps)))}


FULL = Study(
    name="heterogeneous", doc=__doc__, methods=METHODS, claims=CLAIMS, seeds=(0, 1, 2, 3, 4), steps=600,
    base=("--no-streaming", "--num-replicas", "4", "--sync-period", str(H), "--outer-lr", "0.7",
          "--outer-momentum", "0.9"),
    title="heterogeneous islands: K=4, speeds (1, 1, 0.5, 0.25), H=30, 2L×64 byte LM, {steps} steps × 8 × 64 bytes, "
          "{seeds} seed(s) (band: ± std)",
    extra=trained_tokens)
QUICK = dataclasses.replace(FULL, seeds=(0,), steps=60)


def build_parser():
    return study_parser(FULL)


def main(argv: list[str] | None = None) -> int:
    return study_main(FULL, QUICK, argv)


if __name__ == "__main__":
    sys.exit(main())
