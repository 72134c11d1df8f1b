"""XLA:CPU's two instruction orders side by side (CPU only, no mesh), each set by XLA's own
flag in a worker process of its own (`XLA_FLAGS=--xla_cpu_scheduler_type=...`, as a run may
set it): each mode's resident memory over plain's under the same order, against its expected
extra (as in the step table's memory modes), and full-batch step times paired within each
repetition (the orders alternate which runs first) for plain, a Streaming (V = 1) step
without an event and its stash step. Ratios are memory-order time / concurrency-order time:
the mean with its 95% t-interval over the repetitions."""

from __future__ import annotations

import os

from tools.bench import common, steps, workers

ORDERS = {"memory": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
          "concurrency": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}
"""XLA:CPU's instruction orders by name ("concurrency" is XLA's default)."""
PHASES = ("plain", "streaming_nonsync", "streaming_sync")


def run_cpu_orders(sizes, reps: int, sync_period: int, num_fragments: int) -> dict:
    """`cpu_orders` for each size, with the settings and machine."""
    common.require_cpu("--cpu-orders", "compares XLA:CPU's orders")
    out = {size.name: cpu_orders(size, reps, sync_period, num_fragments) for size in sizes}
    return {"cpu_orders": out, **common.settings_and_machine(sync_period, num_fragments, reps)}


def order_env(order: str) -> dict[str, str]:
    """This process's environment with XLA:CPU's `order` added to XLA's flags."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_scheduler_type={ORDERS[order]}".strip()
    return {**os.environ, "XLA_FLAGS": flags}


def cpu_orders(size: common.Size, reps: int, sync_period: int, num_fragments: int) -> dict:
    """Both orders' memory per mode (from each worker's compiled steps) and paired step times."""
    args = ["--sizes", size.name, "--sync-period", str(sync_period), "--num-fragments", str(num_fragments)]
    envs = {order: order_env(order) for order in ("concurrency", "memory")}
    with workers.Workers(args, "--cpu-orders-worker", envs, size.name) as w:
        got = workers.paired_steps(w, PHASES, reps)
        w.close()
        ready = w.ready
    resident = {order: ready[order]["resident_bytes"] for order in ORDERS}
    modes = {order: {mode: {"extra_bytes": resident[order][mode] - resident[order]["plain"],
                            "expected_extra_bytes": want} for mode, want in ready[order]["expected_extra_bytes"].items()}
             for order in ORDERS}
    times = {key: [answer["s"] for answer in answers] for key, answers in got.items()}
    timing = common.paired_ratios(times, PHASES, "memory", "concurrency")
    return {"params": ready["memory"]["params"], "resident_bytes": resident, "modes": modes, "times": timing,
            "reps": reps}


def worker(size: common.Size, sync_period: int, num_fragments: int) -> None:
    """One side of `cpu_orders` (its order set in XLA_FLAGS by the parent): the plain step and
    vanilla, Streaming V = 0 and V = 1 steps, their compiled memory in the ready line, and
    the three timed phases."""
    import optax

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import count_params

    m, inner, full = common.model(size), optax.adamw(1e-3), common.batch(size)
    n = count_params(m)
    cfgs = {"vanilla": dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period),
            "streaming": dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period, streaming=True,
                                         num_fragments=num_fragments),
            "streaming_deferred": dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period, streaming=True,
                                                  num_fragments=num_fragments, overlap_steps=1)}
    largest = max(common.fragment_params(m, cfgs["streaming"]))
    expected = {"vanilla": 8 * n, "streaming": 8 * n, "streaming_deferred": 8 * n + common.K * largest * 4}
    modes = {"plain": steps.plain(m, inner, common.K), **{mode: steps.diloco(m, inner, cfg) for mode, cfg in cfgs.items()}}
    resident = {mode: steps.resident_bytes(step, state, full) for mode, (state, step) in modes.items()}
    placed = {mode: step.place_batch(full) for mode, (_, step) in modes.items()}
    dh = dl.Schedule.from_config(cfgs["streaming_deferred"]).steps_between_syncs
    phases = {"plain": ("plain", None), "streaming_nonsync": ("streaming_deferred", 5),
              "streaming_sync": ("streaming_deferred", dh)}

    def run(phase: str) -> dict:
        mode, t_end = phases[phase]
        return workers.measured_step(modes[mode], placed[mode], t_end)

    for phase in PHASES:  # compiled
        run(phase)
    workers.serve(run, {"params": n, "resident_bytes": resident, "expected_extra_bytes": expected})
