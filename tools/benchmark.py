"""Benchmark: what DiLoCo costs per step, in time and memory, against plain training.

    python -m tools.benchmark                      # sizes 1M, 10M, 30M; mesh none and 2x1
    python -m tools.benchmark --sizes 1M 10M --meshes 2x1 2x2data 2x2fsdp 2x4fsdp
    python -m tools.benchmark --quick --json bench.json
    python -m tools.benchmark --backends shard_map       # only the default backend's steps
    python -m tools.benchmark --exchange-placement --sizes 10M 30M  # the deferred exchange, waiting or free

Everything is measured side by side in one process and reported as ratios to the plain step
(K islands each taking an inner AdamW step, no DiLoCo logic), since absolute times on a shared
machine are noisy. Phases are timed one step at a time, interleaved across modes, with the
global step t set so that the step ends on a sync, an apply, or neither; "amortized" runs H_eff
consecutive steps. Medians with the 10th–90th percentile spread. Meshes are named
D x (devices per island) and the inner axis: "2x2fsdp" is 2 islands of 2 devices splitting
the parameters (simulated host devices on CPU: they share the machine's cores). Every DiLoCo
step is measured on each backend (`--backends`): shard_map, and drjax as the modes ending in
_drjax.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import sys
import time
from functools import partial

DEVICES = 8
MESHES = {  # name -> make_mesh sizes
    "none": None,
    "2x1": dict(diloco=2),
    "2x2data": dict(diloco=2, data=2),
    "2x2fsdp": dict(diloco=2, fsdp=2),
    "2x4fsdp": dict(diloco=2, fsdp=4),
    "2x2datax2fsdp": dict(diloco=2, data=2, fsdp=2),
}


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    layers: int
    width: int
    heads: int
    seq_len: int
    global_batch: int


SIZES = (
    Size("1M", layers=4, width=128, heads=4, seq_len=128, global_batch=16),
    Size("10M", layers=8, width=320, heads=8, seq_len=64, global_batch=8),
    Size("30M", layers=12, width=448, heads=8, seq_len=64, global_batch=4),
    Size("100M", layers=16, width=768, heads=12, seq_len=1024, global_batch=16),  # for an accelerator
)
DTYPES = ("float32", "bfloat16")


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
    parser.add_argument("--no-sync-cost", action="store_true",
                        help="skip the sync-cost section (its tiny-batch steps and the floor)")
    parser.add_argument("--sync-cost-only", action="store_true",
                        help="only the sync-cost section (tiny-batch steps, no mesh): what each sync "
                             "and each fragment's Streaming sync adds, against the floor")
    parser.add_argument("--cpu-orders", action="store_true",
                        help="instead of the step table: memory and paired step times of each size under "
                             "XLA:CPU's two instruction orders (diloco_eqx.cpu_scheduler; no mesh, CPU only)")
    parser.add_argument("--exchange-placement", action="store_true",
                        help="instead of the step table: memory and paired step times of Streaming's deferred "
                             "exchange waiting for the inner step (XLA:CPU's default) and free (no mesh, CPU only)")
    parser.add_argument("--nonsync", action="store_true",
                        help="instead of the step table: full-batch steps without an event (DiLoCo, Streaming "
                             "V = 1) against plain training's, paired in each repetition (no mesh)")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="with --nonsync: also trace three repetitions per mode with jax.profiler into "
                             "DIR/<size> and summarize their device time and gaps (tools/trace_gaps.py)")
    parser.add_argument("--host-memory", action="store_true",
                        help="instead of the step table: full-batch steps with freed host memory kept for reuse "
                             "(diloco_eqx.host_memory, as runs do) and returned as glibc does, side by side in "
                             "two worker processes (glibc only)")
    parser.add_argument("--no-keep-host-memory", action="store_true",
                        help="leave glibc's malloc as it is (by default freed host memory is kept for reuse, "
                             "as training runs keep it; diloco_eqx.host_memory)")
    parser.add_argument("--host-memory-worker", choices=HOST_MEMORY, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diloco_eqx import host_memory

    if not args.no_keep_host_memory and args.host_memory_worker != "default":
        host_memory.keep_freed_memory()  # as a training run does, before JAX starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    ).strip()
    sizes = [s for s in SIZES if s.name in (args.sizes or ([SIZES[0].name] if args.quick else
                                                           [s.name for s in SIZES]))]
    meshes = args.meshes or (["none"] if args.quick else ["none", "2x1"])
    reps = args.reps or (15 if args.quick else 25)
    if args.host_memory_worker:
        return _host_memory_worker(sizes[0], args.sync_period)
    if args.host_memory:
        result = run_host_memory(sizes, reps, args.sync_period)
        print(format_host_memory(result["host_memory"]))
    elif args.nonsync:
        result = run_nonsync(sizes, reps, args.sync_period, args.num_fragments, args.dtype, args.trace,
                             save=partial(_write_json, args.json) if args.json else lambda result: None)
        print(format_nonsync(result["nonsync"]))
    elif args.exchange_placement:
        result = run_exchange_placement(sizes, reps, args.sync_period, args.num_fragments)
        print(format_exchange_placement(result["exchange_placement"]))
    elif args.cpu_orders:
        result = run_cpu_orders(sizes, reps, args.sync_period, args.num_fragments)
        print(format_orders(result["cpu_orders"]))
    elif args.sync_cost_only:
        result = run_sync_cost(sizes, reps, args.sync_period, args.num_fragments, args.dtype, args.fragment_order,
                               args.compare_order, args.delayed_outer)
        print("\n".join(_format_sync_cost(result["sync_cost"])))
    else:
        result = run(sizes, meshes, reps, args.sync_period, args.num_fragments, backends=args.backends,
                     dtype=args.dtype, with_sync_cost=not args.no_sync_cost)
        print(format_table(result))
    if args.json:
        _write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


def _write_json(path: str, result: dict) -> None:
    """`result` into `path`, whole or not at all (written beside it, then renamed)."""
    with open(path + ".part", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".part", path)


def run(sizes, meshes, reps, sync_period, num_fragments, amortized_blocks=2, backends=("shard_map",),
        dtype="float32", with_sync_cost=True) -> dict:
    """The step table: for every size and mesh, each mode's phases and amortized step timed
    side by side, its compile count, memory and FLOPs; then each size's sync cost and, for the
    first size and mesh, every mode's extra memory against its formula."""
    import jax
    import jax.numpy as jnp
    import optax

    k, inner = 2, optax.adamw(1e-3)
    rows, memory, compilations, checks = [], {}, {}, {}
    matmul_flops = _matmul_flops(dtype=jnp.dtype(dtype))
    for size in sizes:
        model = _model(size, dtype)
        for mesh_name in meshes:
            label = f"{size.name}/{mesh_name}"
            table = _step_table(model, size, mesh_name, k, inner, sync_period, num_fragments, reps,
                                amortized_blocks, backends)
            rows += table["rows"]
            memory.update({f"{label}/{mode}": m for mode, m in table["memory"].items()})
            compilations.update({f"{label}/{mode}": c for mode, c in table["compile"].items()})
            checks[label] = _size_checks(size, table, matmul_flops)
    costs = {s.name: sync_cost(_model(s, dtype), k, sync_period, num_fragments, reps=max(reps, 10))
             for s in sizes} if with_sync_cost else {}
    return {
        "compilations": max(c["count"] for c in compilations.values()),
        "memory": _memory_by_mode(sizes[0], meshes[0], checks, memory, k, inner, sync_period, num_fragments,
                                  backends, dtype),
        "rows": rows,
        "sync_cost": costs,
        "compile": compilations,
        "sizes": checks,
        "settings": {"num_replicas": k, "sync_period": sync_period, "num_fragments": num_fragments,
                     "overlap_steps": 1, "reps": reps, "dtype": dtype},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "device": jax.devices()[0].device_kind},
    }


class _StepRunner:
    """Each mode's state and step on one batch, placed once: `call` runs one step and counts
    its compilations, `set_step` moves a mode's global step so the next call ends where a
    phase needs it."""

    def __init__(self, steps: dict, batch, mesh):
        from diloco_eqx.analysis import profiling

        self.steps, self.mesh, self.batch = steps, mesh, batch
        self.placed = {mode: step.place_batch(batch) for mode, (_, step) in steps.items()}
        self.counts = {mode: profiling.CompileCount() for mode in steps}
        self.calls = dict.fromkeys(steps, 0)

    def call(self, mode: str) -> None:
        import jax

        from diloco_eqx.analysis import profiling

        state, step = self.steps[mode]
        with profiling.count_compilations() as c:
            state, _ = step.step_placed(state, self.placed[mode])
            jax.block_until_ready(state)
        self.counts[mode].count += c.count
        self.counts[mode].seconds += c.seconds
        self.calls[mode] += 1
        self.steps[mode] = (state, step)

    def set_step(self, mode: str, t_end: int) -> None:
        """The next call of `mode` is the step ending at t_end."""
        state, step = self.steps[mode]
        self.steps[mode] = (_ending_at(state, t_end, self.mesh), step)


def _step_table(model, size: Size, mesh_name: str, k: int, inner, sync_period: int, num_fragments: int,
                reps: int, amortized_blocks: int, backends) -> dict:
    """One size on one mesh: every mode's rows (phases, then amortized), compile counts,
    memory of its compiled step, and plain's FLOPs and median step time."""
    import numpy as np

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import count_params

    mesh = _bench_mesh(mesh_name)
    vanilla = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period)
    streaming = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True,
                                num_fragments=num_fragments, overlap_steps=1)
    batch = np.random.default_rng(0).integers(0, 256, (size.global_batch, size.seq_len + 1), dtype=np.int32)
    runner = _StepRunner(_bench_steps(model, k, inner, mesh, vanilla, streaming, backends), batch, mesh)
    for mode in runner.steps:  # first call: compiles
        runner.call(mode)
    va, st = dl.Schedule.from_config(vanilla), dl.Schedule.from_config(streaming)
    times = _phase_times(runner, _phase_jobs(va, st, backends, num_fragments), reps)
    diloco_modes = [m for m in runner.steps if m not in ("plain", "ddp")]
    amort = _amortized_times(runner, ["plain", *diloco_modes], max(va.period, st.period), amortized_blocks)
    compile_counts = {mode: {"count": runner.counts[mode].count, "compile_s": runner.counts[mode].seconds,
                             "steps": runner.calls[mode]} for mode in diloco_modes}
    memory, plain_flops = _step_memory(runner)
    plain_times = times[("plain", "step")]
    plain_median, amort_plain = float(np.median(plain_times)), float(np.median(amort["plain"]))
    rows = [_row(size.name, mesh_name, mode, phase, ts, plain_median, plain_times)
            for (mode, phase), ts in times.items()]
    rows += [_row(size.name, mesh_name, mode, "amortized", ts, amort_plain) for mode, ts in amort.items()]
    return {"rows": rows, "compile": compile_counts, "memory": memory, "mesh": mesh, "plain_flops": plain_flops,
            "plain_median_s": plain_median, "params": count_params(model)}


