"""Plot training and held-out loss of one or more runs against steps and tokens.

    python -m tools.plot_runs runs/ddp runs/diloco runs/streaming --out compare.png

Each run is one colour: the mean training loss as a line, each island as a thin line, and
held-out evaluations (of the outer model) as markers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_run(run_dir: Path) -> tuple[str, list[dict], list[dict]]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise ValueError(f"{run_dir} has no metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    label = run_dir.name
    meta = run_dir / "run.json"
    if meta.exists():
        s = json.loads(meta.read_text()).get("settings", {})
        if s.get("mode") == "ddp":
            label = f"{run_dir.name} (DDP)"
        elif s:
            kind = f"Streaming P={s['num_fragments']}" if s.get("streaming") else "DiLoCo"
            label = f"{run_dir.name} ({kind}, H={s['sync_period']})"
    return label, [r for r in rows if not r.get("eval")], [r for r in rows if r.get("eval")]


def plot_runs(run_dirs, out_path, smooth: int = 10) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for i, run_dir in enumerate(map(Path, run_dirs)):
        label, steps, evals = load_run(run_dir)
        color = f"C{i}"
        for ax, x_key in zip(axes, ("step", "tokens")):
            if not steps:
                continue
            x = [r[x_key] for r in steps]
            islands = sorted(k for k in steps[0] if k.startswith("loss_island_"))
            for k in islands:
                ax.plot(x, _smooth([r[k] for r in steps], smooth), color=color, lw=0.4, alpha=0.5)
            ax.plot(x, _smooth([r["loss"] for r in steps], smooth), color=color, lw=1.5,
                    label=f"{label} train")
            if evals and "eval_loss" in evals[0]:
                ex = [r["step"] if x_key == "step" else r["step"] * steps[0]["tokens"] // steps[0]["step"]
                      for r in evals]
                ax.plot(ex, [r["eval_loss"] for r in evals], "o--", color=color, ms=4,
                        label=f"{label} held-out")
    for ax, xlabel in zip(axes, ("step", "tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"loss vs steps (train smoothed over {smooth}; islands thin)")
    axes[1].set_title("loss vs tokens")
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def _smooth(values, n):
    if n <= 1:
        return values
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl)")
    parser.add_argument("--out", default="loss.png", help="PNG to write")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window (steps)")
    args = parser.parse_args(argv)
    try:
        print(plot_runs(args.runs, args.out, args.smooth))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
