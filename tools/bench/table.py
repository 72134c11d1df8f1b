"""The step table: for every size and mesh, each mode's phases and amortized step timed side
by side, its compile count, memory and FLOPs.

Phases are timed one step at a time, interleaved across modes, with the global step t set so
that the step ends on a sync, an apply, or neither; "amortized" runs H_eff consecutive steps.
Medians with the 10th–90th percentile spread, and each phase's mean ratio to plain's step
in the same repetition."""

from __future__ import annotations

import os
import platform
import time

from tools.bench import common, steps
from tools.bench.memory import memory_by_mode
from tools.bench.sync_cost import sync_cost


def run(sizes, meshes, reps, sync_period, num_fragments, amortized_blocks=2, backends=("shard_map",),
        dtype="float32", with_sync_cost=True) -> dict:
    """The step table of every size and mesh; then each size's sync cost and, for the first
    size and mesh, every mode's extra memory against its formula."""
    import jax
    import jax.numpy as jnp
    import optax

    k, inner = common.K, optax.adamw(1e-3)
    rows, memory, compilations, checks = [], {}, {}, {}
    matmul = common.matmul_flops(dtype=jnp.dtype(dtype))
    for size in sizes:
        m = common.model(size, dtype)
        for mesh_name in meshes:
            label = f"{size.name}/{mesh_name}"
            table = step_table(m, size, mesh_name, inner, sync_period, num_fragments, reps, amortized_blocks, backends)
            rows += table["rows"]
            memory.update({f"{label}/{mode}": v for mode, v in table["memory"].items()})
            compilations.update({f"{label}/{mode}": c for mode, c in table["compile"].items()})
            checks[label] = size_checks(size, table, matmul)
    costs = {s.name: sync_cost(common.model(s, dtype), k, sync_period, num_fragments, reps=max(reps, 10))
             for s in sizes} if with_sync_cost else {}
    return {
        "compilations": max(c["count"] for c in compilations.values()),
        "memory": memory_by_mode(sizes[0], meshes[0], checks, memory, inner, sync_period, num_fragments,
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


class StepRunner:
    """Each mode's state and step on one batch, placed once: `call` runs one step and counts
    its compilations, `set_step` moves a mode's global step so the next call ends where a
    phase needs it."""

    def __init__(self, modes: dict, batch, mesh):
        from diloco_eqx.analysis import profiling

        self.steps, self.mesh, self.batch = modes, mesh, batch
        self.placed = {mode: step.place_batch(batch) for mode, (_, step) in modes.items()}
        self.counts = {mode: profiling.CompileCount() for mode in modes}
        self.calls = dict.fromkeys(modes, 0)

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
        self.steps[mode] = [state, step]

    def set_step(self, mode: str, t_end: int) -> None:
        """The next call of `mode` is the step ending at t_end."""
        self.steps[mode][0] = steps.ending_at(self.steps[mode][0], t_end, self.mesh)


def step_table(m, size: common.Size, mesh_name: str, inner, sync_period: int, num_fragments: int,
               reps: int, amortized_blocks: int, backends) -> dict:
    """One size on one mesh: every mode's rows (phases, then amortized), compile counts,
    memory of its compiled step, and plain's FLOPs and median step time."""
    import numpy as np

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import count_params

    mesh = common.bench_mesh(mesh_name)
    vanilla = dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period)
    streaming = dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period, streaming=True,
                                num_fragments=num_fragments, overlap_steps=1)
    runner = StepRunner(bench_steps(m, inner, mesh, vanilla, streaming, backends), common.batch(size), mesh)
    for mode in runner.steps:  # first call: compiles
        runner.call(mode)
    va, st = dl.Schedule.from_config(vanilla), dl.Schedule.from_config(streaming)
    times = phase_times(runner, phase_jobs(va, st, backends, num_fragments), reps)
    diloco_modes = [mode for mode in runner.steps if mode not in ("plain", "ddp")]
    amort = amortized_times(runner, ["plain", *diloco_modes], max(va.period, st.period), amortized_blocks)
    compile_counts = {mode: {"count": runner.counts[mode].count, "compile_s": runner.counts[mode].seconds,
                             "steps": runner.calls[mode]} for mode in diloco_modes}
    memory, plain_flops = step_memory(runner)
    plain_times = times[("plain", "step")]
    plain_median, amort_plain = float(np.median(plain_times)), float(np.median(amort["plain"]))
    rows = [row(size.name, mesh_name, mode, phase, ts, plain_median, plain_times) for (mode, phase), ts in times.items()]
    rows += [row(size.name, mesh_name, mode, "amortized", ts, amort_plain) for mode, ts in amort.items()]
    return {"rows": rows, "compile": compile_counts, "memory": memory, "mesh": mesh, "plain_flops": plain_flops,
            "plain_median_s": plain_median, "params": count_params(m)}