def _bench_steps(model, k: int, inner, mesh, vanilla, streaming, backends) -> dict:
    """The steps under test, by mode: plain, DDP, and vanilla and Streaming DiLoCo on every backend."""
    import diloco_eqx as dl
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.ddp import init_ddp_state, make_ddp_step
    from diloco_eqx.models.transformer import loss_fn

    steps = {"plain": make_plain_step(model, loss_fn, inner, k, mesh),
             "ddp": (init_ddp_state(model, inner, mesh), make_ddp_step(k, loss_fn, inner, mesh))}
    for backend in backends:
        for mode, cfg in (("diloco", vanilla), ("streaming", streaming)):
            steps[_mode(mode, backend)] = (dl.init_state(model, inner, cfg, mesh),
                                           dl.make_train_step(cfg, loss_fn, inner, mesh, backend=backend))
    return steps


def _phase_jobs(vanilla, streaming, backends, num_fragments: int) -> dict[tuple[str, str], list[int | None]]:
    """For each (mode, phase), the global steps its timed steps end at, taken in turn
    (None: wherever the mode is): a sync, a Streaming sync and apply of every fragment, or
    neither (t = 5)."""
    dh = streaming.steps_between_syncs
    jobs: dict[tuple[str, str], list[int | None]] = {("plain", "step"): [None], ("ddp", "step"): [None]}
    for backend in backends:
        va, st = _mode("diloco", backend), _mode("streaming", backend)
        jobs.update({
            (va, "nonsync"): [5],
            (va, "sync"): [vanilla.period],
            (st, "nonsync"): [5],
            (st, "sync"): [dh * j for j in range(1, num_fragments + 1)],
            (st, "apply"): [dh * j + 1 for j in range(1, num_fragments + 1)],
        })
    return jobs


def _phase_times(runner: _StepRunner, jobs: dict, reps: int) -> dict:
    """Each job's step times, one step at a time and interleaved across jobs, after two
    warm-up rounds."""
    times = {key: [] for key in jobs}
    for rep in range(reps + 2):
        for (mode, phase), ends in jobs.items():
            t_end = ends[rep % len(ends)]
            if t_end is not None:
                runner.set_step(mode, t_end)
            t0 = time.perf_counter()
            runner.call(mode)
            if rep >= 2:
                times[(mode, phase)].append(time.perf_counter() - t0)
    return times


def _amortized_times(runner: _StepRunner, modes: list[str], period: int, blocks: int) -> dict:
    """Mean step time over H_eff consecutive steps from t = 0, per block: each mode runs its
    own sequence, interleaved with the others in chunks of 10 steps so that machine drift hits
    every mode alike; two blocks give every DiLoCo mode 2·H_eff consecutive steps over every
    schedule position."""
    amort = {mode: [] for mode in modes}
    for _ in range(blocks):
        for mode in modes[1:]:  # plain has no schedule
            runner.set_step(mode, 1)
        spent = dict.fromkeys(modes, 0.0)
        for start in range(0, period, 10):
            for mode in modes:
                t0 = time.perf_counter()
                for _ in range(min(10, period - start)):
                    runner.call(mode)
                spent[mode] += time.perf_counter() - t0
        for mode in modes:
            amort[mode].append(spent[mode] / period)
    return amort


def _step_memory(runner: _StepRunner) -> tuple[dict, float]:
    """Memory of each mode's compiled step (the executables already run), and plain's FLOPs."""
    from diloco_eqx.analysis import profiling

    memory, plain_flops = {}, None
    for mode, (state, step) in runner.steps.items():
        memory[mode], compiled = _step_memory_of(step, state, runner.batch)
        if mode == "plain":
            plain_flops = profiling.flops(compiled)
    return memory, plain_flops


def _size_checks(size: Size, table: dict, matmul_flops: float) -> dict:
    """What one size on one mesh measured against the machine: extra memory, FLOP rates, MFU."""
    from diloco_eqx import mesh as islands

    mesh, memory, n = table["mesh"], table["memory"], table["params"]
    devices = 1 if mesh is None else mesh.size
    plain_flops, plain_median = table["plain_flops"] * devices, table["plain_median_s"]
    model_flops = _model_flops(size, n)
    return {
        "devices": devices,
        "devices_per_island": islands.island_size(mesh),
        "fsdp": islands.axis_size(mesh, islands.FSDP),
        "plain_resident_bytes_per_device": memory["plain"]["resident_bytes"],
        "extra_bytes_per_device": memory["diloco"]["resident_bytes"] - memory["plain"]["resident_bytes"],
        "params": n,
        "tokens_per_step": size.global_batch * size.seq_len,
        "plain_flops_per_step": plain_flops,
        "inner_flops_per_s": plain_flops / plain_median,
        "matmul_flops_per_s": matmul_flops,
        "utilisation": plain_flops / plain_median / matmul_flops,
        "model_flops_per_step": model_flops,
        "model_flops_utilisation": model_flops / plain_median / matmul_flops,
        "expected_extra_bytes": 2 * n * 4 // islands.island_size(mesh),
    }


def _memory_by_mode(size: Size, mesh_name: str, checks: dict, memory: dict, k: int, inner, sync_period: int,
                    num_fragments: int, backends, dtype: str) -> dict:
    """Every mode's extra memory over plain for the first size and mesh, against its formula:
    2·|Θ|·4 for the outer model and trace (per island device), plus, with the deferred
    exchange, one stash row of the largest fragment per island on the device. Streaming with
    V = 0 is compiled here for its memory only."""
    import numpy as np

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import loss_fn

    first = f"{size.name}/{mesh_name}"
    mesh = _bench_mesh(mesh_name)
    model, batch = _model(size, dtype), np.zeros((size.global_batch, size.seq_len + 1), np.int32)
    direct = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True, num_fragments=num_fragments)
    memory = dict(memory)
    for backend in backends:
        step = dl.make_train_step(direct, loss_fn, inner, mesh, backend=backend)
        memory[f"{first}/{_mode('streaming_v0', backend)}"], _ = _step_memory_of(
            step, dl.init_state(model, inner, direct, mesh), batch)
    n, largest = checks[first]["params"], max(_fragment_params(model, direct))
    plain_mem = memory[f"{first}/plain"]["resident_bytes"]
    if dtype == "bfloat16" and mesh is None:  # the run's own no-mesh steps are already bfloat16
        low = _bfloat16_row(plain_mem, memory[f"{first}/{_mode('diloco', backends[0])}"]["resident_bytes"], n)
    else:
        low = _bfloat16_memory(_model(size, dtype), inner, k, sync_period, size)
    per_island = checks[first]["devices_per_island"]
    islands_per_device = k // (checks[first]["devices"] // per_island)
    outer = 2 * n * 4 // per_island  # outer model and trace, split over the island's devices
    stash = islands_per_device * largest * 4 // per_island  # one row per island: the largest fragment
    modes = {_mode(name, backend): (_mode(mode, backend), want) for backend in backends
             for name, mode, want in (("vanilla", "diloco", outer), ("streaming", "streaming_v0", outer),
                                      ("streaming_deferred", "streaming", outer + stash))}
    return {"plain_bytes": plain_mem,
            "diloco_bytes": memory[f"{first}/{_mode('streaming', backends[0])}"]["resident_bytes"],
            "expected_extra_bytes": checks[first]["expected_extra_bytes"],
            "param_bytes": 4 * n, "largest_fragment_bytes": 4 * largest,
            "modes": {name: {"extra_bytes": memory[f"{first}/{mode}"]["resident_bytes"] - plain_mem,
                             "live_extra_bytes": _live_extra(memory, first, mode), "expected_extra_bytes": want}
                      for name, (mode, want) in modes.items()},
            "config": first, "all": memory, "bfloat16": low}


