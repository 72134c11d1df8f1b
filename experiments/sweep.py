"""Run a grid of training jobs, skip the finished ones, and tabulate the final held-out loss.

    python -m experiments.sweep --out runs/sweep --grid overlap_steps=0,1,2,5 alpha=0,0.5 seed=0,1 \\
        -- --steps 300 --streaming --num-fragments 3
    python -m experiments.sweep --out runs/sweep --grid ... --parallel 2 -- ...   # 2 jobs at a time

Every grid point is one `python -m experiments.train` process with the base flags (after
`--`) plus the point's knobs (`name=value` -> `--name value`; true/false for on/off flags),
writing into OUT/<point>. A point whose run.json says "finished" is skipped; one that was
interrupted resumes from its last checkpoint. OUT/summary.csv and OUT/summary.jsonl hold
one row per point: its knobs, final held-out loss, tokens, bytes sent per island (with a
sparse codec, the indices' share beside them) and wall time.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """["alpha=0,0.5", "seed=0,1"] -> {"alpha": ["0", "0.5"], "seed": ["0", "1"]}."""
    grid: dict[str, list[str]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"--grid items are name=v1,v2,...; got {item!r}")
        grid[name.replace("-", "_")] = values.split(",")
    return grid


def points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination, in the grid's order (the last knob varies fastest)."""
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def point_name(point: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in point.items())


def point_flags(point: Mapping[str, Any]) -> list[str]:
    flags = []
    for name, value in point.items():
        flag = "--" + name.replace("_", "-")
        text = str(value).lower()
        if text in ("true", "false"):
            flags.append(flag if text == "true" else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def study_parser(prog: str, doc: str | None, default_out: str, quick_help: str) -> argparse.ArgumentParser:
    """--out, --quick and --parallel of a study script."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=default_out)
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    return p


def study_args(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of a study script (`p` from study_parser); also points JAX's compilation
    cache at OUT/jax_cache, since a study's runs share most of their programs."""
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1; got {args.parallel}")
    args.out = Path(args.out)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(args.out.resolve() / "jax_cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return args


def status(run_dir: Path) -> str:
    """"finished", "started" (a run.json or checkpoint exists) or "new"."""
    meta = run_dir / "run.json"
    if meta.exists():
        try:
            return "finished" if json.loads(meta.read_text()).get("status") == "finished" else "started"
        except json.JSONDecodeError:
            return "started"
    return "started" if (run_dir / "checkpoints").exists() else "new"


def run_sweep(
    out: str | os.PathLike,
    grid: Mapping[str, Sequence[Any]],
    base: Sequence[str] = (),
    parallel: int = 1,
    log=sys.stderr,
) -> list[dict[str, Any]]:
    """Run every grid point not yet finished (N at a time); returns the summary rows."""
    jobs = [(point_name(p), [*base, *point_flags(p)]) for p in points(grid)]
    failed = run_jobs(out, jobs, parallel, log)
    rows = summarize(Path(out), grid)
    if failed:
        raise RuntimeError(f"{len(failed)} sweep point(s) failed: {', '.join(failed)}")
    return rows


def run_jobs(
    out: str | os.PathLike, jobs: Sequence[tuple[str, Sequence[str]]], parallel: int = 1,
    log=sys.stderr,
) -> list[str]:
    """Run `experiments.train` with each job's flags into OUT/<name>, skipping finished
    runs and resuming started ones, N at a time; returns the names of failed jobs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    todo = []
    for name, flags in jobs:
        run_dir = out / name
        state = status(run_dir)
        if state == "finished":
            print(f"skip {name}: finished", file=log)
            continue
        argv = [*flags, "--out", str(run_dir), "--no-progress"]
        if state == "started":
            argv.append("--resume")
        todo.append((run_dir, argv))
    running: list[tuple[Path, subprocess.Popen, float]] = []
    failed = []
    while todo or running:
        while todo and len(running) < parallel:
            run_dir, argv = todo.pop(0)
            print(f"run  {run_dir.name}", file=log, flush=True)
            proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *argv], cwd=ROOT,
                                    stdout=subprocess.DEVNULL,
                                    stderr=open(out / f"{run_dir.name}.log", "w"))
            running.append((run_dir, proc, time.perf_counter()))
        time.sleep(0.2)
        for item in list(running):
            run_dir, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                if proc.returncode:
                    failed.append(run_dir.name)
                    print(f"FAIL {run_dir.name} (exit {proc.returncode}, see {run_dir.name}.log)",
                          file=log, flush=True)
                else:
                    print(f"done {run_dir.name} in {time.perf_counter() - t0:.0f} s", file=log, flush=True)
    return failed


def summarize(out: Path, grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """One row per finished point -> OUT/summary.csv and OUT/summary.jsonl."""
    rows = []
    for point in points(grid):
        run_dir = out / point_name(point)
        if status(run_dir) != "finished":
            continue
        summary = json.loads((run_dir / "run.json").read_text())["summary"]
        comm = {k: v for k, v in summary.items() if k.startswith("comm_")}
        rows.append({**point, "eval_loss": summary["eval_loss"],
                     **{k: v for k, v in summary.items() if k.startswith("eval_loss_")},
                     "final_train_loss": summary["final_train_loss"], "tokens": summary["tokens"],
                     **comm, "wall_time": summary["wall_time"], "run": run_dir.name})
    if rows:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(out / "summary.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fields)
            writer.writeheader()
            writer.writerows(rows)
        (out / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="sweep directory (one run directory per point)")
    p.add_argument("--grid", nargs="+", required=True, metavar="NAME=V1,V2,...")
    p.add_argument("--parallel", type=int, default=1, help="points run at a time (default: 1)")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The sweep's flags (before `--`), checked; `grid` parsed, and `base`: the training
    flags after `--`."""
    argv, base = list(argv), []
    if "--" in argv:
        i = argv.index("--")
        argv, base = argv[:i], argv[i + 1 :]
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.grid = parse_grid(args.grid)
    except ValueError as e:
        p.error(str(e))
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1; got {args.parallel}")
    args.base = base
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    grid, base = args.grid, args.base
    try:
        rows = run_sweep(args.out, grid, base, args.parallel)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for r in rows:
        print(f"{r['run']}: eval_loss {r['eval_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
