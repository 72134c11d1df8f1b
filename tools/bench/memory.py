"""Each mode's extra memory over plain training against its formula: 2·|Θ|·4 bytes for the
float32 outer model and its momentum (per island device), plus, with the deferred exchange
(V >= 1), one stash row of the largest fragment per island on the device."""

from __future__ import annotations

from tools.bench import common, steps


def memory_by_mode(size: common.Size, mesh_name: str, checks: dict, memory: dict, inner, sync_period: int,
                   num_fragments: int, backends, dtype: str) -> dict:
    """Every mode's extra memory over plain for the first size and mesh of a step table
    (`memory`: its compiled steps' memory by "size/mesh/mode"), against its formula.
    Streaming with V = 0 is compiled here for its memory only."""
    import diloco_eqx as dl

    first = f"{size.name}/{mesh_name}"
    mesh = common.bench_mesh(mesh_name)
    m, batch = common.model(size, dtype), common.batch(size, zeros=True)
    direct = dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period, streaming=True,
                             num_fragments=num_fragments)
    memory = dict(memory)
    for backend in backends:
        state, step = steps.diloco(m, inner, direct, mesh, backend)
        memory[f"{first}/{common.mode_name('streaming_v0', backend)}"], _ = steps.memory_of(step, state, batch)
    n, largest = checks[first]["params"], max(common.fragment_params(m, direct))
    plain_mem = memory[f"{first}/plain"]["resident_bytes"]
    if dtype == "bfloat16" and mesh is None:  # the run's own no-mesh steps are already bfloat16
        low = bfloat16_row(plain_mem, memory[f"{first}/{common.mode_name('diloco', backends[0])}"]["resident_bytes"], n)
    else:
        low = bfloat16_memory(common.model(size, dtype), inner, sync_period, size)
    modes = expected_by_mode(checks[first], n, largest, backends)
    return {"plain_bytes": plain_mem,
            "diloco_bytes": memory[f"{first}/{common.mode_name('streaming', backends[0])}"]["resident_bytes"],
            "expected_extra_bytes": checks[first]["expected_extra_bytes"],
            "param_bytes": 4 * n, "largest_fragment_bytes": 4 * largest,
            "modes": {name: {"extra_bytes": memory[f"{first}/{mode}"]["resident_bytes"] - plain_mem,
                             "live_extra_bytes": live_extra(memory, first, mode), "expected_extra_bytes": want}
                      for name, (mode, want) in modes.items()},
            "config": first, "all": memory, "bfloat16": low}


def expected_by_mode(check: dict, n: int, largest: int, backends) -> dict[str, tuple[str, int]]:
    """{memory mode: (the step table's mode it is measured on, its expected extra bytes)}:
    the outer model and momentum split over the island's devices, and for the deferred
    exchange one row per island on a device, sized to the largest fragment."""
    per_island = check["devices_per_island"]
    islands_per_device = common.K // (check["devices"] // per_island)
    outer = 2 * n * 4 // per_island
    stash = islands_per_device * largest * 4 // per_island
    return {common.mode_name(name, backend): (common.mode_name(mode, backend), want) for backend in backends
            for name, mode, want in (("vanilla", "diloco", outer), ("streaming", "streaming_v0", outer),
                                     ("streaming_deferred", "streaming", outer + stash))}


def live_extra(memory: dict, config: str, mode: str) -> int | None:
    """What `mode` holds at its peak over what plain training holds at its own, by XLA's
    live ranges (`profiling.live_peak`): the extra with the allocator's layout left out."""
    live, plain = memory[f"{config}/{mode}"]["live_peak_bytes"], memory[f"{config}/plain"]["live_peak_bytes"]
    return None if live is None or plain is None else live - plain


def bfloat16_memory(m, inner, sync_period: int, size: common.Size) -> dict:
    """Memory of plain and vanilla DiLoCo steps for the model in bfloat16 (no mesh): the
    extra is 2·|Θ|·4 bytes, since the outer model and momentum stay float32."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import diloco_eqx as dl
    from diloco_eqx.models.transformer import count_params

    m = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, m)
    batch = common.batch(size, zeros=True)
    cfg = dl.DiLoCoConfig(num_replicas=common.K, sync_period=sync_period)
    plain_state, plain_step = steps.plain(m, inner, common.K)
    state, step = steps.diloco(m, inner, cfg)
    return bfloat16_row(steps.resident_bytes(plain_step, plain_state, batch), steps.resident_bytes(step, state, batch),
                        count_params(m))


def bfloat16_row(plain: int, diloco: int, n: int) -> dict:
    return {"param_dtype": "bfloat16", "outer_dtype": "float32", "params": n,
            "plain_bytes": plain, "diloco_bytes": diloco, "extra_bytes": diloco - plain,
            "expected_extra_bytes": 2 * n * 4, "param_bytes_bfloat16": 2 * n}
