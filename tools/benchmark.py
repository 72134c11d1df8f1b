"""Benchmark: what DiLoCo costs per step, in time and memory, against plain training.

    python -m tools.benchmark                      # sizes 1M, 10M, 30M; mesh none and 2x1
    python -m tools.benchmark --sizes 1M 10M --meshes 2x1 2x2data 2x2fsdp 2x4fsdp
    python -m tools.benchmark --quick --json bench.json
    python -m tools.benchmark --backends shard_map       # only the default backend's steps
    python -m tools.benchmark --sync-cost-only --sizes 10M 30M   # what a sync adds, against its floor
    python -m tools.benchmark --exchange-placement --sizes 10M 30M  # the deferred exchange, waiting or free

Everything is measured side by side in one process (or in worker processes asked one step
at a time, where a setting must be made before JAX starts) and reported as ratios to the
plain step (K islands each taking an inner AdamW step, no DiLoCo logic), since absolute
times on a shared machine are noisy. Meshes are named D x (devices per island) and the inner
axis: "2x2fsdp" is 2 islands of 2 devices splitting the parameters (simulated host devices
on CPU: they share the machine's cores). Every DiLoCo step is measured on each backend
(`--backends`): shard_map, and drjax as the modes ending in _drjax. The measurements live
in `tools.bench`, one module each; benchmarks/README.md has their current results.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

from tools.bench.common import DEVICES, DTYPES, MESHES, SIZES
from tools.bench.host_memory import HOST_MEMORY
from tools.bench.orders import ORDERS


def _parser() -> argparse.ArgumentParser:
    from diloco_eqx.config import DELAYED_OUTER, DiLoCoConfig
    from diloco_eqx.training.cli import add_flags

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest size only, fewer repetitions")
    parser.add_argument("--sizes", nargs="+", choices=[s.name for s in SIZES], default=None)
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per phase")
    add_flags(parser, DiLoCoConfig(sync_period=100, streaming=True, num_fragments=5),
              only=("sync_period", "num_fragments", "fragment_order"))
    parser.add_argument("--delayed-outer", default=None, choices=DELAYED_OUTER[1:],
                        help="with --sync-cost-only: also time Streaming with V = 0 and this delayed_outer in the "
                             "same repetitions, and compare its syncs with V = 0's, paired")
    parser.add_argument("--compare-order", default=None, metavar="NAME",
                        help="with --sync-cost-only: also time Streaming on this fragment order in the same "
                             "repetitions and compare its syncs with --fragment-order's, paired")
    parser.add_argument("--meshes", nargs="+", choices=list(MESHES), default=None,
                        help="none: islands vmapped on one device; DxN<axis>: D islands of N "
                             "devices along the data and/or fsdp axes (2x1: one device each)")
    parser.add_argument("--backends", nargs="+", choices=("shard_map", "drjax"), default=["shard_map", "drjax"],
                        help="island backends of the DiLoCo steps (modes of drjax steps end in _drjax)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the islands' parameter dtype (the outer model stays float32); the "
                             "utilisation is measured against a matmul in the same dtype")
    _section_flags(parser)
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


def _section_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that pick a section other than the step table, and the workers' own."""
    add = parser.add_argument
    add("--no-sync-cost", action="store_true", help="skip the sync-cost section (its tiny-batch steps and the floor)")
    add("--sync-cost-only", action="store_true",
        help="only the sync-cost section (tiny-batch steps, no mesh): what each sync and each fragment's Streaming "
             "sync adds, against the floor")
    add("--cpu-orders", action="store_true",
        help="instead of the step table: memory and paired step times of each size under XLA:CPU's two instruction "
             "orders, each set by XLA_FLAGS in a worker process (no mesh, CPU only)")
    add("--exchange-placement", action="store_true",
        help="instead of the step table: memory and paired step times of Streaming's deferred exchange waiting for "
             "the inner step (the default without a mesh) and free (no mesh, CPU only)")
    add("--nonsync", action="store_true",
        help="instead of the step table: full-batch steps without an event (DiLoCo, Streaming V = 1) against plain "
             "training's, paired in each repetition (no mesh)")
    add("--trace", default=None, metavar="DIR",
        help="with --nonsync: also trace three repetitions per mode with jax.profiler into DIR/<size> and summarize "
             "their device time and gaps (tools/trace_gaps.py)")
    add("--host-memory", action="store_true",
        help="instead of the step table: full-batch steps with freed host memory kept for reuse (as training runs "
             "keep it) and returned as glibc does, side by side in two worker processes (glibc only)")
    add("--no-keep-host-memory", action="store_true",
        help="leave glibc's malloc as it is (by default freed host memory is kept for reuse, as training runs keep "
             "it; diloco_eqx.training.host_memory)")
    add("--host-memory-worker", choices=HOST_MEMORY, default=None, help=argparse.SUPPRESS)
    add("--cpu-orders-worker", choices=list(ORDERS), default=None, help=argparse.SUPPRESS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the combinations that need no backend to judge refused (exit 2,
    naming the flag) before anything runs; sections refuse the rest as they start (e.g.
    `--trace` without an accelerator)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.trace and not args.nonsync:
        parser.error("--trace: only with --nonsync (it traces the no-event steps that mode times)")
    default_order = parser.get_default("fragment_order")  # DiLoCoConfig's
    if args.fragment_order != default_order and not args.sync_cost_only:
        parser.error(f"--fragment-order: only with --sync-cost-only (every other section times the "
                     f"default order, {default_order!r})")
    _check_order(parser, args.fragment_order)
    if args.delayed_outer is not None and not args.sync_cost_only:
        parser.error("--delayed-outer: only with --sync-cost-only (it adds a mode to that section's steps)")
    if args.compare_order is not None:
        if not args.sync_cost_only:
            parser.error("--compare-order: only with --sync-cost-only (it adds a mode to that section's steps)")
        if args.compare_order == args.fragment_order:
            parser.error(f"--compare-order: {args.compare_order!r} is --fragment-order's own; name another order")
        _check_order(parser, args.compare_order, "--compare-order")
    return args


def _check_order(parser: argparse.ArgumentParser, name: str, flag: str = "--fragment-order") -> None:
    """Refuse a fragment order that is not registered, before anything runs."""
    from diloco_eqx.orders import resolve_order

    try:
        resolve_order(name)
    except (KeyError, ValueError) as e:
        parser.error(f"{flag}: {e}")


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    from diloco_eqx.training import host_memory

    if not args.no_keep_host_memory and args.host_memory_worker != "default":
        host_memory.keep_freed_memory()  # as a training run does, before JAX starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    ).strip()
    sizes = [s for s in SIZES if s.name in (args.sizes or ([SIZES[0].name] if args.quick else
                                                           [s.name for s in SIZES]))]
    if args.host_memory_worker or args.cpu_orders_worker:
        return _worker(args, sizes[0])
    result, text = _run_section(args, sizes)
    print(text)
    if args.json:
        from tools.bench.common import write_json

        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


def _worker(args: argparse.Namespace, size) -> None:
    """A worker process of --host-memory or --cpu-orders (see `tools.bench.workers`)."""
    from tools.bench import host_memory, orders

    if args.host_memory_worker:
        return host_memory.worker(size, args.sync_period)
    return orders.worker(size, args.sync_period, args.num_fragments)


def _run_section(args: argparse.Namespace, sizes) -> tuple[dict, str]:
    """(the result the flags ask for, what it prints)."""
    from tools.bench import common, host_memory, nonsync, orders, placement, report, sync_cost, table

    reps = args.reps or (15 if args.quick else 25)
    p, h = args.num_fragments, args.sync_period
    if args.host_memory:
        result = host_memory.run_host_memory(sizes, reps, h)
        return result, report.format_host_memory(result["host_memory"])
    if args.nonsync:
        save = partial(common.write_json, args.json) if args.json else lambda result: None
        result = nonsync.run_nonsync(sizes, reps, h, p, args.dtype, args.trace, save=save)
        return result, report.format_nonsync(result["nonsync"])
    if args.exchange_placement:
        result = placement.run_exchange_placement(sizes, reps, h, p)
        return result, report.format_exchange_placement(result["exchange_placement"])
    if args.cpu_orders:
        result = orders.run_cpu_orders(sizes, reps, h, p)
        return result, report.format_orders(result["cpu_orders"])
    if args.sync_cost_only:
        result = sync_cost.run_sync_cost(sizes, reps, h, p, args.dtype, args.fragment_order, args.compare_order,
                                         args.delayed_outer)
        return result, "\n".join(report.format_sync_cost(result["sync_cost"]))
    meshes = args.meshes or (["none"] if args.quick else ["none", "2x1"])
    result = table.run(sizes, meshes, reps, h, p, backends=args.backends, dtype=args.dtype,
                       with_sync_cost=not args.no_sync_cost)
    return result, report.format_table(result)


if __name__ == "__main__":
    main()
    sys.exit(0)
