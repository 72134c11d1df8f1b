"""The deferred exchange (Streaming, V = 1) waiting for the inner step ("after_inner", the
default without a mesh) and free to run anywhere ("free", the island-mesh form), side by
side (no mesh, CPU only): each step's resident and live-peak extra over plain against the
formula 2·|Θ|·4 + K·max_f |Θ_f|·4, and full-batch times paired within each repetition
(alternating which runs first) of a step with no event, a stash step and an exchange step
(fragments taken in turn). Ratios are after_inner / free: the mean with its 95% t-interval
over the repetitions."""

from __future__ import annotations

from tools.bench import common, steps

VARIANTS = {"free": False, "after_inner": True}
"""Each placement by name: whether the exchange waits for the inner step."""


def exchange_placement(m, size, k: int, sync_period: int, num_fragments: int, reps: int) -> dict:
    """Both placements' memory and paired step times for model `m` of `size`."""
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis import profiling
    from diloco_eqx.models.transformer import count_params

    inner, n, full = optax.adamw(1e-3), count_params(m), common.batch(size)
    cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=sync_period, streaming=True, num_fragments=num_fragments,
                          overlap_steps=1)
    want = 8 * n + k * max(common.fragment_params(m, cfg)) * 4
    state, plain = steps.plain(m, inner, k)
    compiled, plain_live = profiling.live_peak(plain.lower(state, full))
    plain_bytes = profiling.memory(compiled)["resident_bytes"]
    modes, memory = {}, {}
    for variant, after in VARIANTS.items():
        modes[variant, "deferred"] = steps.diloco(m, inner, cfg, exchange_after_inner=after)
        compiled, live = profiling.live_peak(modes[variant, "deferred"][1].lower(modes[variant, "deferred"][0], full))
        memory[variant] = {"extra_bytes": profiling.memory(compiled)["resident_bytes"] - plain_bytes,
                           "live_extra_bytes": None if live is None or plain_live is None else live - plain_live,
                           "expected_extra_bytes": want}
    dh = dl.Schedule.from_config(cfg).steps_between_syncs
    phases = {"nonsync": ("deferred", 5), "stash": ("deferred", [dh * j for j in range(1, num_fragments + 1)]),
              "exchange": ("deferred", [dh * j + 1 for j in range(1, num_fragments + 1)])}
    placed = {key: step.place_batch(full) for key, (_, step) in modes.items()}
    times = steps.paired_variant_times(modes, placed, phases, reps, pair=("free", "after_inner"))
    timing = common.paired_ratios(times, phases, "after_inner", "free")
    return {"params": n, "plain_resident_bytes": plain_bytes, "memory": memory, "times": timing, "reps": reps}


def run_exchange_placement(sizes, reps: int, sync_period: int, num_fragments: int) -> dict:
    """`exchange_placement` of every size, with the settings and machine."""
    common.require_cpu("--exchange-placement", "compares the CPU default with the free placement")
    out = {size.name: exchange_placement(common.model(size), size, common.K, sync_period, num_fragments, reps)
           for size in sizes}
    return {"exchange_placement": out, **common.settings_and_machine(sync_period, num_fragments, reps)}
