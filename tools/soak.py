"""Soak: a long run of a tiny model, watched from outside for anything that grows.

    python -m tools.soak                                   # 5,000 steps, writes benchmarks/soak_cpu.json
    python -m tools.soak --steps 20000 --json soak.json --out runs/soak

Runs the training CLI (`python -m experiments.train`, a 2-layer width-32 transformer on the
markov corpus) as a child process, checkpointing every 50 steps and evaluating every 250,
and samples the child every ~0.25 s: resident memory (VmRSS), open file descriptors,
threads, and the checkpoints on disk (finished step directories and in-flight temporary
ones), each sample tagged with the last step in metrics.jsonl. From those and the per-step
`step_time` of metrics.jsonl it reports:

- RSS slope: MB per 1,000 steps, least squares over the second half of the run (compilation
  and warm-up excluded), and the last quarter's median RSS minus the first quarter's;
- step-time slope: ms per 1,000 steps, least squares over the medians of 100-step bins
  (steps after the first 50), also as a percentage of the median step time;
- the most file descriptors and threads seen in the first and in the last quarter;
- the most checkpoints on disk between saves (the run's Checkpointer keeps 2) and during one.

Samples taken once the last step is written (final evaluation and checkpoint, loss.png)
are left out of the RSS, fd and thread figures. The figures go to --json, with every sample;
a plot of RSS and step time against the step goes next to it (.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ["--corpus", "markov", "num_bytes=200000", "doc_bytes=20000", "--layers", "2",
              "--width", "32", "--heads", "2", "--seq-len", "32", "--global-batch", "4",
              "--no-progress"]
TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a checkpoint still being written
WARMUP_STEPS = 50  # steps left out of the step-time fit (compilation, first checkpoint)
BIN_STEPS = 100  # steps per bin of the step-time medians
COLUMNS = ("time_s", "step", "rss_mb", "fds", "threads", "checkpoints", "tmp_checkpoints")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One look at the child process and its checkpoint directory."""

    time_s: float
    step: int
    rss_mb: float
    fds: int
    threads: int
    checkpoints: int
    tmp_checkpoints: int


# ---------------------------------------------------------------- analysis (pure functions)


def least_squares_slope(x: Any, y: Any) -> float:
    """Slope of the least-squares line through (x, y); nan with fewer than 2 distinct x."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size < 2 or np.ptp(x) == 0:
        return float("nan")
    dx = x - x.mean()
    return float(np.dot(dx, y - y.mean()) / np.dot(dx, dx))


def bin_medians(steps: Any, values: Any, width: int = BIN_STEPS,
                min_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, median value) of `values` grouped by `steps` into bins
    [k·width, (k+1)·width), leaving out bins of fewer than `min_count` values."""
    steps, values = np.asarray(steps, float), np.asarray(values, float)
    keys = np.floor(steps / width).astype(int)
    bins, counts = np.unique(keys, return_counts=True)
    bins = bins[counts >= min_count]
    medians = np.array([np.median(values[keys == k]) for k in bins])
    return (bins + 0.5) * width, medians


def quarter_mask(steps: np.ndarray, total: int, which: str) -> np.ndarray:
    """Samples in the first (steps 1..total/4) or last (steps above 3·total/4, below `total`)
    quarter; samples at `total` are the run's epilogue (final evaluation, checkpoint, plot)."""
    if which == "first":
        return (steps > 0) & (steps <= total / 4)
    if which == "last":
        return (steps > 3 * total / 4) & (steps < total)
    raise ValueError(f"which must be 'first' or 'last'; got {which!r}")


def rss_figures(samples: list[Sample], total: int) -> dict[str, float]:
    """RSS slope over the second half (the epilogue at step `total` left out), and the
    last-minus-first-quarter median, in MB."""
    steps = np.array([s.step for s in samples], float)
    rss = np.array([s.rss_mb for s in samples], float)
    late = (steps > total / 2) & (steps < total)
    first, last = rss[quarter_mask(steps, total, "first")], rss[quarter_mask(steps, total, "last")]
    return {
        "rss_slope_mb_per_1k_steps": 1000 * least_squares_slope(steps[late], rss[late]),
        "rss_first_quarter_median_mb": float(np.median(first)) if first.size else float("nan"),
        "rss_last_quarter_median_mb": float(np.median(last)) if last.size else float("nan"),
        "rss_quarter_median_diff_mb": (float(np.median(last) - np.median(first))
                                       if first.size and last.size else float("nan")),
        "rss_peak_mb": float(rss.max()) if rss.size else float("nan"),
    }


