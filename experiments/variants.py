"""Method-against-baseline studies with seeds: what the eager, heterogeneous and SparseLoCo
experiments share.

A `Study` names its methods (each a set of `experiments.train` flags on one base setting),
the seeds, and the claims to check, each "method a is lower than method b" (or "a is at
most m % above b") on the final held-out loss, paired by seed. `main(study)` runs every
(method, seed) not yet finished into OUT/<method>,seed=<s> (interrupted runs resume),
then writes OUT/summary.csv (one row per run: the method's knob columns, seed, eval_loss,
tokens, bytes sent per island), OUT/points.csv (mean ± std per method), OUT/<name>.json
(the comparisons and their verdicts) and OUT/<name>.png (held-out loss against steps with
a seed band, and final loss against bytes sent).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from diloco_eqx.training.loop import read_jsonl
from experiments.stats import describe, paired, verdict
from experiments.sweep import run_jobs, status, study_args, study_parser

MODEL = ["--layers", "2", "--width", "64", "--heads", "4", "--seq-len", "64", "--global-batch", "8"]
"""The 2-layer × 64 byte-level transformer on the stdlib corpus, GBS 8 × 64 bytes."""


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    knobs: dict
    """The knob columns of summary.csv."""
    flags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Claim:
    text: str
    a: str
    b: str
    margin_pct: float = 0.0
    """0: "a is lower than b"; m > 0: "a is at most m % above b"."""


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    doc: str
    base: tuple[str, ...]
    """Flags every run shares except --steps and the seed."""
    methods: tuple[Method, ...]
    claims: tuple[Claim, ...]
    seeds: tuple[int, ...]
    steps: int
    title: str
    """The figure's title; {steps} and {seeds} are filled in."""
    loss_vs_bytes: bool = False
    """Right panel: final loss against bytes sent (else: final loss per method)."""
    extra: Callable[[Method, dict], dict] | None = None
    """Further summary columns of one run from its run.json summary."""
    model: tuple[str, ...] = tuple(MODEL)
    """Model and batch flags of every run."""

    def jobs(self) -> list[tuple[str, Method, int, list[str]]]:
        every = max(self.steps // 6, 1)
        common = [*self.model, *self.base, "--steps", str(self.steps), "--eval-every", str(every),
                  "--checkpoint-every", str(self.steps), "--eval-batches", "16"]
        return [(f"{m.name},seed={s}", m, s, [*common, *m.flags, "--seed", str(s)])
                for s in self.seeds for m in self.methods]


def summarize(study: Study, out: Path) -> list[dict]:
    rows = []
    for name, method, seed, _ in study.jobs():
        if status(out / name) != "finished":
            continue
        summary = json.loads((out / name / "run.json").read_text())["summary"]
        row = {"method": method.name, **method.knobs, "seed": seed, "eval_loss": summary["eval_loss"],
               "tokens": summary["tokens"], "comm_bytes_per_island": summary["comm_bytes_per_island"]}
        if study.extra:
            row.update(study.extra(method, summary))
        rows.append({**row, "wall_time": round(summary["wall_time"], 1), "run": name})
    write_csv(out / "summary.csv", rows)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    if rows:
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)


