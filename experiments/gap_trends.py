"""The DiLoCo–Data-Parallel gap against training budget and against model size, 5 seeds.

    python -m experiments.gap_trends --out runs/gap_trends --parallel 2   # 90 runs
    python -m experiments.gap_trends --out runs/gap_trends --quick        # 2 budgets, 2 sizes, 1 seed

Data-Parallel, DiLoCo H = 30 and Streaming DiLoCo H = 30, P = 3 (interleaved, V = 0, α = 0),
K = 2 islands, outer Nesterov η = 0.5, β = 0.8, inner AdamW (lr 3·10⁻³, warmup 50, cosine to
10% over each run's own length), 8 × 64 bytes per step, 2-layer byte-level transformers.
  gap_vs_budget  the 43k-parameter model (2 × 32) at 4, 10, 20 and 40 tokens per parameter
  gap_vs_size    2 × 12 (10k), 2 × 32 (43k) and 2 × 64 (135k parameters, 13× the smallest)
                 at 20 tokens per parameter (the 43k point is the budget study's run)
Steps are the budget's rounded to whole periods of 30. The gap of a method is its final
held-out loss over Data-Parallel's with the same seed (same initialization and data order),
in %, with a Student-t interval over seeds; the trend is the per-seed least-squares slope of
the gap against log10 of the budget (of the parameters), with its interval. Writes
OUT/gap_vs_budget/ and OUT/gap_vs_size/: summary.csv (one row per run), gaps.csv (per point),
<name>.json (gaps, slopes, verdicts) and <name>.png; OUT/convergence.png: held-out loss against
steps and against bytes sent at the largest budget, seed bands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diloco_eqx.training.loop import read_jsonl
from experiments.stats import describe, interval, paired, verdict
from experiments.sweep import run_jobs, status, study_args, study_parser
from experiments.variants import write_csv

TOKENS_PER_STEP = 8 * 64
PERIOD = 30
SIZES = {"10k": (2, 12, 2, 10_428), "43k": (2, 32, 2, 43_168), "135k": (2, 64, 4, 135_488)}
"""name: (layers, width, heads, parameters)."""
METHODS = {
    "ddp": ("--mode", "ddp"),
    "diloco": ("--no-streaming", "--sync-period", "30", "--outer-lr", "0.5", "--outer-momentum", "0.8"),
    "streaming": ("--streaming", "--num-fragments", "3", "--sync-period", "30", "--outer-lr", "0.5",
                  "--outer-momentum", "0.8"),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    budgets: tuple[float, ...]
    """Tokens per parameter of the budget study (on BUDGET_SIZE)."""
    sizes: tuple[str, ...]
    """Models of the size study (at SIZE_BUDGET tokens per parameter)."""
    seeds: tuple[int, ...]
    budget_size: str = "43k"
    size_budget: float = 20

    def points(self) -> list[tuple[str, float]]:
        """(size, tokens per parameter) of every grid point, each once."""
        pts = [(self.budget_size, b) for b in self.budgets] + [(s, self.size_budget) for s in self.sizes]
        return list(dict.fromkeys(pts))


FULL = Plan(budgets=(4, 10, 20, 40), sizes=("10k", "43k", "135k"), seeds=(0, 1, 2, 3, 4))
QUICK = Plan(budgets=(1, 2), sizes=("10k", "43k"), seeds=(0,), size_budget=1)


def steps_for(size: str, tpp: float) -> int:
    """The budget's steps rounded to whole periods (at least one)."""
    return PERIOD * max(1, round(tpp * SIZES[size][3] / TOKENS_PER_STEP / PERIOD))


def run_name(method: str, size: str, tpp: float, seed: int) -> str:
    return f"{method},size={size},tpp={tpp:g},seed={seed}"


def jobs(plan: Plan) -> list[tuple[str, list[str]]]:
    out = []
    for seed in plan.seeds:
        for size, tpp in plan.points():
            layers, width, heads, _ = SIZES[size]
            steps = steps_for(size, tpp)
            every = PERIOD * max(1, round(steps / 16 / PERIOD))
            base = ["--layers", str(layers), "--width", str(width), "--heads", str(heads), "--seq-len", "64",
                    "--global-batch", "8", "--steps", str(steps), "--eval-every", str(every),
                    "--checkpoint-every", str(steps), "--eval-batches", "16", "--seed", str(seed)]
            out += [(run_name(m, size, tpp, seed), [*base, *flags]) for m, flags in METHODS.items()]
    return out


