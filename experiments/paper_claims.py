"""The Streaming DiLoCo paper's smaller claims, re-measured with 10 paired seeds.

    python -m experiments.paper_claims --out runs/paper_claims --parallel 2   # 80 runs of 1620 steps
    python -m experiments.paper_claims --out runs/paper_claims --quick        # 1 seed of 60 steps

Streaming DiLoCo, K = 2 islands, H = 30, P = 3, outer Nesterov η = 0.5, β = 0.8, on the
42k-parameter byte-level transformer (4 layers × 24: fragments 1 and 2 hold layers {0, 2}
and {1, 3} interleaved, {0, 1} and {2, 3} sequential) for 1620 steps × 8 × 64 bytes (20
tokens per parameter). Methods: V ∈ {0, 1, 2, 5, 10} at α = 0 (interleaved, float32);
sequential fragments; FP4 pseudo-gradients (no error feedback); and V = 1, α = 0.5 with
island 0 evaluated beside the outer parameters every 5 steps. Claims, from seed-paired 95%
t-intervals of the final held-out loss: each V ≥ 1 within 0.2% of V = 0; interleaved below
sequential; FP4 within 0.2% of float32. For the drifting setting, OUT/period.csv has the
outer-minus-island-0 difference at every offset within the period (mean over the evaluations
of the second half of training, then paired over seeds) with its verdict, and
OUT/paper_claims_period.png draws it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diloco_eqx.training.loop import read_jsonl
from experiments.stats import interval, paired, verdict
from experiments.sweep import status, study_args, study_parser
from experiments.variants import Claim, Method, Study, run_study, write_csv

MODEL = ("--layers", "4", "--width", "24", "--heads", "2", "--seq-len", "64", "--global-batch", "8")
PERIOD, EVAL_EVERY = 30, 5
DRIFT = "drift_V1_alpha0.5"
OVERLAPS = (0, 1, 2, 5, 10)


def _method(name: str, flags: tuple[str, ...] = (), overlap: int = 0, alpha: float = 0.0,
            order: str = "interleaved", compression: str = "none") -> Method:
    knobs = {"overlap_steps": overlap, "alpha": alpha, "fragment_order": order, "compression": compression}
    return Method(name, knobs, ("--overlap-steps", str(overlap), "--alpha", str(alpha), *flags))


METHODS = (
    *(_method(f"V{v}", overlap=v) for v in OVERLAPS),
    _method("sequential", ("--fragment-order", "sequential"), order="sequential"),
    _method("fp4", ("--compression", "fp4"), compression="fp4"),
    _method(DRIFT, ("--eval-island", "--eval-every", str(EVAL_EVERY)), overlap=1, alpha=0.5),
)
CLAIMS = (
    *(Claim(f"V={v} within 0.2% of V=0 (paper: under 0.2%)", f"V{v}", "V0", 0.2) for v in OVERLAPS[1:]),
    Claim("interleaved below sequential (paper: interleaved slightly better)", "V0", "sequential"),
    Claim("FP4 within 0.2% of float32 (paper: lossless)", "fp4", "V0", 0.2),
)
FULL = Study(
    name="paper_claims", doc=__doc__, methods=METHODS, claims=CLAIMS, seeds=tuple(range(10)), steps=1620,
    base=("--streaming", "--num-replicas", "2", "--sync-period", "30", "--num-fragments", "3",
          "--outer-lr", "0.5", "--outer-momentum", "0.8"),
    model=MODEL,
    title="paper claims: Streaming K=2, H=30, P=3, 4L×24 byte LM, {steps} steps × 8 × 64 bytes, "
          "{seeds} seeds (band: ± std)")
QUICK = dataclasses.replace(FULL, seeds=(0,), steps=60,
                            methods=tuple(m for m in METHODS if m.name in ("V0", "V5", "sequential", "fp4", DRIFT)),
                            claims=tuple(c for c in CLAIMS if c.a in ("V5", "V0", "fp4")))


def period_offsets(study: Study, out: Path) -> dict[int, tuple[dict[int, float], dict[int, float]]]:
    """offset within the period -> (seed -> outer, seed -> island 0) held-out loss, each the
    mean over the evaluations of the second half of training at that offset."""
    got: dict[int, dict[int, list[tuple[float, float]]]] = {}
    for name, method, seed, _ in study.jobs():
        if method.name != DRIFT or status(out / name) != "finished":
            continue
        for row in read_jsonl(out / name / "metrics.jsonl"):
            if "eval_loss_island_0" in row and row["step"] > study.steps // 2:
                got.setdefault(row["step"] % PERIOD, {}).setdefault(seed, []).append(
                    (row["eval_loss"], row["eval_loss_island_0"]))
    return {off: ({s: float(np.mean([o for o, _ in v])) for s, v in seeds.items()},
                  {s: float(np.mean([i for _, i in v])) for s, v in seeds.items()})
            for off, seeds in sorted(got.items())}


def analyse_period(study: Study, out: Path) -> list[dict]:
    """Per offset: the paired outer − island 0 difference, and whether the outer parameters
    evaluate lower (holding), higher (contradicted) or neither."""
    rows = []
    for off, (outer, island) in period_offsets(study, out).items():
        p = paired(outer, island)
        rows.append({"offset": off, "outer": float(np.mean(list(outer.values()))),
                     "island_0": float(np.mean(list(island.values()))), **p, "verdict": verdict(p)})
    return rows


def overlap_trend(rows: list[dict]) -> dict:
    """The per-seed least-squares slope of the loss change vs V = 0 (%) against V, with its
    t-interval over seeds: "the overlap's cost grows with V" holds when the interval is above 0."""
    by: dict[int, dict[int, float]] = {}
    for r in rows:
        if r["method"] in {f"V{v}" for v in OVERLAPS}:
            by.setdefault(int(r["seed"]), {})[int(r["overlap_steps"])] = float(r["eval_loss"])
    slopes = [float(np.polyfit(list(v), [100 * (v[k] / v[0] - 1) for k in v], 1)[0])
              for v in by.values() if len(v) == len(OVERLAPS)]
    if not slopes:
        return {}
    t = interval(slopes)
    return {"slope_pct_per_step": t["mean"], "lo": t["lo"], "hi": t["hi"], "n": t["n"],
            "verdict_cost_grows_with_V": "holding" if t["lo"] > 0 else "contradicted" if t["hi"] < 0 else "unresolved"}


def plot_period(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    off = [r["offset"] for r in rows]
    ax.errorbar(off, [r["diff"] for r in rows], yerr=[[r["diff"] - r["lo"] for r in rows],
                [r["hi"] - r["diff"] for r in rows]], fmt="o-", capsize=3)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel(f"step mod {PERIOD} (fragment syncs at 10, 20, 0)")
    ax.set_ylabel("outer − island 0 held-out loss\n(nats/byte, 95% interval)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    return study_parser("python -m experiments.paper_claims", __doc__, f"runs/{FULL.name}",
                        "one seed of short runs, to check the pipeline")


def main(argv: Sequence[str] | None = None) -> int:
    args = study_args(build_parser(), argv)
    study, out = (QUICK if args.quick else FULL), args.out
    rc = run_study(study, out, args.parallel)
    if rc:
        return rc
    rows = analyse_period(study, out)
    write_csv(out / "period.csv", rows)
    trend = overlap_trend(list(csv.DictReader(open(out / "summary.csv"))))
    result = json.loads((out / f"{study.name}.json").read_text())
    (out / f"{study.name}.json").write_text(json.dumps({**result, "period": rows, "overlap_trend": trend}, indent=1))
    if trend:
        print(f"loss change per step of V: {trend['slope_pct_per_step']:+.3f}% [{trend['lo']:+.3f}, {trend['hi']:+.3f}] "
              f"(n={trend['n']}) -> cost grows with V: {trend['verdict_cost_grows_with_V']}")
    plot_period(rows, out / f"{study.name}_period.png",
                f"V=1, α=0.5: outer vs island 0, second half of training, {len(study.seeds)} seed(s)")
    for r in rows:
        print(f"offset {r['offset']:2d}: outer − island 0 {r['diff']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}] "
              f"-> {r['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