def step_time_figures(steps: Any, step_times: Any, warmup: int = WARMUP_STEPS,
                      width: int = BIN_STEPS) -> dict[str, float]:
    """Median step time and the slope of the per-bin medians (steps after `warmup`; bins
    under a quarter full left out), in ms."""
    steps, ms = np.asarray(steps, float), 1000 * np.asarray(step_times, float)
    keep = steps > warmup
    centres, medians = bin_medians(steps[keep], ms[keep], width, min_count=max(1, width // 4))
    median = float(np.median(ms[keep]))
    slope = 1000 * least_squares_slope(centres, medians)
    return {"step_time_median_ms": median, "step_time_slope_ms_per_1k_steps": slope,
            "step_time_slope_pct_of_median_per_1k_steps": 100 * slope / median}


def count_figures(samples: list[Sample], total: int, checkpoint_every: int) -> dict[str, int]:
    """Most fds and threads in the first and last quarters; most checkpoints on disk, at
    any time and between saves (a sample tagged with a step that is not a checkpoint step
    comes after the previous save, old checkpoints removed, and before the next)."""
    steps = np.array([s.step for s in samples], float)
    out: dict[str, int] = {}
    for field in ("fds", "threads"):
        values = np.array([getattr(s, field) for s in samples])
        for which in ("first", "last"):
            chosen = values[quarter_mask(steps, total, which)]
            out[f"{field}_max_{which}_quarter"] = int(chosen.max()) if chosen.size else -1
    between = [s for s in samples if 0 < s.step < total and s.step % checkpoint_every]
    out["checkpoints_max"] = max((s.checkpoints for s in samples), default=0)
    out["tmp_checkpoints_max"] = max((s.tmp_checkpoints for s in samples), default=0)
    out["checkpoints_plus_tmp_max"] = max((s.checkpoints + s.tmp_checkpoints for s in samples), default=0)
    out["checkpoints_max_between_saves"] = max((s.checkpoints + s.tmp_checkpoints for s in between), default=0)
    return out


def analyse(samples: list[Sample], rows: list[dict[str, Any]], total: int,
            checkpoint_every: int) -> dict[str, Any]:
    """Every figure of the soak from the samples and metrics.jsonl's per-step rows."""
    step_rows = [r for r in rows if not r.get("eval") and "step_time" in r]
    figures = step_time_figures([r["step"] for r in step_rows], [r["step_time"] for r in step_rows])
    return {**rss_figures(samples, total), **figures, **count_figures(samples, total, checkpoint_every),
            "samples": len(samples), "last_step": max((r["step"] for r in step_rows), default=0)}


# ---------------------------------------------------------------- watching the child


class MetricsTail:
    """The last step written to a growing metrics.jsonl, reading only the bytes added since
    the previous call."""

    def __init__(self, path: Path):
        self.path, self.step = path, 0
        self._offset, self._partial = 0, b""

    def last_step(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.step
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished line waits for the next call
        for line in reversed(lines):
            if line.strip():
                self.step = int(json.loads(line)["step"])
                break
        return self.step


def checkpoint_counts(directory: Path) -> tuple[int, int]:
    """(finished step directories, temporary in-flight ones) under `directory`."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0, 0
    return sum(n.isdigit() for n in names), sum(TMP_MARK in n for n in names)


def read_process(pid: int) -> tuple[float, int, int] | None:
    """(VmRSS in MB, open fds, threads) of process `pid`; None once it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    rss = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), None)
    if rss is None:  # a zombie: no memory left to report
        return None
    return int(rss) / 1024, fds, threads


def watch(proc: subprocess.Popen, out: Path, interval: float, timeout: float) -> list[Sample]:
    """Sample `proc` every `interval` seconds until it exits; kill it after `timeout`."""
    tail, samples, t0 = MetricsTail(out / "metrics.jsonl"), [], time.perf_counter()
    while proc.poll() is None:
        now = time.perf_counter() - t0
        if now > timeout:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"the training run took over {timeout:.0f} s; killed it")
        seen = read_process(proc.pid)
        if seen is not None:
            ckpts, tmps = checkpoint_counts(out / "checkpoints")
            rss, fds, threads = seen
            samples.append(Sample(round(now, 3), tail.last_step(), round(rss, 2), fds, threads,
                                  ckpts, tmps))
        time.sleep(interval)
    return samples