def analyse(study: Study, rows: list[dict]) -> dict:
    """Per-method seed statistics and the paired comparison behind each claim."""
    by: dict[str, dict[int, float]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[int(r["seed"])] = float(r["eval_loss"])
    points = [{"method": m.name, **m.knobs, **describe(list(by[m.name].values()))}
              for m in study.methods if m.name in by]
    comparisons = []
    for c in study.claims:
        if c.a in by and c.b in by:
            p = paired(by[c.a], by[c.b])
            comparisons.append({"claim": c.text, "a": c.a, "b": c.b, "margin_pct": c.margin_pct, **p,
                                "verdict": verdict(p, c.margin_pct)})
    return {"points": points, "comparisons": comparisons}


def curves(study: Study, out: Path) -> dict[str, dict[int, list[float]]]:
    """Held-out loss at each evaluated step, per method, per seed."""
    got: dict[str, dict[int, list[float]]] = {}
    for name, method, _, _ in study.jobs():
        path = out / name / "metrics.jsonl"
        if status(out / name) != "finished" or not path.exists():
            continue
        for row in read_jsonl(path):
            if "eval_loss" in row:
                got.setdefault(method.name, {}).setdefault(int(row["step"]), []).append(float(row["eval_loss"]))
    return got


def plot(study: Study, out: Path, rows: list[dict], result: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {}
    every = max(study.steps // 6, 1)  # the grid every method shares (some evaluate more often)
    for method, by_step in curves(study, out).items():
        steps = sorted(s for s, v in by_step.items() if len(v) == len(by_step[max(by_step)]) and s % every == 0)
        mean = np.array([np.mean(by_step[s]) for s in steps])
        std = np.array([np.std(by_step[s], ddof=1) if len(by_step[s]) > 1 else 0.0 for s in steps])
        (line,) = left.plot(steps, mean, label=method, lw=1.2)
        colors[method] = line.get_color()
        left.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15)
    left.set_xlabel("step")
    left.set_ylabel("held-out loss (nats/byte)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    for i, (method, rs) in enumerate(by_method.items()):
        loss = [float(r["eval_loss"]) for r in rs]
        x = float(np.mean([float(r["comm_bytes_per_island"]) for r in rs])) if study.loss_vs_bytes else i
        right.errorbar([x], [np.mean(loss)], yerr=[np.std(loss, ddof=1) if len(loss) > 1 else 0.0],
                       fmt="o", color=colors.get(method), capsize=3, label=method)
        if not study.loss_vs_bytes:
            right.scatter([x] * len(loss), loss, s=8, color=colors.get(method), alpha=0.5)
    if study.loss_vs_bytes:
        right.set_xscale("log")
        right.set_xlabel("bytes sent per island (whole run)")
    else:
        right.set_xticks(range(len(by_method)), list(by_method), rotation=20, fontsize=7)
    right.set_ylabel("final held-out loss (mean ± std" + (")" if study.loss_vs_bytes else ", dots: seeds)"))
    right.grid(alpha=0.3)
    fig.suptitle(study.title.format(steps=study.steps, seeds=len(study.seeds)), fontsize=9)
    fig.tight_layout()
    path = out / f"{study.name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_comparisons(study: Study, result: dict, path: Path) -> Path:
    """Each claim's seed-paired difference (% of b) with its 95% interval, and its margin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = result["comparisons"]
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * max(len(comps), 1)))
    for i, c in enumerate(comps):
        lo = c["lo_pct"] if c["lo_pct"] > -1e9 else c["diff_pct"]
        hi = c["hi_pct"] if c["hi_pct"] < 1e9 else c["diff_pct"]
        color = {"holding": "C2", "contradicted": "C3"}.get(c["verdict"], "C7")
        ax.errorbar([c["diff_pct"]], [i], xerr=[[c["diff_pct"] - lo], [hi - c["diff_pct"]]], fmt="o",
                    color=color, capsize=3)
        if c["margin_pct"]:
            ax.plot([c["margin_pct"]] * 2, [i - 0.35, i + 0.35], color="k", ls=":", lw=1)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(comps)), [f"{c['a']} vs {c['b']}: {c['verdict']}" for c in comps], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("a − b, % of b (seed-paired, 95% t-interval; dotted: the claim's margin)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def build_parser(full: Study) -> argparse.ArgumentParser:
    """The command line of the study script that runs `full`."""
    return study_parser(f"python -m experiments.{full.name}", full.doc, f"runs/{full.name}",
                        "one seed of short runs, to check the pipeline")


def main(full: Study, quick: Study, argv: Sequence[str] | None = None) -> int:
    args = study_args(build_parser(full), argv)
    return run_study(quick if args.quick else full, args.out, args.parallel)


def run_study(study: Study, out: Path, parallel: int = 1) -> int:
    """Run the study's unfinished runs into OUT, then write and print its summary."""
    runs = study.jobs()
    failed = run_jobs(out, [(name, flags) for name, _, _, flags in runs], parallel)
    rows = summarize(study, out)
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    result = analyse(study, rows)
    write_csv(out / "points.csv", result["points"])
    (out / f"{study.name}.json").write_text(json.dumps(result, indent=1))
    path = plot(study, out, rows, result)
    plot_comparisons(study, result, out / f"{study.name}_paired.png")
    for pt in result["points"]:
        print(f"{pt['method']}: {pt['mean']:.4f} ± {pt['std']:.4f} (n={pt['n']})")
    for c in result["comparisons"]:
        print(f"{c['claim']}: {c['diff_pct']:+.2f}% [{c['lo_pct']:+.2f}, {c['hi_pct']:+.2f}] (n={c['n']}) "
              f"-> {c['verdict']}")
    print(f"wrote {path}")
    return 0
