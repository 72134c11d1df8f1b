"""Small-scale reproduction of the Streaming DiLoCo paper's main comparisons on the stdlib corpus.

    python -m experiments.reproduce_streaming --out runs/reproduce            # 8 runs
    python -m experiments.reproduce_streaming --out runs/reproduce --quick    # 8 tiny runs

Every run has the same model, data order, tokens per step and inner AdamW; K = 2 islands,
outer Nesterov η = 0.5, β = 0.8. The runs:
  ddp                    Data-Parallel (gradients averaged every step)
  diloco                 vanilla DiLoCo, H = 30
  streaming              Streaming DiLoCo, H = 30, P = 3 (interleaved), V = 0; also evaluates island 0
  streaming_H10/_H100    the same with H = 10 and H = 100
  streaming_sequential   the same with sequential fragments
  streaming_P2/_P5       the same with P = 2 (all layers in one fragment) and P = 5 (one layer each)
Figure (OUT/reproduce.png): held-out loss against tokens for DDP / DiLoCo / Streaming (and
Streaming's island 0); final held-out loss against H; interleaved vs sequential; against P.
Numbers in OUT/reproduce.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.sweep import run_jobs
from experiments.sweep_overlap import _revision

FULL = dict(model=["--layers", "4", "--width", "64", "--heads", "4", "--seq-len", "128",
                   "--global-batch", "16"], steps=1000, eval_every=100)
QUICK = dict(model=["--layers", "4", "--width", "32", "--heads", "2", "--seq-len", "32",
                    "--global-batch", "8"], steps=60, eval_every=30)
OUTER = ["--outer-lr", "0.5", "--outer-momentum", "0.8"]


def jobs(quick: bool) -> list[tuple[str, list[str]]]:
    size = QUICK if quick else FULL
    base = [*size["model"], "--steps", str(size["steps"]), "--eval-every", str(size["eval_every"]),
            "--checkpoint-every", str(size["steps"]), "--eval-batches", "16"]
    stream = [*base, *OUTER, "--streaming", "--num-fragments", "3", "--sync-period", "30"]

    def variant(**changes):
        argv = list(stream)
        for flag, value in changes.items():
            flag = "--" + flag.replace("_", "-")
            if flag in argv:
                argv[argv.index(flag) + 1] = str(value)
            else:
                argv += [flag, str(value)]
        return argv

    return [
        ("ddp", [*base, "--mode", "ddp"]),
        ("diloco", [*base, *OUTER, "--no-streaming", "--sync-period", "30"]),
        ("streaming", [*stream, "--eval-island"]),
        ("streaming_H10", variant(sync_period=10)),
        ("streaming_H100", variant(sync_period=100)),
        ("streaming_sequential", variant(fragment_order="sequential")),
        ("streaming_P2", variant(num_fragments=2)),
        ("streaming_P5", variant(num_fragments=5)),
    ]


def load(out: Path, name: str) -> dict:
    run = out / name
    meta = json.loads((run / "run.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("eval")]
    return {
        "final": meta["summary"]["eval_loss"],
        "final_island_0": meta["summary"].get("eval_loss_island_0"),
        "tokens": [r["step"] * meta["tokens_per_step"] for r in evals],
        "eval": [r["eval_loss"] for r in evals],
        "eval_island_0": [r.get("eval_loss_island_0") for r in evals],
        "bytes_per_island": meta["summary"]["comm_bytes_per_island"],
        "period": (meta["schedule"] or {}).get("period"),
        "params": meta["model"]["params"],
        "total_tokens": meta["summary"]["tokens"],
    }


def plot(res: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    ax = axes[0, 0]
    for name, label in (("ddp", "Data-Parallel"), ("diloco", "DiLoCo H=30"),
                        ("streaming", "Streaming H=30, P=3")):
        ax.plot(res[name]["tokens"], res[name]["eval"], marker=".", label=label)
    s = res["streaming"]
    if any(x is not None for x in s["eval_island_0"]):
        ax.plot(s["tokens"], s["eval_island_0"], ls="--", color="gray", label="Streaming, island 0")
    ax.set_xlabel("tokens")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("equal tokens", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    hs = [("streaming_H10", 10), ("streaming", 30), ("streaming_H100", 100)]
    ax.plot([h for _, h in hs], [res[n]["final"] for n, _ in hs], marker="o", label="Streaming, P=3")
    ax.axhline(res["ddp"]["final"], color="k", lw=0.8, ls=":", label="Data-Parallel")
    ax.scatter([30], [res["diloco"]["final"]], color="C1", label="DiLoCo H=30", zorder=3)
    ax.set_xscale("log")
    ax.set_xticks([10, 30, 100], ["10", "30", "100"])
    ax.set_xlabel("H (requested; H_eff = P·round(H/P))")
    ax.set_ylabel("final held-out loss")
    ax.set_title("synchronization period", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    for name, label in (("streaming", "interleaved (strided)"), ("streaming_sequential", "sequential")):
        ax.plot(res[name]["tokens"], res[name]["eval"], marker=".", label=f"{label}: {res[name]['final']:.4f}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("held-out loss")
    ax.set_title("fragment order (H=30, P=3)", fontsize=9)
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    ps = [("streaming_P2", 2), ("streaming", 3), ("streaming_P5", 5)]
    ax.plot([p for _, p in ps], [res[n]["final"] for n, _ in ps], marker="o", label="Streaming, H=30")
    ax.axhline(res["ddp"]["final"], color="k", lw=0.8, ls=":", label="Data-Parallel")
    ax.axhline(res["diloco"]["final"], color="C1", lw=0.8, ls="--", label="DiLoCo H=30")
    ax.set_xticks([2, 3, 5])
    ax.set_xlabel("fragments P (fragment 0 = embeddings and head)")
    ax.set_ylabel("final held-out loss")
    ax.set_title("fragment count", fontsize=9)
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.reproduce_streaming", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/reproduce")
    p.add_argument("--quick", action="store_true", help="tiny model, 60 steps: checks the pipeline")
    p.add_argument("--parallel", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    failed = run_jobs(out, jobs(args.quick), args.parallel)
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    res = {name: load(out, name) for name, _ in jobs(args.quick)}
    size = QUICK if args.quick else FULL
    title = (f"K=2 islands, {res['ddp']['params']:,}-parameter byte LM ({size['model'][1]} layers × "
             f"{size['model'][3]}), {size['steps']} steps = {res['ddp']['total_tokens']:,} tokens per run, "
             "stdlib corpus; outer Nesterov η=0.5, β=0.8")
    plot(res, out / "reproduce.png", title)
    ddp = res["ddp"]["final"]
    table = {name: {"final_eval_loss": r["final"], "vs_ddp_pct": 100 * (r["final"] / ddp - 1),
                    "bytes_per_island": r["bytes_per_island"], "H_eff": r["period"],
                    **({"final_island_0": r["final_island_0"]} if r["final_island_0"] else {})}
             for name, r in res.items()}
    (out / "reproduce.json").write_text(json.dumps(
        {"setting": title, "revision": _revision(), "runs": table}, indent=1))
    for name, row in table.items():
        extra = f", island 0: {row['final_island_0']:.4f}" if "final_island_0" in row else ""
        print(f"{name:>22}: {row['final_eval_loss']:.4f} ({row['vs_ddp_pct']:+.2f}% vs DDP){extra}")
    print(f"wrote {out / 'reproduce.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