def sync_cost(model, k: int, sync_period: int, num_fragments: int, reps: int,
              fragment_order: str | None = None, compare_order: str | None = None,
              delayed_outer: str | None = None) -> dict:
    """What a sync adds to a step, against the floor of the bytes it must touch (no mesh).

    The batch is 2 sequences of 8 tokens, so the inner step is short and the differences are
    resolved: each repetition times, back to back, the plain step, DiLoCo on a step without
    an event, on a sync, and Streaming (V = 1) without an event, on a sync (the stash) and on
    the step after it (exchange, outer step and apply); the results are medians of paired
    differences. The repetitions cycle through the fragments' syncs, each equally often, so
    each fragment's cost is reported too, and their mean over a cycle: P Streaming syncs
    touch the model once, as one vanilla sync does, so it is that mean which 1/P of the
    vanilla sync's cost measures. The floor is one fused XLA pass that reads and writes, in
    place, as many bytes as the K islands, the outer model and its trace hold: the least a
    vanilla sync can do is read them all and write them back. Each repetition first times
    the references (the floor, the deferred sync's own floor, the vanilla sync written by
    hand with and without its norms), then an untimed plain step, then the steps; the
    ratios to the references are medians of each, and under "paired" the mean of each
    repetition's ratio with its 95% interval. They hold 2K + 4 model-sized float32 buffers
    and the deferred floor's besides the steps' states (1.1 GB at 30M, K = 2, P = 5).
    Streaming's fragments follow `fragment_order` (the config's default when None); with
    `compare_order`, Streaming on that order is timed in the same repetitions too, and its
    syncs compared with the first order's, paired (`compared_order`). Streaming with V = 0
    (`streaming_v0`: no stash, the sync and apply in one step) is timed in the same
    repetitions too: its syncs move a vanilla sync's bytes per parameter, so a cycle of them
    against one vanilla sync is where 1/P is owed; `cycle_over_vanilla_paired` gives both
    forms' cycles over vanilla's, one ratio per cycle of P repetitions, with the interval.
    With `delayed_outer` ("naive" or "eager"), V = 0 with that delayed outer update is timed
    in the same repetitions too (`delayed`): each island keeps its own outer copy, so its
    sync moves more bytes than V = 0's, and `delayed` pairs the two per layer fragment."""
    import numpy as np

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import count_params

    n = count_params(model)
    vanilla = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period)
    streaming = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True,
                                num_fragments=num_fragments, overlap_steps=1,
                                **({} if fragment_order is None else {"fragment_order": fragment_order}))
    streamings = {"streaming": streaming}
    if compare_order is not None:
        streamings["compared"] = dataclasses.replace(streaming, fragment_order=compare_order)
    direct = dataclasses.replace(streaming, overlap_steps=0)
    delayed = None if delayed_outer is None else dataclasses.replace(direct, delayed_outer=delayed_outer)
    floor_bytes, stream_bytes, references = _sync_cost_references(model, k, vanilla, num_fragments)
    times, synced, reps = _sync_cost_times(model, k, vanilla, streamings, references, reps, direct, delayed)
    del references
    sync_reps = np.subtract(times[("diloco", sync_period)], times[("diloco", 5)])  # each repetition's
    out = _vanilla_sync_summary(times, sync_period, sync_reps, floor_bytes)
    vanilla_extra = out["vanilla_sync_extra_s"]
    out.update(_streaming_sync_summary(times, synced, model, streaming, direct, vanilla_extra, sync_reps))
    out.update(streaming_floor_bytes=stream_bytes, streaming_floor_s=float(np.median(times["stream_floor"])),
               streaming_floor_over_vanilla_floor=stream_bytes / (2 * floor_bytes), params=n,
               fragment_order=streaming.fragment_order, reps=reps)
    out["streaming_cycle_over_floor"] = out["streaming_cycle_extra_s"] / out["streaming_floor_s"]
    if compare_order is not None:
        out["compared_order"] = _compared_order(times, synced, model, streamings["compared"], vanilla_extra)
    if delayed is not None:
        out["delayed"] = _delayed_syncs(times, synced, model, delayed, vanilla_extra)
    return out


def _time_ratio(times: dict, a, b) -> dict:
    """The mean paired ratio of two timed lists (a key of `times` or the list itself) with its
    95% t-interval."""
    import numpy as np

    ci = _paired_interval(a if isinstance(a, np.ndarray) else times[a], times[b])
    return {"mean": ci["mean"], "low": ci["lo"], "high": ci["hi"]}


def _vanilla_sync_summary(times: dict, sync_period: int, sync_reps, floor_bytes: int) -> dict:
    """`sync_cost`'s figures for the vanilla sync against its floor and the hand-written syncs,
    and each mode's step without an event against plain."""
    import numpy as np

    floor, by_hand, minimal = (float(np.median(times[r])) for r in ("floor", "by_hand", "minimal"))
    diff = lambda a, b: float(np.median(np.subtract(times[a], times[b])))  # noqa: E731
    extra = diff(("diloco", sync_period), ("diloco", 5))
    return {"floor_s": floor, "floor_bytes": 2 * floor_bytes, "plain_s": float(np.median(times[("plain", None)])),
            "vanilla_sync_extra_s": extra, "vanilla_extra_over_floor": extra / floor,
            "handwritten_sync_s": by_hand, "handwritten_over_floor": by_hand / floor,
            "vanilla_extra_over_handwritten": extra / by_hand,
            "minimal_sync_s": minimal, "minimal_over_floor": minimal / floor,
            "diloco_nonsync_extra_s": diff(("diloco", 5), ("plain", None)),
            "streaming_nonsync_extra_s": diff(("streaming", 5), ("plain", None)),
            **{f"{mode}_nonsync_ratio": _time_ratio(times, (mode, 5), ("plain", None))
               for mode in ("diloco", "streaming")},
            "paired": {"vanilla_extra_over_floor": _time_ratio(times, sync_reps, "floor"),
                       "handwritten_over_floor": _time_ratio(times, "by_hand", "floor"),
                       "minimal_over_floor": _time_ratio(times, "minimal", "floor"),
                       "vanilla_extra_over_handwritten": _time_ratio(times, sync_reps, "by_hand")}}


def _streaming_sync_summary(times: dict, synced: list[int], model, streaming, direct, vanilla_extra: float,
                            sync_reps) -> dict:
    """`sync_cost`'s figures for Streaming's syncs, deferred (`streaming`, V >= 1) and not
    (`direct`, V = 0): per fragment, over a cycle of P, and against the vanilla sync."""
    import numpy as np

    p = streaming.num_fragments
    diff = lambda a, b: float(np.median(np.subtract(times[a], times[b])))  # noqa: E731
    stash_extra = diff(("streaming", "sync"), ("streaming", 5))
    exchange_extra = diff(("streaming", "after"), ("streaming", 5))
    per_fragment = _per_fragment(times, synced, p, model, streaming, vanilla_extra)
    cycle = sum(f["stash_extra_s"] + f["exchange_apply_extra_s"] for f in per_fragment) / p
    v0_per_fragment = _per_fragment(times, synced, p, model, direct, vanilla_extra, mode="streaming_v0")
    v0_cycle = sum(f["stash_extra_s"] for f in v0_per_fragment) / p
    extras = {mode: _sync_extras(times, mode) for mode in ("streaming", "streaming_v0")}
    return {"streaming_per_fragment": per_fragment, "streaming_cycle_extra_s": cycle,
            "streaming_cycle_over_vanilla": cycle / vanilla_extra,
            "streaming_v0_per_fragment": _one_step_rows(v0_per_fragment),
            "streaming_v0_cycle_extra_s": v0_cycle, "streaming_v0_cycle_over_vanilla": v0_cycle / vanilla_extra,
            "cycle_over_vanilla_paired": {m: cycle_ratio(e, sync_reps, p) for m, e in extras.items()},
            "stash_extra_s": stash_extra, "exchange_apply_extra_s": exchange_extra,
            "streaming_sync_extra_s": stash_extra + exchange_extra,
            "streaming_over_vanilla": (stash_extra + exchange_extra) / vanilla_extra, "one_over_p": 1 / p}


