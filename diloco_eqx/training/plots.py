"""Plots of training and held-out loss of one or more runs against steps and tokens
(`python -m tools.plot_runs` is the command line).

Each run is one colour: the mean training loss as a line, each island as a thin line,
held-out evaluations (of the outer model) as markers, and its syncs as ticks along the
bottom. The loss axis is logarithmic, so the first steep drop does not squash the rest, and
its ticks read as plain numbers (2, 3, 4).
Runs are labelled by the settings that differ between them. Without --out, one run's plot
goes to RUN/loss.png and several runs' to compare.png in their common parent directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

from diloco_eqx.training.config import RESUMABLE

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import Formatter  # noqa: E402

IGNORED = set(RESUMABLE)
"""Settings that do not change what a run computes: never used as labels."""


def read_settings(run_dir: Path) -> dict:
    meta = run_dir / "run.json"
    return json.loads(meta.read_text()).get("settings", {}) if meta.exists() else {}


def load_run(run_dir: Path) -> tuple[str, list[dict], list[dict]]:
    """(label, step rows, evaluation rows) of one run; the label is its directory and method."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise ValueError(f"{run_dir} has no metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    kind = _kind(read_settings(run_dir))
    label = f"{run_dir.name} ({kind})" if kind else run_dir.name
    return label, [r for r in rows if not r.get("eval")], [r for r in rows if r.get("eval")]


def _kind(s: dict) -> str:
    if not s:
        return ""
    if s.get("mode") == "ddp":
        return "DDP"
    if s.get("streaming"):
        return f"Streaming P={s['num_fragments']}, H={s['sync_period']}"
    return f"DiLoCo H={s['sync_period']}"


def labels(run_dirs: list[Path], settings: list[dict]) -> list[str]:
    """One label per run: the settings whose values differ between the runs (one run: its
    method), falling back to directory names where the settings do not tell runs apart."""
    keys = sorted({k for s in settings for k in s} - IGNORED)
    differ = [k for k in keys if len({json.dumps(s.get(k)) for s in settings}) > 1]
    if len(run_dirs) == 1 or not differ:
        return [load_run(d)[0] for d in run_dirs]
    out = [", ".join(f"{k}={s.get(k)}" for k in differ) for s in settings]
    if len(set(out)) < len(out):
        out = [f"{d.name}: {label}" for d, label in zip(run_dirs, out)]
    return out


class PlainNumbers(Formatter):
    """Tick labels as plain numbers (2, 3, 0.5) on the ticks `labelled` labels (a log axis's
    own formatter, which writes 2×10⁰ and picks which ticks carry a label)."""

    def __init__(self, labelled: Formatter):
        self.labelled = labelled

    def set_axis(self, axis):
        super().set_axis(axis)
        self.labelled.set_axis(axis)

    def set_locs(self, locs):
        super().set_locs(locs)
        self.labelled.set_locs(locs)

    def __call__(self, x, pos=None) -> str:
        return f"{x:g}" if self.labelled(x, pos) else ""


def plot_runs(run_dirs, out_path, smooth: int = 10) -> Path:
    """Draw the runs' losses (see the module's docstring) into the PNG `out_path`."""
    fig = loss_figure(run_dirs, smooth)
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def loss_figure(run_dirs, smooth: int = 10) -> Figure:
    """The figure `plot_runs` saves: loss against steps and against tokens."""
    run_dirs = [Path(d) for d in run_dirs]
    runs = [load_run(d) for d in run_dirs]
    names = labels(run_dirs, [read_settings(d) for d in run_dirs])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for i, ((_, steps, evals), label) in enumerate(zip(runs, names)):
        if steps:
            _draw_run(axes, f"C{i}", label, steps, evals, smooth)
    for ax, xlabel in zip(axes, ("step", "tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/token, log scale)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PlainNumbers(ax.yaxis.get_major_formatter()))
        ax.yaxis.set_minor_formatter(PlainNumbers(ax.yaxis.get_minor_formatter()))
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"loss vs steps (train smoothed over {smooth}; islands thin; syncs ticked)")
    axes[1].set_title("loss vs tokens")
    return fig


def _draw_run(axes, color: str, label: str, steps: list[dict], evals: list[dict], smooth: int) -> None:
    tokens_per_step = steps[0]["tokens"] / steps[0]["step"]
    islands = sorted(k for k in steps[0] if k.startswith("loss_island_"))
    syncs = [r["step"] for r in steps if "sync_fragment" in r]
    for ax, x_key in zip(axes, ("step", "tokens")):
        x = [r[x_key] for r in steps]
        for k in islands:
            ax.plot(x, _smooth([r[k] for r in steps], smooth), color=color, lw=0.4, alpha=0.5)
        ax.plot(x, _smooth([r["loss"] for r in steps], smooth), color=color, lw=1.5, label=f"{label} train")
        if evals and "eval_loss" in evals[0]:
            ex = [r["step"] * (1 if x_key == "step" else tokens_per_step) for r in evals]
            ax.plot(ex, [r["eval_loss"] for r in evals], "o--", color=color, ms=4, label=f"{label} held-out")
        if syncs:
            sx = [t * (1 if x_key == "step" else tokens_per_step) for t in syncs]
            ax.vlines(sx, 0, 0.025, transform=ax.get_xaxis_transform(), color=color, lw=0.6)


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


def default_out(run_dirs: list[Path]) -> Path:
    """RUN/loss.png for one run; compare.png in the runs' common parent for several."""
    if len(run_dirs) == 1:
        return run_dirs[0] / "loss.png"
    return Path(os.path.commonpath([d.resolve().parent for d in run_dirs])) / "compare.png"
