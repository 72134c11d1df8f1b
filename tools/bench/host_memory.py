"""Full-batch steps with freed host memory kept for reuse (as training runs keep it:
`diloco_eqx.training.host_memory`) and returned as glibc does by default, side by side in two
worker processes (glibc only): each setting must be made before JAX starts.

The plain step and vanilla DiLoCo (K = 2) off and on a sync; the parent asks the workers for
one step at a time, the two settings in alternating order, each repetition a pair. Per phase
and setting: median seconds, page faults and system CPU seconds of a step; and the mean of
the paired ratios default ÷ keep with its 95% Student-t interval."""

from __future__ import annotations

import os

from tools.bench import common, steps, workers

HOST_MEMORY = ("keep", "default")
"""Host-memory settings compared: freed memory kept for reuse, or glibc's default."""
PHASES = ("plain", "nonsync", "sync")


def run_host_memory(sizes, reps: int, sync_period: int) -> dict:
    """`host_memory_cost` for each size, with the settings and machine."""
    from diloco_eqx.training import host_memory as malloc_settings

    if not malloc_settings.available():
        raise SystemExit("--host-memory: compares glibc's malloc settings; this process does not run on glibc")
    costs = {size.name: host_memory_cost(size, reps, sync_period) for size in sizes}
    return {"host_memory": costs, **common.settings_and_machine(sync_period, 1, reps, overlap_steps=0)}


def host_memory_cost(size: common.Size, reps: int, sync_period: int) -> dict:
    """Both settings' steps of one size, paired (each setting runs its three phases in turn)."""
    from diloco_eqx.training import host_memory as malloc_settings

    env = malloc_settings.without_malloc_settings(dict(os.environ))
    args = ["--sizes", size.name, "--sync-period", str(sync_period)]
    with workers.Workers(args, "--host-memory-worker", dict.fromkeys(HOST_MEMORY, env), size.name) as w:
        got = workers.paired_steps(w, PHASES, reps, phase_major=False)  # the first round warms the heap up
        w.close()
    return {"phases": {phase: host_memory_phase(got, phase) for phase in PHASES}, "pairs": reps}


def host_memory_phase(got: dict, phase: str) -> dict:
    """One phase's medians per setting and its paired ratios default ÷ keep, with their mean
    and 95% Student-t interval."""
    import numpy as np

    from experiments.stats import interval

    per = {s: {k: float(np.median([o[k] for o in got[(s, phase)]])) for k in ("s", "faults", "sys_s", "user_s")}
           for s in HOST_MEMORY}
    ratios = [d["s"] / k["s"] for d, k in zip(got[("default", phase)], got[("keep", phase)])]
    ci = interval(ratios)
    return {**per, "ratios": ratios, "ratio_mean": ci["mean"], "ratio_low": ci["lo"], "ratio_high": ci["hi"]}


def worker(size: common.Size, sync_period: int) -> None:
    """One side of `host_memory_cost` (the setting itself is made by the command line, before
    JAX starts): the plain step and vanilla DiLoCo, each phase a step."""
    import optax

    import diloco_eqx as dl

    m, inner = common.model(size), optax.adamw(1e-3)
    cfg = dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period)
    modes = {"plain": steps.plain(m, inner, common.K), "diloco": steps.diloco(m, inner, cfg)}
    full = common.batch(size)
    placed = {name: step.place_batch(full) for name, (_, step) in modes.items()}
    step_at = {"plain": None, "nonsync": 5, "sync": sync_period}

    def run(phase: str) -> dict:
        name = "plain" if phase == "plain" else "diloco"
        return workers.measured_step(modes[name], placed[name], step_at[phase])

    for phase in PHASES * 3:  # compiled, and the heap grown to the steps' needs
        run(phase)
    workers.serve(run, {})