def _sync_cost_references(model, k: int, vanilla, num_fragments: int) -> tuple[int, int, dict]:
    """(bytes a vanilla sync must read, those a deferred Streaming sync must read on average,
    {name: (timer, its run)} for the floors of both and the hand-written syncs)."""
    import equinox as eqx
    import jax

    from diloco_eqx.models.transformer import count_params

    n = count_params(model)
    island_bytes = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))[0].dtype.itemsize
    floor_bytes = (k * island_bytes + 2 * 4) * n  # K islands, outer model and trace (float32)
    stream_bytes = _deferred_sync_bytes(n, k, island_bytes, num_fragments)
    hand = _handwritten_syncs(model, k, vanilla)
    return floor_bytes, stream_bytes, {"floor": (_stream_floor(floor_bytes // 4), "floor"),
                                       "stream_floor": (_stream_floor(stream_bytes // 8), "floor"),
                                       **{name: (hand, name) for name in hand.runs}}


def _sync_cost_times(model, k: int, vanilla, streamings: dict, references: dict, reps: int,
                     direct, delayed=None) -> tuple[dict, list[int], int]:
    """(seconds of every phase and reference in each timed repetition, the fragment each
    repetition's Streaming sync was of, the repetitions timed: `reps` rounded up to a
    multiple of P so every fragment's sync is timed equally often). Two repetitions before
    them warm up. With two Streaming modes (two fragment orders), they take turns going first;
    `direct` (V = 0) syncs and applies the same fragment in the step that ends at the stash's t,
    and so does `delayed` (V = 0 with a delayed outer update), when given."""
    import numpy as np
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.models.transformer import loss_fn

    inner = optax.adamw(1e-3)
    batch = np.random.default_rng(0).integers(0, 256, (2, 9), dtype=np.int32)
    steps = {"plain": list(make_plain_step(model, loss_fn, inner, k))}
    v0_forms = [("streaming_v0", direct)] + ([] if delayed is None else [("delayed", delayed)])
    for name, cfg in (("diloco", vanilla), *streamings.items(), *v0_forms):
        steps[name] = [dl.init_state(model, inner, cfg), dl.make_train_step(cfg, loss_fn, inner)]
    placed = {m: step.place_batch(batch) for m, (_, step) in steps.items()}
    first = next(iter(streamings.values()))  # the orders share the schedule
    schedule, h, p = dl.Schedule.from_config(first), vanilla.sync_period, first.num_fragments
    dh = schedule.steps_between_syncs
    def phases(rep):  # two Streaming modes take turns going first
        modes = list(streamings)[::-1 if rep % 2 else 1]
        return [("plain", None), ("diloco", 5), ("diloco", h), *[(m, t) for m in modes for t in (5, "sync", "after")],
                *[(m, t) for m, _ in v0_forms for t in (5, "sync")]]

    times, synced = {key: [] for key in [*phases(0), *references]}, []
    reps = -(-reps // p) * p
    for rep in range(reps + 2):
        j = 1 + rep % p  # cycle through every fragment's sync
        for name, (timer, run) in references.items():
            times[name].append(timer(run))
        _time_step(steps["plain"], placed["plain"])  # untimed: the references' passes are behind it
        for mode, t in phases(rep):  # "after" is the step that follows the stash, as in a run
            t_end = {None: None, "sync": dh * j, "after": None}.get(t, t)
            times[(mode, t)].append(_time_step(steps[mode], placed[mode], t_end))
        synced.append(int(schedule.fragment_at(dh * j)))
        assert dl.Schedule.from_config(direct).fragment_at(dh * j) == synced[-1]
    return {key: ts[2:] for key, ts in times.items()}, synced[2:], reps


def _time_step(state_and_step: list, placed, t_end: int | None = None) -> float:
    """Seconds of one step from `state_and_step` ([state, step], updated in place); with
    `t_end`, the step that ends at t_end (the state's counter set first, untimed)."""
    import jax

    state, step = state_and_step
    if t_end is not None:
        state = _ending_at(state, t_end)
    t0 = time.perf_counter()
    state, _ = step.step_placed(state, placed)
    jax.block_until_ready(state)
    state_and_step[0] = state
    return time.perf_counter() - t0


def _deferred_sync_bytes(n: int, k: int, island_bytes: int, num_fragments: int) -> int:
    """Bytes one deferred Streaming sync (V >= 1) must read and write, on average over the P
    fragments (together they hold the n parameters): the stash step reads each island's
    fragment and the outer one and writes the K pseudo-gradients (float32); the exchange
    reads them, the outer fragment and its trace and writes those two; the apply reads each
    island's fragment and the outer one and writes the islands. Per parameter that is
    3·K·b_island + 2·K·4 + 6·4 bytes, where a vanilla sync at its floor moves 2·K·b_island
    + 4·4: the stash and the second read of the islands make a cycle of P Streaming syncs
    touch more than one vanilla sync does."""
    return (3 * k * island_bytes + 2 * k * 4 + 6 * 4) * n // num_fragments


def _live_extra(memory: dict, config: str, mode: str) -> int | None:
    """What `mode` holds at its peak over what plain training holds at its own, by XLA's
    live ranges (`profiling.live_peak`): the extra with the allocator's layout left out."""
    live, plain = memory[f"{config}/{mode}"]["live_peak_bytes"], memory[f"{config}/plain"]["live_peak_bytes"]
    return None if live is None or plain is None else live - plain


def _compared_order(times: dict, synced: list[int], model, cfg, vanilla_extra: float) -> dict:
    """The Streaming syncs on `cfg`'s order (timed as mode "compared") against the first
    order's, in the same repetitions: per fragment and over a cycle as for the first, and
    the mean over the layer fragments' repetitions of the difference of the two syncs'
    extras (first minus compared, seconds; stash plus exchange and apply, each over its own
    mode's no-event step) with its 95% interval and what it says of "the compared order
    costs less"."""
    import numpy as np

    def extra(mode):
        return (np.asarray(times[(mode, "sync")]) + np.asarray(times[(mode, "after")])
                - 2 * np.asarray(times[(mode, 5)]))

    per = _per_fragment(times, synced, cfg.num_fragments, model, cfg, vanilla_extra, mode="compared")
    cycle = sum(p["stash_extra_s"] + p["exchange_apply_extra_s"] for p in per) / cfg.num_fragments
    layers = np.asarray(synced) != 0
    d = _paired_difference((extra("streaming") - extra("compared"))[layers])
    verdict = "holding" if d["low"] > 0 else "contradicted" if d["high"] < 0 else "unresolved"
    return {"fragment_order": cfg.fragment_order, "streaming_per_fragment": per, "streaming_cycle_extra_s": cycle,
            "streaming_cycle_over_vanilla": cycle / vanilla_extra, "layer_sync_difference_s": d,
            "compared_is_cheaper": verdict}


def _paired_difference(values) -> dict:
    """The mean of paired differences with its 95% interval, under the JSON's key names."""
    from experiments.stats import interval

    d = interval(list(values))
    return {"mean": d["mean"], "low": d["lo"], "high": d["hi"], "n": d["n"]}


def _delayed_syncs(times: dict, synced: list[int], model, cfg, vanilla_extra: float) -> dict:
    """The V = 0 syncs with `cfg.delayed_outer` (timed as mode "delayed") against plain V = 0's
    in the same repetitions: per fragment and over a cycle, and the mean over the layer
    fragments' repetitions of the difference of the two syncs' extras (delayed minus V = 0,
    seconds, each over its own mode's no-event step) with its 95% interval, and their ratio
    of means."""
    import numpy as np

    per = _per_fragment(times, synced, cfg.num_fragments, model, cfg, vanilla_extra, mode="delayed")
    extras = {m: _sync_extras(times, m) for m in ("delayed", "streaming_v0")}
    layers = np.asarray(synced) != 0
    return {"delayed_outer": cfg.delayed_outer,
            "per_fragment": _one_step_rows(per),
            "cycle_extra_s": sum(p["stash_extra_s"] for p in per) / cfg.num_fragments,
            "layer_sync_minus_v0_s": _paired_difference((extras["delayed"] - extras["streaming_v0"])[layers]),
            "layer_sync_over_v0": float(np.mean(extras["delayed"][layers]) / np.mean(extras["streaming_v0"][layers]))}


def _one_step_rows(per: list[dict]) -> list[dict]:
    """`_per_fragment`'s rows for a form that syncs and applies in one step (V = 0): that
    step's extra as `sync_apply_extra_s`, and no exchange column."""
    return [{"fragment": p["fragment"], "layers": p["layers"], "param_fraction": p["param_fraction"],
             "reps": p["reps"], "sync_apply_extra_s": p["stash_extra_s"], "over_vanilla": p["over_vanilla"]}
            for p in per]


def _per_fragment(times: dict, synced: list[int], num_fragments: int, model, cfg, vanilla_extra: float,
                  mode: str = "streaming") -> list[dict]:
    """Each fragment's Streaming sync (stash, then exchange and apply; with V = 0 the one step
    that syncs and applies, as "stash", and no second) over the non-sync step of the same
    repetition: medians over that fragment's repetitions, its share of the parameters, and
    its extra over the vanilla sync's (a fragment that costs in proportion to its size has
    the two equal)."""
    import numpy as np

    import equinox as eqx

    import diloco_eqx as dl

    fragments = dl.Fragmentation.from_model(model, cfg)
    counts = fragments.param_counts(eqx.filter(model, eqx.is_inexact_array))
    base = np.asarray(times[(mode, 5)])
    out = []
    for f in range(num_fragments):
        mine = np.asarray(synced) == f
        stash = float(np.median(np.asarray(times[(mode, "sync")])[mine] - base[mine]))
        exchange = float(np.median(np.asarray(times[(mode, "after")])[mine] - base[mine])) if (mode, "after") in times else 0.0
        out.append({"fragment": f, "layers": list(fragments.layer_indices(f)) if f else [],
                    "param_fraction": counts[f] / sum(counts), "reps": int(mine.sum()),
                    "stash_extra_s": stash, "exchange_apply_extra_s": exchange,
                    "over_vanilla": (stash + exchange) / vanilla_extra})
    return out


def _sync_extras(times: dict, mode: str):
    """Each repetition's Streaming sync over its no-event step: the stash and the step after
    it (exchange and apply) where the mode has that step, else the one step (V = 0)."""
    import numpy as np

    base = np.asarray(times[(mode, 5)])
    extra = np.asarray(times[(mode, "sync")]) - base
    return extra + np.asarray(times[(mode, "after")]) - base if (mode, "after") in times else extra


def cycle_ratio(streaming_extras, vanilla_extras, num_fragments: int) -> dict:
    """A cycle of P Streaming syncs over one vanilla sync, paired by cycle: the repetitions,
    taken P at a time in order (each P consecutive ones sync every fragment once), give one
    ratio each, Σ Streaming extras ÷ Σ vanilla extras over those P; their mean with its 95%
    t-interval, and the verdict on 1/P ("holding": the whole interval at or below it)."""
    import numpy as np

    from experiments.stats import interval

    s, v = (np.asarray(x, np.float64).reshape(-1, num_fragments) for x in (streaming_extras, vanilla_extras))
    d = interval(list(s.sum(axis=1) / v.sum(axis=1)))
    one_over_p = 1 / num_fragments
    verdict = "holding" if d["hi"] <= one_over_p else "contradicted" if d["lo"] > one_over_p else "unresolved"
    return {"mean": d["mean"], "low": d["lo"], "high": d["hi"], "cycles": d["n"], "at_most_one_over_p": verdict}


def cpu_orders(model, size, k: int, sync_period: int, num_fragments: int, reps: int) -> dict:
    """XLA:CPU's two instruction orders side by side (`diloco_eqx.cpu_scheduler`): each mode's
    resident memory over plain's under the same order, against its expected extra (as in
    `run`'s memory modes), and full-batch step times paired within each repetition (the
    orders alternate which runs first) for plain, a Streaming (V = 1) step without an event
    and its stash step. Ratios are memory-order time / concurrency-order time: the mean with
    its 95% t-interval over the repetitions."""
    import numpy as np
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis import profiling
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.compiler import CPU_SCHEDULERS
    from diloco_eqx.models.transformer import count_params, loss_fn

    inner, n = optax.adamw(1e-3), count_params(model)
    batch = np.random.default_rng(0).integers(0, 256, (size.global_batch, size.seq_len + 1), dtype=np.int32)
    cfgs = {"vanilla": dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period),
            "streaming": dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True,
                                         num_fragments=num_fragments),
            "streaming_deferred": dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True,
                                                  num_fragments=num_fragments, overlap_steps=1)}
    largest = max(_fragment_params(model, cfgs["streaming"]))
    expected = {"vanilla": 8 * n, "streaming": 8 * n, "streaming_deferred": 8 * n + k * largest * 4}
    steps, memory = {}, {}
    for order in CPU_SCHEDULERS:
        with dl.cpu_scheduler(order):
            steps[order, "plain"] = list(make_plain_step(model, loss_fn, inner, k))
            for mode, cfg in cfgs.items():
                steps[order, mode] = [dl.init_state(model, inner, cfg), dl.make_train_step(cfg, loss_fn, inner)]
        memory[order] = {mode: profiling.memory(step.lower(state, batch).compile())["resident_bytes"]
                         for (o, mode), (state, step) in steps.items() if o == order}
    modes = {order: {mode: {"extra_bytes": memory[order][mode] - memory[order]["plain"],
                            "expected_extra_bytes": want} for mode, want in expected.items()}
             for order in CPU_SCHEDULERS}
    dh = dl.Schedule.from_config(cfgs["streaming_deferred"]).steps_between_syncs
    phases = {"plain": ("plain", None), "streaming_nonsync": ("streaming_deferred", 5),
              "streaming_sync": ("streaming_deferred", dh)}
    times = _paired_order_times(steps, {key: step.place_batch(batch) for key, (_, step) in steps.items()},
                                phases, reps)
    timing = _paired_ratios(times, phases, "memory", "concurrency")
    return {"params": n, "resident_bytes": memory, "modes": modes, "times": timing, "reps": reps}


def _paired_interval(a, b) -> dict:
    """Mean of the paired ratios a[i] / b[i] with its 95% Student-t interval."""
    import numpy as np

    from experiments.stats import interval

    return interval(list(np.divide(a, b)))


def _fragment_params(model, cfg) -> list[int]:
    """Parameters in each of `cfg`'s fragments of `model`."""
    import equinox as eqx

    import diloco_eqx as dl

    return dl.Fragmentation.from_model(model, cfg).param_counts(eqx.filter(model, eqx.is_inexact_array))


def _require_cpu(flag: str, why: str) -> None:
    import jax

    if jax.default_backend() != "cpu":
        raise SystemExit(f"{flag}: {why}; this machine's backend is {jax.default_backend()}")


def _paired_ratios(times: dict, phases, over: str, under: str) -> dict:
    """Per phase: both variants' median seconds and the mean paired ratio `over` / `under`
    with its 95% t-interval."""
    import numpy as np

    out = {}
    for name in phases:
        ci = _paired_interval(times[over, name], times[under, name])
        out[name] = {f"{over}_s": float(np.median(times[over, name])), f"{under}_s": float(np.median(times[under, name])),
                     "time_ratio": ci["mean"], "time_ratio_low": ci["lo"], "time_ratio_high": ci["hi"]}
    return out


def _paired_order_times(steps: dict, placed: dict, phases: dict, reps: int,
                        pair: tuple[str, str] = ("concurrency", "memory")) -> dict:
    """{(variant, phase): seconds per repetition}; in each repetition the two variants of
    `pair` run each phase back to back, alternating which goes first. `steps` holds [state,
    step] lists keyed (variant, mode); a phase is (mode, the step t to run, or a list of
    them taken in turn, or None to go on from the state's own step)."""
    import jax

    times = {}
    for rep in range(reps + 1):
        for name, (mode, ts) in phases.items():
            t = ts[rep % len(ts)] if isinstance(ts, list) else ts
            for order in (pair[::-1] if rep % 2 else pair):
                state, step = steps[order, mode]
                if t is not None:
                    state = _ending_at(state, t)
                t0 = time.perf_counter()
                state, _ = step.step_placed(state, placed[order, mode])
                jax.block_until_ready(state)
                if rep:  # the first repetition compiles and warms up
                    times.setdefault((order, name), []).append(time.perf_counter() - t0)
                steps[order, mode][0] = state
    return times


def exchange_placement(model, size, k: int, sync_period: int, num_fragments: int, reps: int) -> dict:
    """The deferred exchange (Streaming, V = 1) free to run anywhere ("free", as built for an
    accelerator) and waiting for the inner step ("after_inner", XLA:CPU's default), side by
    side: each step's resident and live-peak extra over plain against the formula, and
    full-batch times paired within each repetition (alternating which runs first) of a step
    with no event, a stash step and an exchange step (fragments taken in turn). Ratios are
    after_inner / free: the mean with its 95% t-interval over the repetitions."""
    import numpy as np
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis import profiling
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.models.transformer import count_params, loss_fn

    inner, n = optax.adamw(1e-3), count_params(model)
    batch = np.random.default_rng(0).integers(0, 256, (size.global_batch, size.seq_len + 1), dtype=np.int32)
    cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True, num_fragments=num_fragments,
                          overlap_steps=1)
    want = 8 * n + k * max(_fragment_params(model, cfg)) * 4
    state, plain = make_plain_step(model, loss_fn, inner, k)
    compiled, plain_live = profiling.live_peak(plain.lower(state, batch))
    plain_bytes = profiling.memory(compiled)["resident_bytes"]
    steps, memory = {}, {}
    for variant, after in (("free", False), ("after_inner", True)):
        step = dl.make_train_step(cfg, loss_fn, inner, exchange_after_inner=after)
        steps[variant, "deferred"] = [dl.init_state(model, inner, cfg), step]
        compiled, live = profiling.live_peak(step.lower(steps[variant, "deferred"][0], batch))
        memory[variant] = {"extra_bytes": profiling.memory(compiled)["resident_bytes"] - plain_bytes,
                           "live_extra_bytes": None if live is None or plain_live is None else live - plain_live,
                           "expected_extra_bytes": want}
    dh = dl.Schedule.from_config(cfg).steps_between_syncs
    phases = {"nonsync": ("deferred", 5), "stash": ("deferred", [dh * j for j in range(1, num_fragments + 1)]),
              "exchange": ("deferred", [dh * j + 1 for j in range(1, num_fragments + 1)])}
    placed = {key: step.place_batch(batch) for key, (_, step) in steps.items()}
    times = _paired_order_times(steps, placed, phases, reps, pair=("free", "after_inner"))
    timing = _paired_ratios(times, phases, "after_inner", "free")
    return {"params": n, "plain_resident_bytes": plain_bytes, "memory": memory, "times": timing, "reps": reps}


NONSYNC_MODES = ("plain", "diloco", "streaming", "streaming_free")


def nonsync(model, size, k: int, sync_period: int, num_fragments: int, reps: int, trace: str | None = None,
            report=lambda out: None) -> dict:
    """Full-batch steps without a schedule event (DiLoCo and Streaming with V = 1, each run at
    t = 5) against the plain step: Streaming as built by default (its exchange waits for the
    inner step here, where the islands share one device) and with its exchange free
    ("streaming_free", as on an island mesh). Every repetition runs the four back to back,
    the first of them rotating, and each mode's result is the mean of its per-repetition ratios to
    plain's with the 95% t-interval (the first repetition compiles and is dropped). Then the
    event check (`_event_check`), and with `trace` three more repetitions under
    `jax.profiler` (`_traced`). `report(out)` gets the result after each phase, so a later
    phase that fails or runs out of time loses nothing already measured."""
    import numpy as np
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.models.transformer import count_params, loss_fn

    inner = optax.adamw(1e-3)
    batch = np.random.default_rng(0).integers(0, 256, (size.global_batch, size.seq_len + 1), dtype=np.int32)
    streaming = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True,
                                num_fragments=num_fragments, overlap_steps=1)
    cfgs = {"diloco": dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period), "streaming": streaming,
            "streaming_free": streaming}
    steps = {"plain": list(make_plain_step(model, loss_fn, inner, k))}
    for m, cfg in cfgs.items():
        after = False if m == "streaming_free" else None
        steps[m] = [dl.init_state(model, inner, cfg), dl.make_train_step(cfg, loss_fn, inner, exchange_after_inner=after)]
    placed = {m: step.place_batch(batch) for m, (_, step) in steps.items()}
    times = _nonsync_times(size, steps, placed, reps)
    plain = times["plain"]
    modes = {m: {"median_s": float(np.median(times[m])), **_ratio_interval(times[m], plain),
                 **({"exchange_after_inner": steps[m][1].plan.exchange_after_inner} if cfgs[m].streaming else {})}
             for m in cfgs}
    out = {"params": count_params(model), "plain_s": float(np.median(plain)), "modes": modes, "reps": reps}
    print(format_nonsync({size.name: out}), file=sys.stderr, flush=True)
    report(out)
    out["events"] = {m: _event_check(model, cfg, steps[m], placed[m]) for m, cfg in cfgs.items()}
    report(out)
    if trace:
        out.update(_traced(steps, placed, trace))
        report(out)
    return out


