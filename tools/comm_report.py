"""What crosses the diloco axis, measured from the compiled step and set beside ALGORITHM.md's formulas.

    python -m tools.comm_report                                  # Streaming, P=3, the default model
    python -m tools.comm_report --no-streaming --compression bf16 --json comm.json
    python -m tools.comm_report --layers 12 --width 448 --num-fragments 5 --sync-period 100

The transformer is lowered and compiled for a diloco axis of D simulated CPU devices (one
island per device by default), and every collective in the compiled HLO is attributed to the
fragment whose sync issued it. "payload" is what one island contributes to a sync (the
operand of an all-reduce, its share of an all-gather); "ring" is what it sends with the
bandwidth-optimal ring algorithm at this D; ALGORITHM.md's 2·|Θ_f|·b is the ring figure for large D.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys


ALGORITHM_FLAGS = ("num_replicas", "sync_period", "streaming", "num_fragments", "fragment_order",
                   "overlap_steps", "alpha", "compression", "error_feedback", "faults")


def defaults():
    """The config this tool reports on unless told otherwise: the training CLI's."""
    from diloco_eqx.training.config import RunConfig

    return RunConfig()


def build_parser() -> argparse.ArgumentParser:
    from diloco_eqx.training.cli import add_flags
    from diloco_eqx.training.config import DILOCO_FLAGS

    run = defaults()
    p = argparse.ArgumentParser(
        prog="python -m tools.comm_report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p.add_argument_group("algorithm"), run.diloco, DILOCO_FLAGS, only=ALGORITHM_FLAGS)
    add_flags(p.add_argument_group("model"), run.model)
    add_flags(p.add_argument_group("data"), run.data, only=("seq_len", "global_batch"))
    p.add_argument("--devices", type=int, default=None, help="D, the diloco axis size (default: K)")
    p.add_argument("--json", default=None, help="write the measured figures here")
    return p


def use_host_devices(args: argparse.Namespace) -> int:
    """Ask XLA for D = --devices (default K) CPU devices, before jax starts; returns D."""
    from diloco_eqx.training.multiprocess import use_host_devices as ask

    d = args.devices or args.num_replicas
    ask(d)
    return d


def config_from(args: argparse.Namespace):
    """The DiLoCoConfig the flags describe (ValueError naming the knob otherwise)."""
    import jax

    from diloco_eqx.training.cli import from_flags
    from diloco_eqx.training.config import DILOCO_FLAGS

    d = args.devices or args.num_replicas
    if len(jax.devices()) < d:
        raise ValueError(f"--devices {d}: only {len(jax.devices())} devices are visible")
    return from_flags(defaults().diloco, args, DILOCO_FLAGS)


def measure(args: argparse.Namespace) -> dict:
    """Compile the steps and read their collectives; returns the report as a dict."""
    import diloco_eqx as dl
    from diloco_eqx import codecs as compression
    from diloco_eqx.analysis import comms

    k = args.num_replicas
    d = args.devices or k
    cfg = config_from(args)
    shape = (args.layers, args.width, args.heads, args.seq_len, args.global_batch, d)
    hlo = _step_hlo(cfg, *shape)
    schedule = dl.Schedule.from_config(cfg)
    frag_params = dl.Fragmentation.from_model(_model(*shape[:4]), cfg).param_counts(
        _params(*shape[:4])
    )
    per_device = comms.fragment_payload_bytes(hlo, schedule.num_fragments)
    ring = [0.0] * schedule.num_fragments
    control = [0] * schedule.num_fragments
    for c in comms.collectives(hlo):
        if c.fragment is not None:
            ring[c.fragment] += c.wire_bytes
            control[c.fragment] += c.control_bytes
    per_island = k // d  # islands per device: the payloads carry all of a device's islands
    vanilla_cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=args.sync_period)
    vanilla = comms.fragment_payload_bytes(_step_hlo(vanilla_cfg, *shape), 1)[0]
    ddp = comms.every_step_payload_bytes(_ddp_hlo(k, *shape))
    b = compression.bits_per_value(cfg.compression) / 8
    num_params = sum(frag_params)
    return {
        "config": {"num_replicas": k, "devices": d, "sync_period": cfg.sync_period,
                   "streaming": cfg.streaming, "num_fragments": schedule.num_fragments,
                   "fragment_order": str(cfg.fragment_order), "overlap_steps": cfg.overlap_steps,
                   "compression": cfg.compression, "layers": args.layers, "width": args.width},
        "period": schedule.period,
        "steps_between_syncs": schedule.steps_between_syncs,
        "num_params": num_params,
        "param_bytes": 4 * num_params,
        "fragments": [
            {
                "fragment": f,
                "params": n,
                "param_bytes": 4 * n,
                "collective_bytes": per_device[f] // per_island,
                "ring_bytes": ring[f] / per_island,
                "formula_bytes": 2 * n * b,
                "control_bytes": control[f] // per_island,
            }
            for f, n in enumerate(frag_params)
        ],
        "vanilla_collective_bytes": vanilla // per_island,
        "ddp_collective_bytes_per_step": ddp // per_island,
    }


