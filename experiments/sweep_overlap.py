"""The overlap ablation: Streaming DiLoCo with V in {0,1,2,5,10} x α in {0,0.5,1}, 2 seeds each.

    python -m experiments.sweep_overlap --out runs/overlap            # 30 runs
    python -m experiments.sweep_overlap --out runs/overlap --quick    # 4 runs
    python -m experiments.sweep_overlap --out runs/overlap --parallel 2

Plot (OUT/overlap.png): final held-out loss against V, one line per α, as the change in %
relative to the same α at V=0 (seed mean), with every seed as a dot and the seed range as
a band. OUT/summary.csv has every run; OUT/overlap.json the per-point means and spreads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from experiments.stats import describe, paired
from experiments.sweep import run_sweep

MODEL = ["--layers", "2", "--width", "64", "--heads", "4", "--seq-len", "64", "--global-batch", "8"]
SETTING = ["--streaming", "--num-replicas", "2", "--sync-period", "30", "--num-fragments", "3"]


def grid_and_base(quick: bool) -> tuple[dict, list[str]]:
    if quick:
        grid = {"overlap_steps": [0, 5], "alpha": [0.0, 1.0], "seed": [0]}
        steps = 40
    else:
        grid = {"overlap_steps": [0, 1, 2, 5, 10], "alpha": [0.0, 0.5, 1.0], "seed": [0, 1]}
        steps = 600
    base = [*MODEL, *SETTING, "--steps", str(steps), "--eval-every", str(steps),
            "--checkpoint-every", str(steps), "--eval-batches", "16"]
    return grid, base


def analyse(rows: list[dict]) -> dict:
    """Per (α, V): seed mean and range of the final loss, the change vs V=0 in %, and the
    seed-paired difference to V=0 at the same α with its 95% t-interval."""
    by: dict[tuple[float, int], dict[int, float]] = {}
    for r in rows:  # a grid without a seed axis: its runs count as seeds 0, 1, ... in order
        point = by.setdefault((float(r["alpha"]), int(r["overlap_steps"])), {})
        point[int(r["seed"]) if "seed" in r else len(point)] = float(r["eval_loss"])
    out = {}
    for (a, v), per_seed in sorted(by.items()):
        losses = [per_seed[s] for s in sorted(per_seed)]
        ref = np.mean(list(by[(a, 0)].values())) if (a, 0) in by else np.nan
        out[f"alpha={a},V={v}"] = {
            "alpha": a, "V": v, "losses": losses, **describe(losses),
            "min": float(np.min(losses)), "max": float(np.max(losses)),
            "change_pct": float(100 * (np.mean(losses) / ref - 1)),
        }
        if v and (a, 0) in by:
            p = paired(per_seed, by[(a, 0)])
            out[f"alpha={a},V={v}"]["vs_V0"] = {k: p[k] for k in ("diff_pct", "lo_pct", "hi_pct", "n")}
    # seed noise: the spread between seeds of the same point, over all points
    spreads = [p["max"] - p["min"] for p in out.values() if len(p["losses"]) > 1]
    ref_losses = [p["mean"] for p in out.values() if p["V"] == 0]
    noise = 100 * float(np.max(spreads) / np.mean(ref_losses)) if spreads else None
    return {"points": out, "max_seed_spread_pct": noise}


def spread_line(spread_pct: float | None) -> str:
    if spread_pct is None:
        return "largest seed spread: none (one seed per point; add seeds to measure the noise)"
    return f"largest seed spread: {spread_pct:.2f}% of the loss"


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for a in sorted({p["alpha"] for p in pts.values()}):
        row = sorted((p for p in pts.values() if p["alpha"] == a), key=lambda p: p["V"])
        ref = next(p["mean"] for p in row if p["V"] == 0)
        vs = [p["V"] for p in row]
        (line,) = ax.plot(vs, [p["change_pct"] for p in row], marker="o", label=f"α = {a:g}")
        ax.fill_between(vs, [100 * (p["min"] / ref - 1) for p in row],
                        [100 * (p["max"] / ref - 1) for p in row], color=line.get_color(), alpha=0.15)
        for p in row:
            ax.scatter([p["V"]] * len(p["losses"]), [100 * (x / ref - 1) for x in p["losses"]],
                       s=10, color=line.get_color(), alpha=0.6)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("overlap V (steps between a fragment's sync and its apply)")
    ax.set_ylabel("final held-out loss vs V=0 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.sweep_overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/overlap")
    p.add_argument("--quick", action="store_true", help="4 short runs, to check the pipeline")
    p.add_argument("--parallel", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    grid, base = grid_and_base(args.quick)
    try:
        rows = run_sweep(out, grid, base, args.parallel)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = analyse(rows)
    steps = int(base[base.index("--steps") + 1])
    tokens = rows[0]["tokens"] if rows else 0
    title = (f"Streaming DiLoCo K=2, H=30, P=3, {steps} steps ({tokens:,} tokens),\n2L×64 byte LM "
             f"on the stdlib corpus; {len(grid['seed'])} seed(s) per point (dots), band = seed range")
    result.update(setting=title, revision=_revision())
    (out / "overlap.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "overlap.png", title)
    for name, pt in result["points"].items():
        vs = pt.get("vs_V0")
        paired_text = f", paired {vs['diff_pct']:+.2f}% [{vs['lo_pct']:+.2f}, {vs['hi_pct']:+.2f}]" if vs else ""
        print(f"{name:>16}: {pt['mean']:.4f} ({pt['change_pct']:+.2f}% vs V=0{paired_text}; seeds {pt['losses']})")
    print(f"{spread_line(result['max_seed_spread_pct'])}; wrote {out / 'overlap.png'}")
    return 0


def _revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
