"""The outer-optimizer study: Nesterov (η × β) at K = 1, 2, 4, outer Adam, plain averaging
(η = 1, β = 0: the outer model becomes the islands' mean) and Data-Parallel, 3 seeds each.

    python -m experiments.outer_optimizers --out runs/outer_optimizers             # 129 runs
    python -m experiments.outer_optimizers --out runs/outer_optimizers --quick     # 7 runs of 30 steps
    python -m experiments.outer_optimizers --out runs/outer_optimizers --parallel 2

Vanilla DiLoCo, H = 30, the 2-layer × 64 byte-level transformer on the stdlib corpus, GBS 8 ×
64 bytes. Claims checked (seed-paired, 95% t-intervals): one-island DiLoCo (its best η, β) is
below Data-Parallel; the best outer learning rate rises with K; averaging and outer Adam
against the best Nesterov setting. Writes OUT/summary.csv (one row per run), OUT/points.csv
(mean ± std per setting), OUT/outer_optimizers.json (the comparisons) and
OUT/outer_optimizers.png. Interrupted runs resume; finished ones are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.stats import describe, paired, verdict
from experiments.sweep import run_jobs, status, study_args, study_parser
from experiments.variants import write_csv

MODEL = ["--layers", "2", "--width", "64", "--heads", "4", "--seq-len", "64", "--global-batch", "8"]
FULL = {"K": [1, 2, 4], "lr": [0.3, 0.5, 0.7, 1.0], "momentum": [0.0, 0.8, 0.9], "adam_lr": [0.03, 0.1],
        "seeds": [0, 1, 2], "steps": 300}
QUICK = {"K": [1, 2], "lr": [1.0], "momentum": [0.0, 0.9], "adam_lr": [0.1], "seeds": [0], "steps": 30}


def jobs(grid: dict) -> list[tuple[str, dict, list[str]]]:
    """(name, knobs, flags) of every run: Nesterov grid and Adam per K, DDP once per seed."""
    steps = grid["steps"]
    base = [*MODEL, "--no-streaming", "--sync-period", "30", "--steps", str(steps), "--eval-every",
            str(steps), "--checkpoint-every", str(steps), "--eval-batches", "16"]
    out = []
    for seed in grid["seeds"]:
        out.append((f"ddp,seed={seed}", {"method": "ddp", "K": 1, "outer_lr": "", "outer_momentum": "", "seed": seed},
                    [*base, "--mode", "ddp", "--num-replicas", "1", "--seed", str(seed)]))
        for k in grid["K"]:
            settings = [("nesterov", lr, m) for lr in grid["lr"] for m in grid["momentum"]]
            settings += [("adam", lr, 0.9) for lr in grid["adam_lr"]]
            for opt, lr, m in settings:
                knobs = {"method": opt, "K": k, "outer_lr": lr, "outer_momentum": m, "seed": seed}
                out.append((f"K={k},{opt},lr={lr},mom={m},seed={seed}", knobs,
                            [*base, "--num-replicas", str(k), "--outer-optimizer", opt, "--outer-lr", str(lr),
                             "--outer-momentum", str(m), "--seed", str(seed)]))
    return out


def summarize(out: Path, runs: list[tuple[str, dict, list[str]]]) -> list[dict]:
    rows = []
    for name, knobs, _ in runs:
        if status(out / name) != "finished":
            continue
        summary = json.loads((out / name / "run.json").read_text())["summary"]
        rows.append({**knobs, "eval_loss": summary["eval_loss"], "tokens": summary["tokens"],
                     "comm_bytes_per_island": summary["comm_bytes_per_island"],
                     "wall_time": round(summary["wall_time"], 1), "run": name})
    write_csv(out / "summary.csv", rows)
    return rows


def setting(r: dict) -> tuple:
    return (r["method"], r["K"], r["outer_lr"], r["outer_momentum"])


def analyse(rows: list[dict]) -> dict:
    """Per-setting seed statistics and the paired comparisons behind each claim."""
    by: dict[tuple, dict[int, float]] = {}
    for r in rows:
        by.setdefault(setting(r), {})[int(r["seed"])] = float(r["eval_loss"])
    points = [{"method": s[0], "K": s[1], "outer_lr": s[2], "outer_momentum": s[3], **describe(list(v.values()))}
              for s, v in by.items()]
    ddp = next((v for s, v in by.items() if s[0] == "ddp"), None)
    result: dict = {"points": points, "best": {}, "comparisons": []}

    def compare(claim: str, a: tuple, b: tuple) -> None:
        p = paired(by[a], by[b])
        result["comparisons"].append({"claim": claim, "a": list(a), "b": list(b), **p, "verdict": verdict(p)})

    for k in sorted({s[1] for s in by if s[0] != "ddp"}):
        best = {m: min((s for s in by if s[0] == m and s[1] == k), key=lambda s: describe(list(by[s].values()))["mean"],
                       default=None) for m in ("nesterov", "adam")}
        result["best"][str(k)] = {m: list(s) for m, s in best.items() if s}
        nest = best["nesterov"]
        if ddp is not None and k == 1 and nest:
            compare("K=1 DiLoCo (best η, β) below Data-Parallel", nest, ("ddp", 1, "", ""))
        if nest and ("nesterov", k, 1.0, 0.0) in by and nest != ("nesterov", k, 1.0, 0.0):
            compare(f"K={k}: best Nesterov below plain averaging", nest, ("nesterov", k, 1.0, 0.0))
        if nest and best["adam"]:
            compare(f"K={k}: best outer Adam below best Nesterov", best["adam"], nest)
    return result


def plot(rows: list[dict], result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({p["K"] for p in result["points"] if p["method"] != "ddp"})
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.6), sharey=True, squeeze=False)
    ddp = [p for p in result["points"] if p["method"] == "ddp"]
    for ax, k in zip(axes[0], ks):
        for m in sorted({p["outer_momentum"] for p in result["points"] if p["method"] == "nesterov" and p["K"] == k}):
            pts = sorted((p for p in result["points"] if p["method"] == "nesterov" and p["K"] == k
                          and p["outer_momentum"] == m), key=lambda p: p["outer_lr"])
            x = [p["outer_lr"] for p in pts]
            mean = [p["mean"] for p in pts]
            (line,) = ax.plot(x, mean, marker="o", label=f"Nesterov β={m:g}")
            ax.fill_between(x, [p["mean"] - p["std"] for p in pts], [p["mean"] + p["std"] for p in pts],
                            color=line.get_color(), alpha=0.15)
        for p in (p for p in result["points"] if p["method"] == "adam" and p["K"] == k):
            ax.errorbar([p["outer_lr"]], [p["mean"]], yerr=[p["std"]], fmt="s", color="k", ms=4,
                        label=f"Adam η={p['outer_lr']:g}")
        if ddp:
            ax.axhline(ddp[0]["mean"], color="gray", ls="--", lw=1, label="Data-Parallel")
        ax.set_title(f"K = {k}", fontsize=9)
        ax.set_xlabel("outer learning rate η")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final held-out loss (nats/byte)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    return study_parser("python -m experiments.outer_optimizers", __doc__, "runs/outer_optimizers",
                        "7 short runs, to check the pipeline")


def main(argv: list[str] | None = None) -> int:
    args = study_args(build_parser(), argv)
    out, grid = args.out, QUICK if args.quick else FULL
    runs = jobs(grid)
    failed = run_jobs(out, [(name, flags) for name, _, flags in runs], args.parallel)
    rows = summarize(out, runs)
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    result = analyse(rows)
    write_csv(out / "points.csv", result["points"])
    (out / "outer_optimizers.json").write_text(json.dumps(result, indent=1))
    title = (f"vanilla DiLoCo H=30, 2L×64 byte LM, {grid['steps']} steps × 8 × 64 bytes; "
             f"{len(grid['seeds'])} seed(s): line = mean, band = ± std")
    plot(rows, result, out / "outer_optimizers.png", title)
    for c in result["comparisons"]:
        print(f"{c['claim']}: {c['diff_pct']:+.2f}% [{c['lo_pct']:+.2f}, {c['hi_pct']:+.2f}] (n={c['n']}) "
              f"-> {c['verdict']}")
    print(f"wrote {out / 'outer_optimizers.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