def _nonsync_times(size, steps: dict, placed: dict, reps: int) -> dict[str, list[float]]:
    """Each mode's step times over `reps` rotating repetitions after one that compiles."""
    times, start = {m: [] for m in NONSYNC_MODES}, time.perf_counter()
    for rep in range(reps + 1):
        turn = rep % len(NONSYNC_MODES)
        for m in NONSYNC_MODES[turn:] + NONSYNC_MODES[:turn]:
            elapsed = _nonsync_step(steps[m], placed[m], m != "plain")
            if rep:
                times[m].append(elapsed)
        if rep % max(reps // 4, 1) == 0:  # progress: a GPU process spends minutes before the first timed step
            print(f"{size.name} --nonsync: repetition {rep} of {reps} done at {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    return times


def _traced(steps: dict, placed: dict, folder: str) -> dict:
    """Three repetitions of each mode under `jax.profiler` into `folder`, each step in a host
    annotation `mode_{mode}_{rep}`: {"trace": `tools.trace_gaps` summary}, or, when tracing or
    reading the trace fails, {"trace_error": what failed} (the timings stand either way)."""
    import jax

    from tools import trace_gaps

    pattern = os.path.join(folder, "plugins", "profile", "*", "*.trace.json.gz")
    earlier = set(glob.glob(pattern))  # a reused folder's traces are not this run's
    try:
        with jax.profiler.trace(folder):
            for rep in range(3):
                for m in NONSYNC_MODES:
                    _nonsync_step(steps[m], placed[m], m != "plain", f"mode_{m}_{rep}")
        found = sorted(set(glob.glob(pattern)) - earlier)
        if not found:
            raise FileNotFoundError(f"no new *.trace.json.gz under {folder}/plugins/profile")
        return {"trace": trace_gaps.summarize(found[-1])}
    except Exception as e:  # noqa: BLE001 - a failed trace must not cost the measured timings
        print(f"--trace: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return {"trace_error": f"{type(e).__name__}: {e}"}


def _nonsync_step(state_and_step: list, batches, reset_t: bool, annotation: str | None = None) -> float:
    """One step (from t = 4, so it ends at t = 5 without an event, where `reset_t`), timed
    from its call until its new state is ready; the state is replaced in place."""
    import contextlib

    import jax

    state, step = state_and_step
    if reset_t:
        state = _ending_at(state, 5)
    with jax.profiler.TraceAnnotation(annotation) if annotation else contextlib.nullcontext():
        t0 = time.perf_counter()
        state, _ = step.step_placed(state, batches)
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - t0
    state_and_step[0] = state
    return elapsed


def _event_check(model, cfg, state_and_step: list, batches) -> dict:
    """The steps that end at H_eff − 1 through H_eff + V, fragment 0's sync and its apply:
    after each, the largest difference between islands over fragment 0 (every parameter for
    vanilla DiLoCo), the largest change of the outer model's fragment 0 in that step, and
    the outer model's Σ|θ| after the last. With α = 0 the apply makes the islands' fragment 0
    equal, and the outer fragment 0 moves in the step that applies it (its sync with V = 0,
    its exchange with V = 1) and in no step before: both, exactly, show that the sync's and
    the apply's loops ran on the device; Σ|θ| compares runs under other XLA flags."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import diloco_eqx as dl

    schedule, fragment0 = dl.Schedule.from_config(cfg), dl.Fragmentation.from_model(model, cfg)
    first = schedule.period - 1
    ends = list(range(first, schedule.period + cfg.overlap_steps + 1))
    state, step = state_and_step
    state, spreads, moves = _ending_at(state, first), [], []
    outer0 = lambda s: jax.tree.leaves(fragment0.take(eqx.filter(s.outer, eqx.is_inexact_array), 0))  # noqa: E731
    for _ in ends:
        before = [np.asarray(x, np.float64) for x in outer0(state)]
        state, _ = step.step_placed(state, batches)
        part = fragment0.take(eqx.filter(state.inner_model, eqx.is_inexact_array), 0)
        spreads.append(max(float(jnp.max(jnp.abs(x - x[:1]))) for x in jax.tree.leaves(part)))
        moves.append(max(float(np.max(np.abs(np.asarray(x, np.float64) - b))) for x, b in zip(outer0(state), before)))
    state_and_step[0] = state
    outer = sum(float(np.abs(np.asarray(x, np.float64)).sum())
                for x in jax.tree.leaves(eqx.filter(state.outer, eqx.is_inexact_array)))
    return {"ends": ends, "applied_at": schedule.period + cfg.overlap_steps, "fragment0_spread": spreads,
            "outer_fragment0_change": moves, "outer_abs_sum": outer}


def _ratio_interval(a, b) -> dict:
    ci = _paired_interval(a, b)
    return {"ratio": ci["mean"], "ratio_low": ci["lo"], "ratio_high": ci["hi"]}


def run_nonsync(sizes, reps: int, sync_period: int, num_fragments: int, dtype: str = "float32",
                trace: str | None = None, save=lambda result: None) -> dict:
    """`nonsync` per size; `save(result)` gets the whole result so far after each phase."""
    if trace is not None:
        import jax

        if jax.default_backend() == "cpu":
            raise SystemExit("--trace: needs an accelerator (XLA:CPU's trace has no device timeline to "
                             "summarize); this machine's backend is cpu")
    out, settings = {}, {**_settings_and_machine(sync_period, num_fragments, reps), "dtype": dtype}

    def report(name, result):
        out[name] = result
        save({"nonsync": out, **settings})

    for size in sizes:
        folder = None if trace is None else os.path.join(trace, size.name)
        out[size.name] = nonsync(_model(size, dtype), size, 2, sync_period, num_fragments, reps, folder,
                                 report=partial(report, size.name))
    return {"nonsync": out, **settings}


def format_nonsync(result: dict) -> str:
    from tools import trace_gaps

    lines = []
    for size, c in result.items():
        lines.append(f"{size} non-sync step / plain (full batch, mean [95%], {c['reps']} paired reps; plain "
                     f"{1e3 * c['plain_s']:.2f} ms): " + ", ".join(
                         f"{m} {r['ratio']:.4f} [{r['ratio_low']:.4f}, {r['ratio_high']:.4f}]"
                         for m, r in c["modes"].items()))
        lines += [_format_events(size, m, e) for m, e in c.get("events", {}).items()]
        if "trace" in c:
            lines += [f"{size} traced steps (medians of 3):", trace_gaps.format_summary(c["trace"])]
        if "trace_error" in c:
            lines.append(f"{size} trace failed: {c['trace_error']}")
    return "\n".join(lines)


def _format_events(size: str, mode: str, e: dict) -> str:
    figures = lambda xs: ", ".join(f"{x:.3g}" for x in xs)  # noqa: E731
    text = (f"{size} events at t = {e['ends'][0]}..{e['ends'][-1]}, {mode}: islands' largest difference over "
            f"fragment 0 after each step {figures(e['fragment0_spread'])} (expected 0 at the apply, "
            f"t = {e['applied_at']}, and only there)")
    if "outer_fragment0_change" in e:
        text += (f"; outer fragment 0's change in each step {figures(e['outer_fragment0_change'])} "
                 f"(expected above 0 at t = {e['applied_at']} and only there)")
    return text + f"; outer Σ|θ| {e['outer_abs_sum']:.6g}"


def run_exchange_placement(sizes, reps: int, sync_period: int, num_fragments: int) -> dict:
    _require_cpu("--exchange-placement", "compares the CPU default with the free placement")
    out = {size.name: exchange_placement(_model(size), size, 2, sync_period, num_fragments, reps) for size in sizes}
    return {"exchange_placement": out, **_settings_and_machine(sync_period, num_fragments, reps)}


def format_exchange_placement(result: dict) -> str:
    lines = []
    for size, c in result.items():
        lines.append(f"{size} extra / expected, allocated (live at the peak): " + ", ".join(
            f"{v} {m['extra_bytes'] / m['expected_extra_bytes']:.4f}"
            + ("" if m["live_extra_bytes"] is None else f" ({m['live_extra_bytes'] / m['expected_extra_bytes']:.4f})")
            for v, m in c["memory"].items()))
        lines.append(f"{size} step time, after_inner / free (mean [95%], {c['reps']} paired reps): " + ", ".join(
            f"{name} {t['time_ratio']:.3f} [{t['time_ratio_low']:.3f}, {t['time_ratio_high']:.3f}] "
            f"({1e3 * t['free_s']:.0f} ms)" for name, t in c["times"].items()))
    return "\n".join(lines)


def run_sync_cost(sizes, reps: int, sync_period: int, num_fragments: int, dtype: str = "float32",
                  fragment_order: str | None = None, compare_order: str | None = None,
                  delayed_outer: str | None = None) -> dict:
    costs = {size.name: sync_cost(_model(size, dtype), 2, sync_period, num_fragments, reps, fragment_order,
                                  compare_order, delayed_outer) for size in sizes}
    return {"sync_cost": costs, **_settings_and_machine(sync_period, num_fragments, reps), "dtype": dtype}


def _check_order(parser: argparse.ArgumentParser, name: str, flag: str = "--fragment-order") -> None:
    """Refuse a fragment order that is not registered, before anything runs."""
    from diloco_eqx.orders import resolve_order

    try:
        resolve_order(name)
    except (KeyError, ValueError) as e:
        parser.error(f"{flag}: {e}")


HOST_MEMORY = ("keep", "default")
"""Host-memory settings compared: freed memory kept for reuse, or glibc's default."""
HOST_MEMORY_PHASES = ("plain", "nonsync", "sync")


def run_host_memory(sizes, reps: int, sync_period: int) -> dict:
    """Full-batch steps under each host-memory setting (`host_memory_cost`) for each size."""
    from diloco_eqx import host_memory

    if not host_memory.available():
        raise SystemExit("--host-memory: compares glibc's malloc settings; this process does not run on glibc")
    costs = {size.name: host_memory_cost(size, reps, sync_period) for size in sizes}
    return {"host_memory": costs, **_settings_and_machine(sync_period, 1, reps, overlap_steps=0)}


def host_memory_cost(size: Size, reps: int, sync_period: int) -> dict:
    """The plain step and vanilla DiLoCo (K = 2) off and on a sync, full batch, with freed host
    memory kept for reuse and as glibc leaves it: each setting must be made before JAX starts,
    so each has a worker process of its own, and this one asks them for one step at a time,
    the two settings in alternating order; each repetition is a pair. Per phase and setting:
    median seconds, page faults and system CPU seconds of a step; and the mean of the paired
    ratios default ÷ keep with its 95% Student-t interval."""
    import subprocess

    from diloco_eqx import host_memory

    cmd = [sys.executable, "-m", "tools.benchmark", "--sizes", size.name, "--sync-period", str(sync_period)]
    workers = {s: subprocess.Popen([*cmd, "--host-memory-worker", s], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=host_memory.without_malloc_settings(dict(os.environ))) for s in HOST_MEMORY}

    def ask(s: str, phase: str | None = None) -> str:
        try:
            if phase is not None:
                workers[s].stdin.write(phase + "\n")
                workers[s].stdin.flush()
            line = workers[s].stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"the --host-memory worker ({s}) for {size.name} exited; run it alone to see why: "
                               + " ".join([*cmd, "--host-memory-worker", s]))
        return line

    try:
        for s in HOST_MEMORY:
            if ask(s).strip() != "ready":  # its steps are compiled
                raise RuntimeError(f"the --host-memory worker ({s}) wrote something other than 'ready'")
        got = {(s, p): [] for s in HOST_MEMORY for p in HOST_MEMORY_PHASES}
        for rep in range(reps + 1):  # the first round warms the heap up
            for s in HOST_MEMORY[::(-1) ** rep]:
                for phase in HOST_MEMORY_PHASES:
                    out = json.loads(ask(s, phase))
                    if rep:
                        got[(s, phase)].append(out)
        for w in workers.values():
            w.stdin.close()
            if w.wait(timeout=120) != 0:
                raise RuntimeError(f"a --host-memory worker for {size.name} exited with {w.returncode}")
    finally:
        for w in workers.values():
            if w.poll() is None:
                w.kill()
                w.wait()
    return {"phases": {phase: _host_memory_phase(got, phase) for phase in HOST_MEMORY_PHASES}, "pairs": reps}


def _host_memory_phase(got: dict, phase: str) -> dict:
    """One phase's medians per setting and its paired ratios default ÷ keep, with their mean
    and 95% Student-t interval."""
    import numpy as np

    from experiments.stats import interval

    per = {s: {k: float(np.median([o[k] for o in got[(s, phase)]])) for k in ("s", "faults", "sys_s", "user_s")}
           for s in HOST_MEMORY}
    ratios = [d["s"] / k["s"] for d, k in zip(got[("default", phase)], got[("keep", phase)])]
    ci = interval(ratios)
    return {**per, "ratios": ratios, "ratio_mean": ci["mean"], "ratio_low": ci["lo"], "ratio_high": ci["hi"]}


def _host_memory_worker(size: Size, sync_period: int) -> None:
    """One side of `host_memory_cost`: runs the step named on each line of stdin and answers
    with a JSON line of its seconds, page faults and system CPU seconds."""
    import resource

    import jax
    import numpy as np
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.models.transformer import loss_fn

    model, inner = _model(size), optax.adamw(1e-3)
    batch = np.random.default_rng(0).integers(0, 256, (size.global_batch, size.seq_len + 1), dtype=np.int32)
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=sync_period)
    steps = {"plain": list(make_plain_step(model, loss_fn, inner, 2)),
             "diloco": [dl.init_state(model, inner, cfg), dl.make_train_step(cfg, loss_fn, inner)]}
    placed = {name: step.place_batch(batch) for name, (_, step) in steps.items()}
    step_at = {"nonsync": 5, "sync": sync_period}

    def run(phase):
        name = "plain" if phase == "plain" else "diloco"
        state, step = steps[name]
        if phase in step_at:
            state = _ending_at(state, step_at[phase])
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        state, _ = step.step_placed(state, placed[name])
        steps[name][0] = jax.block_until_ready(state)
        seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        return {"s": seconds, "faults": after.ru_minflt - before.ru_minflt, "sys_s": after.ru_stime - before.ru_stime,
                "user_s": after.ru_utime - before.ru_utime}

    for phase in HOST_MEMORY_PHASES * 3:  # compiled, and the heap grown to the steps' needs
        run(phase)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(run(line.strip())), flush=True)


