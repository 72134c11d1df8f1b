"""Add a fragment order from outside the package, register it, and race it against the built-ins.

    python -m experiments.custom_fragment_order --out runs/orders            # 5 runs
    python -m experiments.custom_fragment_order --out runs/orders --quick

An order is a plain function `(num_layers, num_fragments) -> P-1 groups of layer indices`
(group i-1 is fragment i; fragment 0 always holds the embeddings and head).
`diloco_eqx.register_order(name, fn)` makes it a `fragment_order` value like the built-in
"interleaved" and "sequential"; nothing in diloco_eqx/ changes. The core checks what an
order returns (P-1 disjoint, non-empty groups covering every layer) and names the order
in its error, as the `broken` example below shows.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.custom_fragment_order", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/orders")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
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
    out = Path(args.out)
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
    (out / "orders.json").write_text(json.dumps(
        {"steps": steps, "eval_loss": results,
         "groups": {n: dl.orders.layer_groups(n, layers, p_frag) for n in results}}, indent=1))
    best = min(results.values())
    for name, loss in sorted(results.items(), key=lambda kv: kv[1]):
        print(f"{name:>13}: held-out loss {loss:.4f} ({100 * (loss / best - 1):+.2f}% vs best)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
