"""Add a fragment order from outside the package, register it, and race it against the built-ins.

    python -m experiments.custom_fragment_order --out runs/orders            # 5 runs
    python -m experiments.custom_fragment_order --out runs/orders --quick
    python -m experiments.custom_fragment_order --out experiments/results/orders --plot-only

An order is a plain function `(num_layers, num_fragments) -> P-1 groups of layer indices`
(group i-1 is fragment i; fragment 0 always holds the embeddings and head).
`diloco_eqx.register_order(name, fn)` makes it a `fragment_order` value like the built-in
"interleaved" and "sequential"; nothing in diloco_eqx/ changes. The core checks what an
order returns (P-1 disjoint, non-empty groups covering every layer) and names the order
in its error, as the `broken` example below shows.

Plot (OUT/orders.png): one row per order, best first: which fragment holds each layer,
beside the held-out loss the order ends at. OUT/orders.json has the losses and the groups;
`--plot-only` redraws the plot from it without training.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import diloco_eqx as dl


def reverse_depth(num_layers: int, num_fragments: int):
    """Sequential blocks, deepest first: fragment 1 holds the top layers."""
    m = num_layers // (num_fragments - 1)
    top = list(range(num_layers))[::-1]
    return [top[i * m : (i + 1) * m] for i in range(num_fragments - 1)]


def mirrored(num_layers: int, num_fragments: int):
    """Each fragment holds mirror pairs (j, N-1-j): a shallow and a deep layer together."""
    pairs = [(j, num_layers - 1 - j) for j in range(num_layers // 2)]
    groups = num_fragments - 1
    return [[i for pair in pairs[g::groups] for i in pair] for g in range(groups)]


def random_fixed(num_layers: int, num_fragments: int, seed: int = 0):
    """A seeded random permutation of the layers, cut into equal groups."""
    perm = list(range(num_layers))
    random.Random(seed).shuffle(perm)
    m = num_layers // (num_fragments - 1)
    return [perm[i * m : (i + 1) * m] for i in range(num_fragments - 1)]


def broken(num_layers: int, num_fragments: int):
    """Forgets the last layer: the core must refuse it."""
    return [list(range(num_layers - 1))] + [[] for _ in range(num_fragments - 2)]


CUSTOM = {"reverse_depth": reverse_depth, "mirrored": mirrored, "random_fixed": random_fixed}


def register() -> None:
    for name, fn in CUSTOM.items():
        dl.register_order(name, fn, overwrite=True)


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    losses = result["eval_loss"]
    names = sorted(losses, key=losses.get)
    groups = result["groups"]
    layers = 1 + max(i for g in groups.values() for grp in g for i in grp)
    fragments = len(next(iter(groups.values())))
    owner = np.zeros((len(names), layers), dtype=int)
    for row, name in enumerate(names):
        for f, grp in enumerate(groups[name], start=1):
            owner[row, grp] = f
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 0.45 * len(names) + 1.6), sharey=True,
                                      gridspec_kw={"width_ratios": [layers, 5]})
    cmap = matplotlib.colors.ListedColormap([f"C{f}" for f in range(fragments)])
    left.imshow(owner, cmap=cmap, vmin=0.5, vmax=fragments + 0.5, aspect="auto")
    for (row, layer), f in np.ndenumerate(owner):
        left.text(layer, row, str(f), ha="center", va="center", color="white", fontsize=9)
    left.set_xticks(np.arange(layers + 1) - 0.5, minor=True)
    left.set_yticks(np.arange(len(names) + 1) - 0.5, minor=True)
    left.grid(which="minor", color="white", lw=2)
    left.tick_params(which="minor", length=0)
    left.set_xticks(range(layers))
    left.set_yticks(range(len(names)), names)
    left.set_xlabel("layer (cell: the fragment holding it;\nfragment 0 = embeddings and head)")
    best = losses[names[0]]
    values = [losses[n] for n in names]
    right.scatter(values, range(len(names)), color="k", zorder=3)
    for row, v in enumerate(values):
        note = "best" if row == 0 else f"{100 * (v / best - 1):+.1f}%"
        right.annotate(f"{v:.4f} ({note})", (v, row), xytext=(6, 0),
                       textcoords="offset points", va="center", fontsize=8)
    span = max(values) - min(values) or abs(best) * 0.01
    right.set_xlim(min(values) - 0.1 * span, max(values) + 0.6 * span)
    right.set_xlabel("final held-out loss")
    right.grid(alpha=0.3)
    right.tick_params(axis="y", which="both", length=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def title_of(result: dict) -> str:
    layers = 1 + max(i for g in result["groups"].values() for grp in g for i in grp)
    fragments = len(next(iter(result["groups"].values())))
    return (f"Streaming DiLoCo K=2, H=32, P={fragments + 1}, {layers}-layer byte LM on the stdlib corpus, "
            f"{result['steps']} steps, one seed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.custom_fragment_order", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/orders")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="redraw OUT/orders.png from OUT/orders.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.plot_only:
        if not (out / "orders.json").exists():
            print(f"error: no {out / 'orders.json'} to plot", file=sys.stderr)
            return 1
        result = json.loads((out / "orders.json").read_text())
        plot(result, out / "orders.png", title_of(result))
        print(f"wrote {out / 'orders.png'}")
        return 0
    register()
    layers, p_frag = 6, 4  # three fragments of two layers each
    for name in ("interleaved", "sequential", *CUSTOM):
        groups = dl.orders.layer_groups(name, layers, p_frag)
        print(f"{name:>13}: fragments 1..{p_frag - 1} = {groups}")
    import jax

    from diloco_eqx.models.transformer import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(num_layers=layers), jax.random.key(0))
    try:  # the same check every run makes when it builds its fragments
        cfg = dl.DiLoCoConfig(streaming=True, sync_period=32, num_fragments=p_frag,
                              fragment_order=broken)
        dl.Fragmentation.from_model(model, cfg)
        print("error: the broken order was accepted", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"broken order refused by the core: {e}")

    from experiments import train

    steps = 40 if args.quick else 600
    size = (["--layers", str(layers), "--width", "32", "--heads", "2", "--seq-len", "32",
             "--global-batch", "8"] if args.quick else
            ["--layers", str(layers), "--width", "64", "--heads", "4", "--seq-len", "128",
             "--global-batch", "16"])
    results = {}
    for name in ("interleaved", "sequential", *CUSTOM):
        run_dir = out / name
        argv = [*size, "--steps", str(steps), "--eval-every", str(steps), "--checkpoint-every", str(steps),
                "--eval-batches", "16", "--streaming", "--num-fragments", str(p_frag),
                "--sync-period", "32", "--outer-lr", "0.5", "--outer-momentum", "0.8",
                "--fragment-order", name, "--no-progress", "--out", str(run_dir)]
        meta = run_dir / "run.json"
        if meta.exists() and json.loads(meta.read_text()).get("status") == "finished":
            summary = json.loads(meta.read_text())["summary"]
        else:
            summary = train.run(train.parse_settings(argv + (["--resume"] if meta.exists() else [])))
        results[name] = summary["eval_loss"]
    result = {"steps": steps, "eval_loss": results,
              "groups": {n: dl.orders.layer_groups(n, layers, p_frag) for n in results}}
    (out / "orders.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "orders.png", title_of(result))
    best = min(results.values())
    for name, loss in sorted(results.items(), key=lambda kv: kv[1]):
        print(f"{name:>13}: held-out loss {loss:.4f} ({100 * (loss / best - 1):+.2f}% vs best)")
    print(f"wrote {out / 'orders.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