def format_host_memory(costs: dict) -> str:
    lines = []
    for name, c in costs.items():
        for phase, p in c["phases"].items():
            k, d = p["keep"], p["default"]
            lines.append(f"{name} {phase}: kept {1e3 * k['s']:.0f} ms ({k['faults']:.0f} page faults, "
                         f"{1e3 * k['sys_s']:.0f} ms system), glibc's default {1e3 * d['s']:.0f} ms "
                         f"({d['faults']:.0f} page faults, {1e3 * d['sys_s']:.0f} ms system); default ÷ kept "
                         f"{p['ratio_mean']:.3f} [{p['ratio_low']:.3f}, {p['ratio_high']:.3f}] over {c['pairs']} pairs")
    return "\n".join(lines)


def run_cpu_orders(sizes, reps: int, sync_period: int, num_fragments: int) -> dict:
    _require_cpu("--cpu-orders", "compares XLA:CPU's orders")
    orders = {}
    for size in sizes:
        orders[size.name] = cpu_orders(_model(size), size, 2, sync_period, num_fragments, reps)
    return {"cpu_orders": orders, **_settings_and_machine(sync_period, num_fragments, reps)}


def _settings_and_machine(sync_period: int, num_fragments: int, reps: int, overlap_steps: int = 1) -> dict:
    """What a sync-cost, cpu-orders, non-sync or host-memory JSON records of its settings and
    machine (K = 2), XLA's flags among them (two runs may differ only in those)."""
    import jax

    from diloco_eqx import host_memory

    return {"settings": {"num_replicas": 2, "sync_period": sync_period, "num_fragments": num_fragments,
                         "overlap_steps": overlap_steps, "reps": reps},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "jax": jax.__version__,
                        "libc": " ".join(platform.libc_ver()), "transparent_huge_pages": host_memory.transparent_huge_pages(),
                        "keep_host_memory": host_memory.kept(), "device": jax.devices()[0].device_kind,
                        "xla_flags": os.environ.get("XLA_FLAGS", "")}}