def summarize(plan: Plan, out: Path) -> list[dict]:
    """One row per finished run: method, model, budget, seed, final loss, tokens, bytes sent."""
    rows = []
    for seed in plan.seeds:
        for size, tpp in plan.points():
            for method in METHODS:
                name = run_name(method, size, tpp, seed)
                if status(out / name) != "finished":
                    continue
                meta = json.loads((out / name / "run.json").read_text())
                s, params = meta["summary"], meta["model"]["params"]
                first = next(r["loss"] for r in read_jsonl(out / name / "metrics.jsonl") if r.get("step") == 1)
                rows.append({"method": method, "size": size, "params": params, "tpp": tpp,
                             "tokens_per_param": round(s["tokens"] / params, 2), "steps": s["steps"],
                             "seed": seed, "eval_loss": s["eval_loss"], "first_loss": first, "tokens": s["tokens"],
                             "comm_bytes_per_island": s["comm_bytes_per_island"],
                             "wall_time": round(s["wall_time"], 1), "run": name})
    return rows


def start_spread(rows: list[dict]) -> float:
    """The largest difference of the step-1 training loss between runs of one model and seed.
    The learning rate is 0 at step 1 and Data-Parallel's loss is the mean of the islands', so
    this is rounding only when every method and budget starts from the same initialization
    and the same first batch."""
    by: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        by.setdefault((r["size"], int(r["seed"])), []).append(float(r["first_loss"]))
    return max((max(v) - min(v) for v in by.values()), default=0.0)


def slope(xs: Sequence[float], gaps: Sequence[float]) -> float:
    """Least-squares slope of the gap (%) against log10 x."""
    return float(np.polyfit(np.log10(xs), gaps, 1)[0])


def gaps(rows: list[dict], axis: str, margin_pct: float = 1.0) -> dict:
    """Per point (value of `axis`: "tpp" or "params") and method, the seed-paired gap to
    Data-Parallel with its interval and the verdict of "within margin_pct % of DDP"; per
    method, the per-seed slope of the gap against log10(axis) with its interval and the
    verdict of "the gap shrinks" (slope below 0)."""
    loss: dict[tuple[str, float], dict[int, float]] = {}
    for r in rows:
        loss.setdefault((r["method"], float(r[axis])), {})[int(r["seed"])] = float(r["eval_loss"])
    xs = sorted({x for _, x in loss})
    points, trends = [], []
    for method in (m for m in METHODS if m != "ddp"):
        per_seed: dict[int, list[tuple[float, float]]] = {}
        for x in xs:
            if (method, x) not in loss or ("ddp", x) not in loss:
                continue
            a, b = loss[(method, x)], loss[("ddp", x)]
            p = paired(a, b)
            points.append({"method": method, axis: x, **describe(list(a.values())), "ddp_mean": float(np.mean(list(b.values()))),
                           "gap_pct": p["diff_pct"], "lo_pct": p["lo_pct"], "hi_pct": p["hi_pct"],
                           "verdict_within_1pct": verdict(p, margin_pct)})
            for s in set(a) & set(b):
                per_seed.setdefault(s, []).append((x, 100 * (a[s] - b[s]) / b[s]))
        slopes = [slope(*zip(*pts)) for pts in per_seed.values() if len(pts) > 2]
        if slopes:
            t = interval(slopes)
            trends.append({"method": method, "slope_pct_per_decade": t["mean"], "lo": t["lo"], "hi": t["hi"],
                           "n": t["n"], "verdict_gap_shrinks": verdict({"hi": t["hi"], "lo": t["lo"]})})
    return {"points": points, "trends": trends}


LABELS = {"ddp": "Data-Parallel", "diloco": "DiLoCo H=30", "streaming": "Streaming H=30, P=3"}