def train_command(steps: int, checkpoint_every: int, eval_every: int, out: Path) -> list[str]:
    """The training CLI's command line for the soak's run."""
    return [sys.executable, "-m", "experiments.train", *TINY_MODEL, "--steps", str(steps),
            "--checkpoint-every", str(checkpoint_every), "--eval-every", str(eval_every),
            "--out", str(out)]


def run_soak(steps: int, checkpoint_every: int, eval_every: int, out: Path, interval: float = 0.25,
             timeout: float = 3600, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run and watch one training job into `out`: exit code, run.json status, wall time,
    samples, metrics rows and the end of the child's output."""
    cmd = train_command(steps, checkpoint_every, eval_every, out)
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            samples = watch(proc, out, interval, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.perf_counter() - t0
        log.seek(0)
        log_tail = log.read()[-4000:]
    meta_path, metrics_path = out / "run.json", out / "metrics.jsonl"
    status = json.loads(meta_path.read_text()).get("status") if meta_path.exists() else None
    rows = ([json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
            if metrics_path.exists() else [])
    return {"returncode": proc.returncode, "status": status, "wall_time_s": wall,
            "samples": samples, "rows": rows, "log_tail": log_tail, "command": cmd,
            "xla_flags": (os.environ if env is None else env).get("XLA_FLAGS", "")}


# ---------------------------------------------------------------- report


def report(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON written by the tool: settings, versions, wall time, figures and timeline."""
    import jax

    return {
        "settings": {"steps": args.steps, "checkpoint_every": args.checkpoint_every,
                     "eval_every": args.eval_every, "checkpoints_kept": 2,
                     "sample_interval_s": args.interval, "model_flags": " ".join(TINY_MODEL)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "xla_flags": run["xla_flags"]},
        "returncode": run["returncode"], "status": run["status"],
        "wall_time_s": round(run["wall_time_s"], 2),
        "figures": run["figures"],
        "timeline_columns": list(COLUMNS),
        "timeline": [list(dataclasses.astuple(s)) for s in run["samples"]],
    }


def to_json(result: dict[str, Any]) -> str:
    """`result` as indented JSON, with one line per timeline sample."""
    rows = ",\n".join("  " + json.dumps(row) for row in result["timeline"])
    text = json.dumps({**result, "timeline": "@timeline@"}, indent=1)
    return text.replace('"@timeline@"', "[\n" + rows + "\n ]") + "\n"


def format_table(result: dict[str, Any]) -> str:
    """A short text summary of the figures."""
    f, s = result["figures"], result["settings"]
    lines = [
        f"soak: {s['steps']} steps, checkpoint every {s['checkpoint_every']}, eval every "
        f"{s['eval_every']}; {result['wall_time_s']:.0f} s wall, status {result['status']}, "
        f"{f['samples']} samples",
        f"{'RSS slope (2nd half)':<34}{f['rss_slope_mb_per_1k_steps']:>+10.3f} MB / 1k steps",
        f"{'RSS median, last - first quarter':<34}{f['rss_quarter_median_diff_mb']:>+10.3f} MB "
        f"({f['rss_first_quarter_median_mb']:.1f} -> {f['rss_last_quarter_median_mb']:.1f}; "
        f"peak {f['rss_peak_mb']:.1f})",
        f"{'step time, median':<34}{f['step_time_median_ms']:>10.3f} ms",
        f"{'step time slope (100-step medians)':<34}{f['step_time_slope_ms_per_1k_steps']:>+10.4f} "
        f"ms / 1k steps ({f['step_time_slope_pct_of_median_per_1k_steps']:+.2f}% of median)",
        f"{'fds, max first / last quarter':<34}{f['fds_max_first_quarter']:>5} / {f['fds_max_last_quarter']}",
        f"{'threads, max first / last quarter':<34}{f['threads_max_first_quarter']:>5} / "
        f"{f['threads_max_last_quarter']}",
        f"{'checkpoints on disk, between saves':<34}{f['checkpoints_max_between_saves']:>5} at most",
        f"{'checkpoints on disk, during a save':<34}{f['checkpoints_plus_tmp_max']:>5} at most "
        f"({f['checkpoints_max']} finished, {f['tmp_checkpoints_max']} temporary)",
    ]
    return "\n".join(lines)


def _plot_rss(ax: Any, samples: list[Sample], total: int) -> None:
    """RSS of the samples taken while training (past the first steps, before the epilogue),
    with the least-squares line of the second half."""
    steps = np.array([s.step for s in samples], float)
    rss = np.array([s.rss_mb for s in samples], float)
    shown = (steps > WARMUP_STEPS) & (steps < total)
    ax.plot(steps[shown], rss[shown], ".", ms=3, label="samples")
    late = (steps > total / 2) & (steps < total)
    if late.sum() >= 2 and np.ptp(steps[late]) > 0:
        slope, intercept = np.polyfit(steps[late], rss[late], 1)
        ends = np.array([total / 2, total])
        ax.plot(ends, intercept + slope * ends, "-", label=f"second half: {1000 * slope:+.2f} MB / 1k steps")
    ax.set_ylabel("RSS (MB)")
    ax.legend(loc="lower right")


def _plot_step_times(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Every step's time, and the medians of 100-step bins."""
    rows = [r for r in rows if not r.get("eval") and "step_time" in r]
    steps = np.array([r["step"] for r in rows], float)
    ms = 1000 * np.array([r["step_time"] for r in rows], float)
    ax.plot(steps, ms, ",", alpha=0.4, label="per step")
    keep = steps > WARMUP_STEPS
    centres, medians = bin_medians(steps[keep], ms[keep], min_count=BIN_STEPS // 4)
    ax.plot(centres, medians, "-o", ms=3, label=f"{BIN_STEPS}-step medians")
    if medians.size:
        ax.set_ylim(0, 3 * float(np.max(medians)))
    ax.set_ylabel("step time (ms)")
    ax.legend(loc="upper right")


def plot(run: dict[str, Any], total: int, path: Path) -> None:
    """RSS and step time against the step, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    _plot_rss(top, run["samples"], total)
    _plot_step_times(bottom, run["rows"])
    bottom.set_xlabel("step")
    top.set_title(f"soak: {total} steps (RSS sampled during steps {WARMUP_STEPS + 1}..{total - 1})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5000, help="training steps (default: 5000)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    p.add_argument("--eval-every", type=int, default=250, help="steps between evaluations (default: 250)")
    p.add_argument("--out", type=Path, default=None,
                   help="run directory, which must not exist or be empty (default: a temporary "
                        "directory, removed afterwards)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "soak_cpu.json",
                   help="write the figures here (default: benchmarks/soak_cpu.json)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG next to the JSON")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between samples (default: 0.25)")
    p.add_argument("--timeout", type=float, default=3600, help="kill the run after this many seconds")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked; a bad value is a usage error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 4 * BIN_STEPS:
        parser.error(f"--steps must be at least {4 * BIN_STEPS} (quarters of whole bins); got {args.steps}")
    if args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every must be >= 1; got {args.checkpoint_every}")
    if args.eval_every < 0:
        parser.error(f"--eval-every must be >= 0 (0: only at the end); got {args.eval_every}")
    if not 0 < args.interval <= 10:
        parser.error(f"--interval must be in (0, 10] seconds; got {args.interval}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds; got {args.timeout}")
    if args.out is not None and args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out} already exists and is not an empty directory")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 when the run finished, 1 when it did not."""
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="soak-")) / "run"
    try:
        run = run_soak(args.steps, args.checkpoint_every, args.eval_every, out.absolute(),
                       args.interval, args.timeout)
    finally:
        if args.out is None:
            shutil.rmtree(out.parent, ignore_errors=True)
    if run["returncode"] != 0 or run["status"] != "finished":
        print(f"the training run failed (exit {run['returncode']}, status {run['status']}):\n"
              f"{run['log_tail']}", file=sys.stderr)
        return 1
    run["figures"] = analyse(run["samples"], run["rows"], args.steps, args.checkpoint_every)
    result = report(run, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(to_json(result))
    print(format_table(result))
    print(f"wrote {args.json}")
    if not args.no_plot:
        plot(run, args.steps, args.json.with_suffix(".png"))
        print(f"wrote {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
