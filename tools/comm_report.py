"""What crosses the diloco axis, measured from the compiled step and set beside the formulas of docs/algorithm.md.

    python -m tools.comm_report                                  # Streaming, P=3, the default model
    python -m tools.comm_report --no-streaming --compression bf16 --json comm.json
    python -m tools.comm_report --layers 12 --width 448 --num-fragments 5 --sync-period 100
    python -m tools.comm_report --num-replicas 2 --data-parallel 2 --fsdp 2   # islands of 4 devices

The transformer is lowered and compiled for a diloco axis of D simulated CPU devices (one
island per device by default; with --data-parallel n and --fsdp m, each island is n·m devices),
and every collective in the compiled HLO is attributed to the fragment whose sync issued it.
"payload" is what one island contributes to a sync (the operand of an all-reduce, its share
of an all-gather), summed over the island's devices; "per device" is one device's share
(1/m of it with fsdp = m, since each device holds 1/m of the fragment); "ring" is what an
island sends with the bandwidth-optimal ring algorithm at this D; the formula 2·|Θ_f|·b
(docs/algorithm.md) is the ring figure for large D.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys


ALGORITHM_FLAGS = ("num_replicas", "sync_period", "streaming", "num_fragments", "fragment_order",
                   "overlap_steps", "alpha", "compression", "error_feedback", "faults", "delayed_outer",
                   "outer_delay", "island_speed", "island_weighting", "error_decay", "topk_density",
                   "topk_chunk", "topk_bits")


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
    add_flags(p.add_argument_group("island mesh"), run, only=("data_parallel", "fsdp", "backend"))
    p.add_argument("--json", default=None, help="write the measured figures here")
    return p


def use_host_devices(args: argparse.Namespace) -> int:
    """Ask XLA for D = --devices (default K) islands' worth of CPU devices, before jax
    starts; returns D."""
    from diloco_eqx.training.multiprocess import use_host_devices as ask

    d = args.devices or args.num_replicas
    ask(d * args.data_parallel * args.fsdp)
    return d


def config_from(args: argparse.Namespace):
    """The DiLoCoConfig the flags describe (ValueError naming the knob otherwise)."""
    import jax

    from diloco_eqx.training.cli import from_flags
    from diloco_eqx.training.config import DILOCO_FLAGS

    d = args.devices or args.num_replicas
    for name in ("data_parallel", "fsdp"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.num_replicas % d:
        raise ValueError(f"--devices (D)={d} must divide --num-replicas (K)={args.num_replicas}")
    if (args.global_batch // args.num_replicas) % args.data_parallel:
        raise ValueError(f"--data-parallel={args.data_parallel} must divide each island's batch, "
                         f"--global-batch / --num-replicas = {args.global_batch // args.num_replicas} rows")
    need = d * args.data_parallel * args.fsdp
    if len(jax.devices()) < need:
        raise ValueError(f"--devices {d} × --data-parallel {args.data_parallel} × --fsdp {args.fsdp}: "
                         f"needs {need} devices, only {len(jax.devices())} are visible")
    return from_flags(defaults().diloco, args, DILOCO_FLAGS)


def measure(args: argparse.Namespace) -> dict:
    """Compile the steps and read their collectives; returns the report as a dict."""
    import diloco_eqx as dl
    from diloco_eqx.analysis import comms

    k = args.num_replicas
    d = args.devices or k
    cfg = config_from(args)
    n, m = args.data_parallel, args.fsdp
    shape = (args.layers, args.width, args.heads, args.seq_len, args.global_batch, d, n, m)
    mesh = _mesh(d, n, m)
    hlo = _step_hlo(cfg, *shape, args.backend)
    schedule = dl.Schedule.from_config(cfg)
    frag_params = dl.Fragmentation.from_model(_model(*shape[:4]), cfg).param_counts(
        _params(*shape[:4])
    )
    per_device = comms.fragment_payload_bytes(hlo, schedule.num_fragments, mesh)
    inside = comms.fragment_payload_bytes(hlo, schedule.num_fragments, mesh, across=False)
    ring, control = _cross_island_bytes(hlo, mesh, schedule.num_fragments)
    # an island's bytes: every one of its n·m devices sends its piece; a device's payload
    # carries all K/D islands of its slice
    islands_per_slice, island_devices = k // d, n * m
    per_island = island_devices / islands_per_slice
    vanilla_cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=args.sync_period)
    vanilla = comms.fragment_payload_bytes(_step_hlo(vanilla_cfg, *shape, args.backend), 1, mesh)[0]
    ddp = comms.every_step_payload_bytes(_ddp_hlo(k, *shape), mesh)
    formula = _formula_bytes(cfg, frag_params, shape)
    num_params = sum(frag_params)
    return {
        "config": {"num_replicas": k, "devices": d, "data_parallel": n, "fsdp": m, "backend": args.backend,
                   "devices_per_island": island_devices, "sync_period": cfg.sync_period,
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
                "params": p,
                "param_bytes": 4 * p,
                "collective_bytes": round(per_device[f] * per_island),
                "collective_bytes_per_device": per_device[f] // islands_per_slice,
                "inside_island_bytes_per_device": inside[f],
                "ring_bytes": ring[f] * per_island,
                "formula_bytes": formula[f],
                "control_bytes": control[f] // islands_per_slice,
            }
            for f, p in enumerate(frag_params)
        ],
        "outside_syncs": [
            {"kind": c.kind, "where": where, "bytes_per_device": c.payload_bytes + c.control_bytes,
             "control": c.payload_bytes == 0, "op": c.op_name}
            for c, where in comms.cross_island_outside_syncs(hlo, mesh)
        ],
        "vanilla_collective_bytes": round(vanilla * per_island),
        "ddp_collective_bytes_per_step": round(ddp * per_island),
    }


def _cross_island_bytes(hlo: str, mesh, num_fragments: int) -> tuple[list[float], list[int]]:
    """Per fragment, a device's bytes on the wire (ring algorithm) and its control bytes, over
    the collectives of its sync that cross islands (a re-check's collectives left out)."""
    from diloco_eqx.analysis import comms

    ring, control = [0.0] * num_fragments, [0] * num_fragments
    for c in comms.collectives(hlo):
        if c.fragment is not None and not c.rechecked and comms.crosses_islands(c, mesh):
            ring[c.fragment] += c.wire_bytes
            control[c.fragment] += c.control_bytes
    return ring, control


def _formula_bytes(cfg, frag_params: list[int], shape: tuple) -> list[float]:
    """Each fragment's bytes by the formula: 2 × its values at the codec's bits per value, or,
    for a sparse codec, 2 × its payload (values, indices, scales) tensor by tensor."""
    from diloco_eqx import codecs as compression
    from diloco_eqx.analysis import comms

    if cfg.codec.index_bytes(cfg.topk_chunk):
        return [comms.codec_sync_bytes(s, cfg.codec) for s in comms.fragment_tensor_sizes(_model(*shape[:4]), cfg)]
    b = compression.bits_per_value(cfg.compression) / 8
    return [2 * p * b for p in frag_params]


def _mesh(devices, data, fsdp):
    import diloco_eqx as dl

    return dl.make_mesh(devices) if data * fsdp == 1 else dl.make_mesh(diloco=devices, data=data, fsdp=fsdp)


# Compiled programs are cached per model shape, so one process can report many configs.


@functools.cache
def _model(layers, width, heads, seq_len):
    import jax

    from diloco_eqx.models.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig(num_layers=layers, width=width, num_heads=heads, seq_len=seq_len)
    return Transformer(cfg, jax.random.key(0))


def _params(*model_shape):
    import equinox as eqx

    return eqx.filter(_model(*model_shape), eqx.is_inexact_array)


def _batch(seq_len, global_batch):
    import numpy as np

    return np.zeros((global_batch, seq_len + 1), np.int32)


@functools.cache
def _step_hlo(cfg, layers, width, heads, seq_len, global_batch, devices, data, fsdp, backend) -> str:
    import optax

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import loss_fn

    model, mesh, inner = _model(layers, width, heads, seq_len), _mesh(devices, data, fsdp), optax.adamw(1e-3)
    algo = dl.DiLoCo(cfg, loss_fn, inner, mesh=mesh, backend=backend)
    return algo.lower(algo.init(model), _batch(seq_len, global_batch)).compile().as_text()


@functools.cache
def _ddp_hlo(k, layers, width, heads, seq_len, global_batch, devices, data, fsdp) -> str:
    import optax

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import loss_fn

    model, mesh, inner = _model(layers, width, heads, seq_len), _mesh(devices, data, fsdp), optax.adamw(1e-3)
    ddp = dl.DDP(k, loss_fn, inner, mesh=mesh)
    return ddp.lower(ddp.init(model), _batch(seq_len, global_batch)).compile().as_text()


def format_report(r: dict) -> str:
    c = r["config"]
    heff, frags = r["period"], r["fragments"]
    mode = (f"Streaming DiLoCo, P={c['num_fragments']} ({c['fragment_order']}), V={c['overlap_steps']}"
            if c["streaming"] else "vanilla DiLoCo")
    island = (f"islands of {c['devices_per_island']} devices (data {c['data_parallel']} × fsdp "
              f"{c['fsdp']})" if c["devices_per_island"] > 1 else "one device per island slice")
    lines = [
        f"{mode}, K={c['num_replicas']} on a diloco axis of D={c['devices']}, {island}, "
        f"H={c['sync_period']} (Δh={r['steps_between_syncs']}, H_eff={heff}), compression={c['compression']}, "
        f"backend={c['backend']}",
        f"model: {c['layers']} layers × width {c['width']}: |Θ| = {r['num_params']:,} params "
        f"= {r['param_bytes']:,} bytes (float32)",
        "",
        "per fragment, bytes per sync across islands (per island, and per device of an island), "
        "and inside an island (per device):",
        f"{'fragment':>8} {'params':>12} {'param bytes':>12} {'payload':>12} {'per device':>12} "
        f"{'ring @D':>12} {'2|Θ_f|b':>12} {'inside':>10}",
    ]
    for f in frags:
        lines.append(f"{f['fragment']:>8} {f['params']:>12,} {f['param_bytes']:>12,} "
                     f"{f['collective_bytes']:>12,} {f['collective_bytes_per_device']:>12,} "
                     f"{f['ring_bytes']:>12,.0f} {f['formula_bytes']:>12,.0f} "
                     f"{f['inside_island_bytes_per_device']:>10,}")
    total = sum(f["collective_bytes"] for f in frags)
    ring = sum(f["ring_bytes"] for f in frags)
    formula = sum(f["formula_bytes"] for f in frags)
    lines.append(f"{'all':>8} {r['num_params']:>12,} {r['param_bytes']:>12,} {total:>12,} "
                 f"{sum(f['collective_bytes_per_device'] for f in frags):>12,} "
                 f"{ring:>12,.0f} {formula:>12,.0f} {sum(f['inside_island_bytes_per_device'] for f in frags):>10,}")
    lines.append(f"(plus {max(f['control_bytes'] for f in frags)} bytes of control values per sync: "
                 "the count of contributing islands, or their mask)")
    outside = r["outside_syncs"]
    lines.append(f"cross-island collectives outside the sync branches: {len(outside) or 'none'}")
    for o in outside:
        lines.append(f"  {o['kind']} of {o['bytes_per_device']:,} bytes per device "
                     f"({'control' if o['control'] else 'payload'}), {o['where']}: {o['op']}")
    n4 = r["param_bytes"]
    ddp, van = r["ddp_collective_bytes_per_step"], r["vanilla_collective_bytes"]
    h = c["sync_period"]
    lines += [
        "",
        "bytes per island (measured payload | the formula with float32 b=4, this run's b for streaming):",
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