def plot_gaps(rows: list[dict], result: dict, axis: str, path: Path, title: str) -> None:
    """Left: final held-out loss per method against the axis (mean ± std); right: the gap
    to Data-Parallel with its 95% interval, and the 1% line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, method in enumerate(METHODS):
        by: dict[float, list[float]] = {}
        for r in rows:
            if r["method"] == method:
                by.setdefault(float(r[axis]), []).append(float(r["eval_loss"]))
        xs = sorted(by)
        left.errorbar(xs, [np.mean(by[x]) for x in xs], yerr=[np.std(by[x], ddof=1) if len(by[x]) > 1 else 0
                      for x in xs], fmt="o-", capsize=3, color=f"C{i}", label=LABELS[method])
        pts = [p for p in result["points"] if p["method"] == method]
        if pts:
            x = [p[axis] for p in pts]
            g = np.array([p["gap_pct"] for p in pts])
            lo = np.array([p["lo_pct"] if math.isfinite(p["lo_pct"]) else p["gap_pct"] for p in pts])
            hi = np.array([p["hi_pct"] if math.isfinite(p["hi_pct"]) else p["gap_pct"] for p in pts])
            right.errorbar(x, g, yerr=[g - lo, hi - g], fmt="o-", capsize=3, color=f"C{i}", label=LABELS[method])
    xlabel = "tokens per parameter" if axis == "tpp" else "parameters"
    right.axhline(1.0, color="k", lw=0.8, ls=":", label="1% (the papers' parity)")
    right.axhline(0.0, color="k", lw=0.6)
    ticks = sorted({float(r[axis]) for r in rows})
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" if axis == "tpp" else f"{t / 1000:.0f}k" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("final held-out loss (nats/byte, ± std)")
    right.set_ylabel("gap to Data-Parallel (%, seed-paired 95% CI)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def convergence(plan: Plan, out: Path, size: str, tpp: float) -> dict[str, list[tuple[int, float, list[float]]]]:
    """method -> [(step, bytes sent per island so far, held-out loss per seed)] at the
    evaluations every seed of that method has."""
    got: dict[str, dict[int, tuple[float, list[float]]]] = {}
    for method in METHODS:
        for seed in plan.seeds:
            run = out / run_name(method, size, tpp, seed)
            if status(run) != "finished":
                continue
            sent = {}
            for row in read_jsonl(run / "metrics.jsonl"):
                if "comm_bytes_per_island" in row:
                    sent[row["step"]] = row["comm_bytes_per_island"]
                if "eval_loss" in row:
                    got.setdefault(method, {}).setdefault(row["step"], (sent.get(row["step"], 0.0), []))[1].append(
                        row["eval_loss"])
    full = {m: max(len(v) for _, v in by.values()) for m, by in got.items()}
    return {m: [(s, b, v) for s, (b, v) in sorted(by.items()) if len(v) == full[m]] for m, by in got.items()}


def plot_convergence(curves: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (method, pts) in enumerate(curves.items()):
        steps = np.array([p[0] for p in pts])
        sent = np.array([p[1] for p in pts])
        mean = np.array([np.mean(p[2]) for p in pts])
        std = np.array([np.std(p[2], ddof=1) if len(p[2]) > 1 else 0.0 for p in pts])
        for ax, x in ((left, steps), (right, sent)):
            keep = x > 0
            ax.plot(x[keep], mean[keep], color=f"C{i}", lw=1.2, label=LABELS[method])
            ax.fill_between(x[keep], (mean - std)[keep], (mean + std)[keep], color=f"C{i}", alpha=0.2)
    left.set_xlabel("step")
    right.set_xlabel("bytes sent per island so far")
    right.set_xscale("log")
    for ax in (left, right):
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(plan: Plan, out: Path) -> dict:
    """Write both studies' summaries, gaps, verdicts and figures; returns the verdicts."""
    rows = summarize(plan, out)
    spread = start_spread(rows)
    if spread > 1e-4:
        raise RuntimeError(f"runs of one model and seed start from different losses (spread {spread:.2e}): "
                           "the methods do not share initialization and data order")
    studies = {
        "gap_vs_budget": ("tpp", [r for r in rows if r["size"] == plan.budget_size and r["tpp"] in plan.budgets],
                          f"gap vs budget: {plan.budget_size} parameters, K=2, {len(plan.seeds)} seed(s)"),
        "gap_vs_size": ("params", [r for r in rows if r["tpp"] == plan.size_budget and r["size"] in plan.sizes],
                        f"gap vs size: {plan.size_budget:g} tokens per parameter, K=2, {len(plan.seeds)} seed(s)"),
    }
    results = {}
    for name, (axis, sub, title) in studies.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        write_csv(out / name / "summary.csv", sub)
        res = results[name] = {**gaps(sub, axis), "start_spread": start_spread(sub)}
        write_csv(out / name / "gaps.csv", res["points"])
        (out / name / f"{name}.json").write_text(json.dumps(res, indent=1))
        plot_gaps(sub, res, axis, out / name / f"{name}.png", title)
    top = max(plan.budgets)
    plot_convergence(convergence(plan, out, plan.budget_size, top), out / "gap_vs_budget" / "convergence.png",
                     f"{plan.budget_size} parameters, {top:g} tokens per parameter, K=2: mean ± std over "
                     f"{len(plan.seeds)} seed(s)")
    return results


def build_parser() -> argparse.ArgumentParser:
    return study_parser("python -m experiments.gap_trends", __doc__, "runs/gap_trends",
                        "tiny budgets, one seed: checks the pipeline")


def main(argv: Sequence[str] | None = None) -> int:
    args = study_args(build_parser(), argv)
    plan, out = (QUICK if args.quick else FULL), args.out
    failed = run_jobs(out, jobs(plan), args.parallel)
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    results = report(plan, out)
    print(f"step-1 loss spread within a model and seed (same start): {results['gap_vs_budget']['start_spread']:.1e}")
    for name, res in results.items():
        for pt in res["points"]:
            axis = "tpp" if name == "gap_vs_budget" else "params"
            print(f"{name} {pt['method']} {axis}={pt[axis]:g}: gap {pt['gap_pct']:+.2f}% "
                  f"[{pt['lo_pct']:+.2f}, {pt['hi_pct']:+.2f}] -> within 1%: {pt['verdict_within_1pct']}")
        for t in res["trends"]:
            print(f"{name} {t['method']}: slope {t['slope_pct_per_decade']:+.2f} %/decade "
                  f"[{t['lo']:+.2f}, {t['hi']:+.2f}] -> shrinks: {t['verdict_gap_shrinks']}")
    print(f"wrote {out / 'gap_vs_budget'} and {out / 'gap_vs_size'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