# Compiled programs are cached per model shape, so one process can report many configs.


@functools.cache
def _model(layers, width, heads, seq_len):
    import jax

    from models.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(num_layers=layers, width=width, num_heads=heads, seq_len=seq_len)
    return Transformer(cfg, jax.random.key(0))


def _params(*model_shape):
    import equinox as eqx

    return eqx.filter(_model(*model_shape), eqx.is_inexact_array)


def _batch(seq_len, global_batch):
    import numpy as np

    return np.zeros((global_batch, seq_len + 1), np.int32)


@functools.cache
def _step_hlo(cfg, layers, width, heads, seq_len, global_batch, devices) -> str:
    import optax

    import diloco_eqx as dl
    from models.transformer import loss_fn

    model, mesh, inner = _model(layers, width, heads, seq_len), dl.make_mesh(devices), optax.adamw(1e-3)
    state = dl.init_state(model, inner, cfg, mesh)
    step = dl.make_train_step(cfg, loss_fn, inner, mesh)
    return step.lower(state, _batch(seq_len, global_batch)).compile().as_text()


@functools.cache
def _ddp_hlo(k, layers, width, heads, seq_len, global_batch, devices) -> str:
    import optax

    import diloco_eqx as dl
    from diloco_eqx.ddp import init_ddp_state, make_ddp_step
    from models.transformer import loss_fn

    model, mesh, inner = _model(layers, width, heads, seq_len), dl.make_mesh(devices), optax.adamw(1e-3)
    step = make_ddp_step(k, loss_fn, inner, mesh)
    return step.lower(init_ddp_state(model, inner, mesh), _batch(seq_len, global_batch)).compile().as_text()


def format_report(r: dict) -> str:
    c = r["config"]
    heff, frags = r["period"], r["fragments"]
    mode = (f"Streaming DiLoCo, P={c['num_fragments']} ({c['fragment_order']}), V={c['overlap_steps']}"
            if c["streaming"] else "vanilla DiLoCo")
    lines = [
        f"{mode}, K={c['num_replicas']} on a diloco axis of D={c['devices']}, H={c['sync_period']} "
        f"(Δh={r['steps_between_syncs']}, H_eff={heff}), compression={c['compression']}",
        f"model: {c['layers']} layers × width {c['width']}: |Θ| = {r['num_params']:,} params "
        f"= {r['param_bytes']:,} bytes (float32)",
        "",
        "per fragment, bytes per island per sync:",
        f"{'fragment':>8} {'params':>12} {'param bytes':>12} {'payload':>12} {'ring @D':>12} {'2|Θ_f|b':>12}",
    ]
    for f in frags:
        lines.append(f"{f['fragment']:>8} {f['params']:>12,} {f['param_bytes']:>12,} "
                     f"{f['collective_bytes']:>12,} {f['ring_bytes']:>12,.0f} {f['formula_bytes']:>12,.0f}")
    total = sum(f["collective_bytes"] for f in frags)
    ring = sum(f["ring_bytes"] for f in frags)
    formula = sum(f["formula_bytes"] for f in frags)
    lines.append(f"{'all':>8} {r['num_params']:>12,} {r['param_bytes']:>12,} {total:>12,} "
                 f"{ring:>12,.0f} {formula:>12,.0f}")
    lines.append(f"(plus {max(f['control_bytes'] for f in frags)} bytes of control values per sync: "
                 "the count of contributing islands, or their mask)")
    n4 = r["param_bytes"]
    ddp, van = r["ddp_collective_bytes_per_step"], r["vanilla_collective_bytes"]
    h = c["sync_period"]
    lines += [
        "",
        "bytes per island (measured payload | ALGORITHM.md formula with float32 b=4, this run's b for streaming):",
        f"{'':>22} {'per step (amortized)':>22} {'peak burst':>14} {'formula/step':>14} {'formula burst':>14}",
        f"{'DDP':>22} {ddp:>22,.0f} {ddp:>14,} {2 * n4:>14,.0f} {2 * n4:>14,}",
        f"{'vanilla DiLoCo, H=' + str(h):>22} {van / h:>22,.1f} {van:>14,} {2 * n4 / h:>14,.1f} {2 * n4:>14,}",
        f"{'this config':>22} {total / heff:>22,.1f} {max(f['collective_bytes'] for f in frags):>14,} "
        f"{formula / heff:>14,.1f} {max(f['formula_bytes'] for f in frags):>14,.0f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    use_host_devices(args)
    try:
        report = measure(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