def _model(size: Size, dtype: str = "float32"):
    """The benchmark's transformer of `size`, its parameters in `dtype` (seed 0)."""
    import equinox as eqx
    import jax

    from diloco_eqx.models.transformer import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(num_layers=size.layers, width=size.width,
                                          num_heads=size.heads, seq_len=size.seq_len), jax.random.key(0))
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)


def format_orders(orders: dict) -> str:
    lines = []
    for size, c in orders.items():
        for order, modes in c["modes"].items():
            lines.append(f"{size} {order} order: plain resident {c['resident_bytes'][order]['plain']:,} B; extra / "
                         "expected: " + ", ".join(f"{m} {v['extra_bytes'] / v['expected_extra_bytes']:.3f}"
                                                  for m, v in modes.items()))
        lines.append(f"{size} step time, memory / concurrency order (mean [95%], {c['reps']} paired reps): " + ", ".join(
            f"{k} {v['time_ratio']:.3f} [{v['time_ratio_low']:.3f}, {v['time_ratio_high']:.3f}]"
            for k, v in c["times"].items()))
    return "\n".join(lines)


class _InPlaceTimer:
    """Jitted functions each called on the carry the last call left (donated, so updated in
    place): each call times one run. The references a sync is compared with are timed this
    way inside the repetitions of the steps, not once on their own."""

    def __init__(self, runs: dict, carry, keep=lambda out: out):
        import jax

        self.runs, self.keep = runs, keep
        self.carry = carry
        for name in runs:  # compiled and warm
            self.carry = keep(jax.block_until_ready(runs[name](self.carry)))

    def __call__(self, name: str) -> float:
        import jax

        t0 = time.perf_counter()
        self.carry = self.keep(jax.block_until_ready(self.runs[name](self.carry)))
        return time.perf_counter() - t0


def _handwritten_syncs(model, k: int, cfg) -> _InPlaceTimer:
    """A vanilla sync's arithmetic written by hand as one jitted function on donated arrays
    (every island finite and contributing): the mean of the K pseudo-gradients as a chain of
    adds, the outer Nesterov step, the two diagnostic norms and the new outer model written
    into every island ("by_hand"). What XLA makes of the sync without the step's schedule,
    masks and fault handling: the step's own sync is compared with it. Without the norms
    ("minimal"), the least arithmetic a sync is: what the backend can do against the floor,
    whatever the step does. Both run on one carry (K + 2 model-sized float32 buffers)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    outer = jax.tree.map(jnp.asarray, eqx.filter(model, eqx.is_inexact_array))

    def sync(islands, outer, opt, norms: bool):
        mean = jax.tree.map(lambda o, i: o - sum(i[j] for j in range(k)) / k, outer, islands)
        update, opt = tx.update(mean, opt, outer)
        new = optax.apply_updates(outer, update)
        islands = jax.tree.map(lambda o, i: jnp.broadcast_to(o, i.shape).astype(i.dtype), new, islands)
        if not norms:
            return islands, new, opt
        return islands, new, opt, optax.tree.norm(mean), optax.tree.norm(update)  # outputs: computed

    runs = {name: jax.jit(lambda args, norms=norms: sync(*args, norms), donate_argnums=0)
            for name, norms in (("by_hand", True), ("minimal", False))}
    islands = jax.tree.map(lambda x: jnp.stack([x] * k), outer)
    return _InPlaceTimer(runs, (islands, jax.tree.map(lambda x: x + 0, outer), tx.init(outer)), keep=lambda out: out[:3])


def _stream_floor(values: int) -> _InPlaceTimer:
    """One fused, in-place pass that reads and writes `values` float32 values ("floor"). A
    buffer of its own: over the front of a larger one, XLA:CPU would write on one thread."""
    import jax
    import jax.numpy as jnp

    touch = jax.jit(lambda x: x * 1.0000001 + 1e-9, donate_argnums=0)
    return _InPlaceTimer({"floor": touch}, jnp.ones((values,), jnp.float32))


def _bfloat16_memory(model, inner, k, sync_period, size) -> dict:
    """Memory of plain and vanilla DiLoCo steps for the model in bfloat16 (no mesh): the
    extra is 2·|Θ|·4 bytes, since the outer model and trace stay float32."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import diloco_eqx as dl
    from diloco_eqx.analysis import profiling
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.models.transformer import count_params, loss_fn

    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)
    batch = np.zeros((size.global_batch, size.seq_len + 1), np.int32)
    cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period)
    plain_state, plain_step = make_plain_step(model, loss_fn, inner, k)
    plain = profiling.memory(plain_step.lower(plain_state, batch).compile())["resident_bytes"]
    state = dl.init_state(model, inner, cfg)
    diloco = profiling.memory(
        dl.make_train_step(cfg, loss_fn, inner).lower(state, batch).compile())["resident_bytes"]
    return _bfloat16_row(plain, diloco, count_params(model))


def _bfloat16_row(plain: int, diloco: int, n: int) -> dict:
    return {"param_dtype": "bfloat16", "outer_dtype": "float32", "params": n,
            "plain_bytes": plain, "diloco_bytes": diloco, "extra_bytes": diloco - plain,
            "expected_extra_bytes": 2 * n * 4, "param_bytes_bfloat16": 2 * n}


def _model_flops(size: Size, n_params: int) -> float:
    """Model FLOPs of one training step by the usual count: 6 per parameter per token
    (forward and backward matmuls) plus 12·layers·width·seq_len per token for attention's
    scores and weighted sums, counted over the full square as is customary. Unlike XLA's
    count it is the same for every compiler and needs no cost analysis of the scanned layers."""
    tokens = size.global_batch * size.seq_len
    return float(tokens * (6 * n_params + 12 * size.layers * size.width * size.seq_len))


def _compiled_and_live(lowered):
    """The executable and its live-range peak (`profiling.live_peak`) on CPU; elsewhere the
    executable alone, taken from JAX's cache of the step already run: the peak needs a second
    compile with a dump, which on an accelerator costs more device time than it tells."""
    import jax

    from diloco_eqx.analysis import profiling

    if jax.default_backend() == "cpu":
        return profiling.live_peak(lowered)
    return lowered.compile(), None


def _mode(mode: str, backend: str) -> str:
    return mode if backend == "shard_map" else f"{mode}_{backend}"


def _ending_at(state, t_end: int, mesh=None):
    """`state` with its global step set so that the next step ends at t_end (t = t_end − 1,
    replicated on `mesh`), computed before any timing starts."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from diloco_eqx import mesh as islands

    t = islands.place(jnp.asarray(t_end - 1, jnp.int32), mesh, islands.REPLICATED)
    return jax.block_until_ready(eqx.tree_at(lambda s: s.step, state, t))


def _bench_mesh(name: str):
    """The mesh a MESHES name stands for (None: no mesh)."""
    import diloco_eqx as dl

    return None if MESHES[name] is None else dl.make_mesh(**MESHES[name])


def _step_memory_of(step, state, batch) -> tuple[dict, object]:
    """A compiled step's memory analysis with its live-range peak, and the executable."""
    from diloco_eqx.analysis import profiling

    compiled, live = _compiled_and_live(step.lower(state, batch))
    return {**profiling.memory(compiled), "live_peak_bytes": live}, compiled


