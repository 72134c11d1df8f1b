"""SparseLoCo (Sarfi et al. 2025) against DiLoCo in float32 and with fp4: held-out loss
against the bytes each island sends. 5 seeds.

    python -m experiments.sparseloco --out runs/sparseloco                # 25 runs of 600 steps
    python -m experiments.sparseloco --out runs/sparseloco --quick        # 5 runs of 60 steps
    python -m experiments.sparseloco --out runs/sparseloco --parallel 2

Vanilla DiLoCo, K = 2 islands, H = 30, the 2-layer × 64 byte-level transformer, GBS 8 × 64
bytes, 600 steps (20 syncs). Methods:

- DiLoCo, float32, outer η = 1, β = 0 (plain averaging: the best outer setting at K = 2 in
  outer_optimizers.py);
- DiLoCo with fp4 pseudo-gradients and error feedback, the same outer step;
- SparseLoCo at density 1%, 3% and 10%: per island the error buffer e <- 0.95·e + Δ, the
  chunked top-k of e (chunks of 4096, 2-bit values) is sent and subtracted from e, and the
  outer model steps on the islands' mean of what was sent with η = 1 and no outer momentum
  (the paper's choices: error decay 0.95, 2 bits, chunk 4096, outer SGD).

Bytes come from each run's log, counted from the codec's payload (analysis.comms: for
SparseLoCo the packed 2-bit values, their uint16 indices and a float32 scale per chunk; the
index part is the summary's comm_index_bytes_per_island). Claims (seed-paired 95%
t-intervals): SparseLoCo at 1% and at 3% density ends below DiLoCo in float32 (the paper,
at 512M parameters); SparseLoCo at each density ends below fp4, which sends more bytes.
"""

from __future__ import annotations

import dataclasses
import sys

from experiments.variants import Claim, Method, Study, build_parser as study_parser, main as study_main

DENSITIES = (0.01, 0.03, 0.1)
ERROR_DECAY, TOPK_CHUNK, TOPK_BITS = 0.95, 4096, 2
METHODS = (
    Method("diloco", {"compression": "none", "error_feedback": False, "error_decay": "", "topk_density": ""}, ()),
    Method("fp4", {"compression": "fp4", "error_feedback": True, "error_decay": "", "topk_density": ""},
           ("--compression", "fp4", "--error-feedback")),
    *(Method(f"sparseloco_{d:g}",
             {"compression": "topk", "error_feedback": True, "error_decay": ERROR_DECAY, "topk_density": d},
             ("--compression", "topk", "--error-feedback", "--error-decay", str(ERROR_DECAY), "--topk-density",
              str(d), "--topk-chunk", str(TOPK_CHUNK), "--topk-bits", str(TOPK_BITS)))
      for d in DENSITIES),
)
CLAIMS = (
    Claim("SparseLoCo 1% below DiLoCo float32 (paper: below, 512M)", "sparseloco_0.01", "diloco"),
    Claim("SparseLoCo 3% below DiLoCo float32 (paper: below, 512M)", "sparseloco_0.03", "diloco"),
    *(Claim(f"SparseLoCo {d:.0%} below fp4 + error feedback", f"sparseloco_{d:g}", "fp4") for d in DENSITIES),
)


def index_bytes(method: Method, summary: dict) -> dict:
    return {"comm_index_bytes_per_island": summary.get("comm_index_bytes_per_island", 0)}


FULL = Study(
    name="sparseloco", doc=__doc__, methods=METHODS, claims=CLAIMS, seeds=(0, 1, 2, 3, 4), steps=600,
    base=("--no-streaming", "--num-replicas", "2", "--sync-period", "30", "--outer-lr", "1.0",
          "--outer-momentum", "0.0"),
    title="SparseLoCo vs DiLoCo: K=2, H=30, η=1, β=0, 2L×64 byte LM, {steps} steps × 8 × 64 bytes, "
          "{seeds} seed(s) (band: ± std)",
    loss_vs_bytes=True, extra=index_bytes)
QUICK = dataclasses.replace(FULL, seeds=(0,), steps=60)


def build_parser():
    return study_parser(FULL)


def main(argv: list[str] | None = None) -> int:
    return study_main(FULL, QUICK, argv)


if __name__ == "__main__":
    sys.exit(main())