def bench_steps(m, inner, mesh, vanilla, streaming, backends) -> dict:
    """The steps under test, by mode: plain, DDP, and vanilla and Streaming DiLoCo on every backend."""
    out = {"plain": steps.plain(m, inner, common.K, mesh), "ddp": steps.ddp(m, inner, common.K, mesh)}
    for backend in backends:
        for mode, cfg in (("diloco", vanilla), ("streaming", streaming)):
            out[common.mode_name(mode, backend)] = steps.diloco(m, inner, cfg, mesh, backend)
    return out


def phase_jobs(vanilla, streaming, backends, num_fragments: int) -> dict[tuple[str, str], list[int | None]]:
    """For each (mode, phase), the global steps its timed steps end at, taken in turn
    (None: wherever the mode is): a sync, a Streaming sync and apply of every fragment, or
    neither (t = 5)."""
    dh = streaming.steps_between_syncs
    jobs: dict[tuple[str, str], list[int | None]] = {("plain", "step"): [None], ("ddp", "step"): [None]}
    for backend in backends:
        va, st = common.mode_name("diloco", backend), common.mode_name("streaming", backend)
        jobs.update({
            (va, "nonsync"): [5],
            (va, "sync"): [vanilla.period],
            (st, "nonsync"): [5],
            (st, "sync"): [dh * j for j in range(1, num_fragments + 1)],
            (st, "apply"): [dh * j + 1 for j in range(1, num_fragments + 1)],
        })
    return jobs


def phase_times(runner: StepRunner, jobs: dict, reps: int) -> dict:
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


def amortized_times(runner: StepRunner, modes: list[str], period: int, blocks: int) -> dict:
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


def step_memory(runner: StepRunner) -> tuple[dict, float]:
    """Memory of each mode's compiled step (the executables already run), and plain's FLOPs."""
    from diloco_eqx.analysis import profiling

    memory, plain_flops = {}, None
    for mode, (state, step) in runner.steps.items():
        memory[mode], compiled = steps.memory_of(step, state, runner.batch)
        if mode == "plain":
            plain_flops = profiling.flops(compiled)
    return memory, plain_flops


def size_checks(size: common.Size, table: dict, matmul_flops: float) -> dict:
    """What one size on one mesh measured against the machine: extra memory, FLOP rates, MFU."""
    from diloco_eqx import mesh as islands

    mesh, memory, n = table["mesh"], table["memory"], table["params"]
    devices = 1 if mesh is None else mesh.size
    plain_flops, plain_median = table["plain_flops"] * devices, table["plain_median_s"]
    model_flops = common.model_flops(size, n)
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


def row(size, mesh, mode, phase, ts, plain, paired=None) -> dict:
    """One table row; with `paired` (plain's times in the same repetitions), also the mean
    ratio of each repetition's time to plain's with its 95% t-interval."""
    import numpy as np

    median = float(np.median(ts))
    backend = "drjax" if mode.endswith("_drjax") else "shard_map"
    out = {"size": size, "mesh": mesh, "mode": mode, "backend": backend, "phase": phase, "median_s": median,
           "p10_s": float(np.percentile(ts, 10)), "p90_s": float(np.percentile(ts, 90)),
           "n": len(ts), "ratio_to_plain": median / plain}
    if paired is not None:
        ci = common.paired_interval(ts, paired)
        out.update(paired_ratio=ci["mean"], paired_ratio_low=ci["lo"], paired_ratio_high=ci["hi"])
    return out