def _matmul_flops(n=None, reps=10, dtype=None) -> float:
    """FLOP/s of an n×n matmul in `dtype` (n = 8192 on an accelerator, 1024 on CPU)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = n or (1024 if jax.default_backend() == "cpu" else 8192)
    f = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((n, n), dtype or jnp.float32)
    jax.block_until_ready(f(a, a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        ts.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(ts))


def _row(size, mesh, mode, phase, ts, plain, paired=None):
    """One table row; with `paired` (plain's times in the same repetitions), also the mean
    ratio of each repetition's time to plain's with its 95% t-interval."""
    import numpy as np

    median = float(np.median(ts))
    backend = "drjax" if mode.endswith("_drjax") else "shard_map"
    row = {"size": size, "mesh": mesh, "mode": mode, "backend": backend, "phase": phase, "median_s": median,
           "p10_s": float(np.percentile(ts, 10)), "p90_s": float(np.percentile(ts, 90)),
           "n": len(ts), "ratio_to_plain": median / plain}
    if paired is not None:
        ci = _paired_interval(ts, paired)
        row.update(paired_ratio=ci["mean"], paired_ratio_low=ci["lo"], paired_ratio_high=ci["hi"])
    return row


def format_table(result: dict) -> str:
    lines = [f"{'size':>5} {'mesh':>13} {'mode':>16} {'phase':>9} {'median ms':>10} "
             f"{'p10-p90 ms':>15} {'ratio':>7}  paired ratio [95%]"]
    for r in result["rows"]:
        paired = (f"  {r['paired_ratio']:.3f} [{r['paired_ratio_low']:.3f}, {r['paired_ratio_high']:.3f}]"
                  if "paired_ratio" in r else "")
        lines.append(f"{r['size']:>5} {r['mesh']:>13} {r['mode']:>16} {r['phase']:>9} "
                     f"{1e3 * r['median_s']:>10.2f} {1e3 * r['p10_s']:>7.2f}-{1e3 * r['p90_s']:<7.2f}"
                     f"{r['ratio_to_plain']:>7.3f}{paired}")
    lines.append("")
    for key, c in result["compile"].items():
        lines.append(f"compilations of the step over {c['steps']} steps (>= 2·H_eff), {key}: "
                     f"{c['count']} ({c['compile_s']:.1f} s to compile)")
    for key, m in result["memory"]["all"].items():
        lines.append(f"memory {key}: args {m['argument_bytes']:,} temps {m['temp_bytes']:,} "
                     f"resident {m['resident_bytes']:,} B")
    for key, s in result["sizes"].items():
        plain = result["memory"]["all"][f"{key}/plain"]["resident_bytes"]
        for mode in [m for m in ("diloco", "diloco_drjax") if f"{key}/{m}" in result["memory"]["all"]]:
            extra = result["memory"]["all"][f"{key}/{mode}"]["resident_bytes"] - plain
            lines.append(f"{key} {mode}: extra resident {extra:,} B per device vs 2·|Θ|·4/(n·m) = "
                         f"{s['expected_extra_bytes']:,} B (ratio {extra / s['expected_extra_bytes']:.3f})")
        lines.append(f"{key}: {s['params']:,} params, inner step {s['inner_flops_per_s'] / 1e9:.2f} "
                     f"GFLOP/s vs matmul {s['matmul_flops_per_s'] / 1e9:.2f} GFLOP/s: "
                     f"utilisation {s['utilisation']:.2f}" + ("" if "model_flops_per_step" not in s else
                     f"; model FLOPs {s['model_flops_per_step'] / 1e9:.1f} G per step = "
                     f"{s['model_flops_utilisation']:.3f} of the matmul's rate (MFU)"))
    lines += _format_sync_cost(result.get("sync_cost", {}))
    for key, m in result["memory"]["modes"].items():
        live = m.get("live_extra_bytes")
        lines.append(f"memory mode {key}: extra {m['extra_bytes']:,} B vs expected {m['expected_extra_bytes']:,} B "
                     f"(ratio {m['extra_bytes'] / m['expected_extra_bytes']:.3f})" + (
                         "" if live is None else f"; live at the peak {live:,} B "
                                                 f"(ratio {live / m['expected_extra_bytes']:.4f})"))
    low = result["memory"].get("bfloat16")
    if low:
        lines.append(f"bfloat16 islands, float32 outer (vanilla, no mesh): extra resident "
                     f"{low['extra_bytes']:,} B vs 2·|Θ|·4 = {low['expected_extra_bytes']:,} B "
                     f"(ratio {low['extra_bytes'] / low['expected_extra_bytes']:.3f}; "
                     f"2·|Θ|·2 would be {2 * low['param_bytes_bfloat16']:,} B)")
    return "\n".join(lines)


def _format_sync_cost(costs: dict) -> list[str]:
    lines = []
    for name, c in costs.items():
        lines.append(f"{name} sync cost (no mesh, 2x8-token batch, paired medians): floor {1e3 * c['floor_s']:.1f} ms "
                     f"for {c['floor_bytes'] / 1e6:.0f} MB; vanilla sync +{1e3 * c['vanilla_sync_extra_s']:.1f} ms "
                     f"= {c['vanilla_extra_over_floor']:.2f}x floor ({c['vanilla_extra_over_handwritten']:.2f}x the "
                     f"same sync written by hand, {1e3 * c['handwritten_sync_s']:.1f} ms = "
                     f"{c['handwritten_over_floor']:.2f}x floor"
                     + ("" if "minimal_sync_s" not in c else
                        f"; without its two norms {1e3 * c['minimal_sync_s']:.1f} ms = {c['minimal_over_floor']:.2f}x floor")
                     + ("" if "paired" not in c else
                        "; paired, mean [95%]: " + ", ".join(f"{name} {r['mean']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
                                                             for name, r in c["paired"].items()))
                     + "); streaming sync (stash + exchange) "
                     f"+{1e3 * c['streaming_sync_extra_s']:.1f} ms = {c['streaming_over_vanilla']:.2f} of vanilla's "
                     f"(1/P = {c['one_over_p']:.2f}); non-sync step +{1e3 * c['diloco_nonsync_extra_s']:.1f} / "
                     f"+{1e3 * c['streaming_nonsync_extra_s']:.1f} ms over plain ({1e3 * c['plain_s']:.0f} ms)"
                     + "".join(f"; {m} non-sync / plain {r['mean']:.4f} [{r['low']:.4f}, {r['high']:.4f}]"
                               for m in ("diloco", "streaming") if (r := c.get(f"{m}_nonsync_ratio"))))
        order = f"{c['fragment_order']} order; " if "fragment_order" in c else ""
        lines.append(f"{name} streaming sync per fragment ({order}stash + exchange and apply, ÷ vanilla's; share of Θ): " + ", ".join(
            f"{p['fragment']}: {1e3 * p['stash_extra_s']:.1f} + {1e3 * p['exchange_apply_extra_s']:.1f} ms = "
            f"{p['over_vanilla']:.2f} ({p['param_fraction']:.2f})" for p in c["streaming_per_fragment"])
            + f"; mean over a cycle {1e3 * c['streaming_cycle_extra_s']:.1f} ms = "
              f"{c['streaming_cycle_over_vanilla']:.2f} of vanilla's (1/P = {c['one_over_p']:.2f})"
            + ("" if "streaming_floor_s" not in c else
               f"; its own floor {1e3 * c['streaming_floor_s']:.1f} ms for {c['streaming_floor_bytes'] / 1e6:.0f} MB "
               f"({c['streaming_floor_over_vanilla_floor']:.2f} of vanilla's bytes): cycle = "
               f"{c['streaming_cycle_over_floor']:.2f}x its floor"))
        if "streaming_v0_per_fragment" in c:
            lines.append(f"{name} streaming V = 0 sync per fragment (sync and apply in one step, ÷ vanilla's; share of Θ): "
                         + ", ".join(f"{p['fragment']}: {1e3 * p['sync_apply_extra_s']:.1f} ms = {p['over_vanilla']:.2f} "
                                     f"({p['param_fraction']:.2f})" for p in c["streaming_v0_per_fragment"])
                         + f"; mean over a cycle {1e3 * c['streaming_v0_cycle_extra_s']:.1f} ms = "
                           f"{c['streaming_v0_cycle_over_vanilla']:.2f} of vanilla's; a cycle ÷ vanilla's, paired by cycle, "
                           "mean [95%]: " + ", ".join(
                               f"{m} {r['mean']:.2f} [{r['low']:.2f}, {r['high']:.2f}] over {r['cycles']} cycles "
                               f"(≤ 1/P = {c['one_over_p']:.2f}: {r['at_most_one_over_p']})"
                               for m, r in c["cycle_over_vanilla_paired"].items()))
        if (dl_ := c.get("delayed")) is not None:
            d = dl_["layer_sync_minus_v0_s"]
            lines.append(
                f"{name} V = 0 sync per fragment with delayed_outer={dl_['delayed_outer']!r} (÷ vanilla's): " + ", ".join(
                    f"{p['fragment']}: {1e3 * p['sync_apply_extra_s']:.1f} ms = {p['over_vanilla']:.2f}"
                    for p in dl_["per_fragment"])
                + f"; mean over a cycle {1e3 * dl_['cycle_extra_s']:.1f} ms; a layer fragment's sync minus V = 0's: "
                  f"{1e3 * d['mean']:+.2f} ms [{1e3 * d['low']:+.2f}, {1e3 * d['high']:+.2f}] over {d['n']} reps "
                  f"({dl_['layer_sync_over_v0']:.2f}x V = 0's)")
        if (o := c.get("compared_order")) is not None:
            d = o["layer_sync_difference_s"]
            lines.append(
                f"{name} streaming sync per fragment, {o['fragment_order']} order in the same repetitions: " + ", ".join(
                    f"{p['fragment']}: {1e3 * p['stash_extra_s']:.1f} + {1e3 * p['exchange_apply_extra_s']:.1f} ms = "
                    f"{p['over_vanilla']:.2f} ({p['param_fraction']:.2f})" for p in o["streaming_per_fragment"])
                + f"; mean over a cycle {1e3 * o['streaming_cycle_extra_s']:.1f} ms = "
                  f"{o['streaming_cycle_over_vanilla']:.2f} of vanilla's; a layer fragment's sync, "
                  f"{c['fragment_order']} minus {o['fragment_order']}: {1e3 * d['mean']:+.2f} ms "
                  f"[{1e3 * d['low']:+.2f}, {1e3 * d['high']:+.2f}] over {d['n']} reps "
                  f"({o['fragment_order']} cheaper: {o['compared_is_cheaper']})")
    return lines


if __name__ == "__main__":
    main()
    sys.exit(0)
