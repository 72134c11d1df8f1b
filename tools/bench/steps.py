"""The steps under test, each kept as a [state, step] list that a timed call updates in
place, and how a step is timed: alone, or variants paired within each repetition.

A step object has `place_batch(batch)`, `step_placed(state, placed)` and `lower(state,
batch)`: `diloco_eqx.DiLoCo`, `diloco_eqx.DDP` and the plain floor of
`diloco_eqx.analysis.plain` all do."""

from __future__ import annotations

import time


def plain(model, inner, k: int, mesh=None) -> list:
    """[state, step] of plain training: K islands, each its inner step, no DiLoCo logic."""
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.models.transformer import loss_fn

    return list(make_plain_step(model, loss_fn, inner, k, mesh))


def ddp(model, inner, k: int, mesh=None) -> list:
    """[state, step] of the Data-Parallel baseline."""
    import diloco_eqx as dl
    from diloco_eqx.models.transformer import loss_fn

    step = dl.DDP(k, loss_fn, inner, mesh=mesh)
    return [step.init(model), step]


def diloco(model, inner, cfg, mesh=None, backend: str = "shard_map", exchange_after_inner: bool | None = None) -> list:
    """[state, step] of DiLoCo as `cfg` says; `exchange_after_inner` (V >= 1 only) overrides
    whether the deferred exchange waits for the inner step (None: the step's default)."""
    import diloco_eqx as dl
    from diloco_eqx.diloco import with_plan
    from diloco_eqx.models.transformer import loss_fn

    algo = dl.DiLoCo(cfg, loss_fn, inner, mesh=mesh, backend=backend)
    if exchange_after_inner is not None:
        algo = with_plan(algo, exchange_after_inner=exchange_after_inner)
    return [algo.init(model), algo]


def exchange_after_inner(step) -> bool:
    """Whether a DiLoCo step's deferred exchange waits for its inner step."""
    return bool(step.plan.exchange_after_inner)


def ending_at(state, t_end: int, mesh=None):
    """`state` with its global step set so that the next step ends at t_end (t = t_end − 1,
    replicated on `mesh`), computed before any timing starts."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from diloco_eqx import mesh as islands

    t = islands.place(jnp.asarray(t_end - 1, jnp.int32), mesh, islands.REPLICATED)
    return jax.block_until_ready(eqx.tree_at(lambda s: s.step, state, t))


def time_step(state_and_step: list, placed, t_end: int | None = None) -> float:
    """Seconds of one step from `state_and_step` ([state, step], updated in place), from its
    call until its new state is ready; with `t_end`, the step that ends at t_end (the
    state's counter set first, untimed)."""
    import jax

    state, step = state_and_step
    if t_end is not None:
        state = ending_at(state, t_end)
    t0 = time.perf_counter()
    state, _ = step.step_placed(state, placed)
    jax.block_until_ready(state)
    state_and_step[0] = state
    return time.perf_counter() - t0


def paired_variant_times(steps: dict, placed: dict, phases: dict, reps: int, pair: tuple[str, str]) -> dict:
    """{(variant, phase): seconds per repetition}; in each repetition the two variants of
    `pair` run each phase back to back, alternating which goes first. `steps` holds [state,
    step] lists keyed (variant, mode); a phase is (mode, the step t to end at, or a list of
    them taken in turn, or None to go on from the state's own step). The first repetition
    compiles and warms up."""
    times = {}
    for rep in range(reps + 1):
        for name, (mode, ts) in phases.items():
            t = ts[rep % len(ts)] if isinstance(ts, list) else ts
            for variant in (pair[::-1] if rep % 2 else pair):
                seconds = time_step(steps[variant, mode], placed[variant, mode], t)
                if rep:
                    times.setdefault((variant, name), []).append(seconds)
    return times


def compiled_and_live(lowered):
    """The executable and its live-range peak (`profiling.live_peak`) on CPU; elsewhere the
    executable alone, taken from JAX's cache of the step already run: the peak needs a second
    compile with a dump, which on an accelerator costs more device time than it tells."""
    import jax

    from diloco_eqx.analysis import profiling

    if jax.default_backend() == "cpu":
        return profiling.live_peak(lowered)
    return lowered.compile(), None


def memory_of(step, state, batch) -> tuple[dict, object]:
    """A compiled step's memory analysis with its live-range peak, and the executable."""
    from diloco_eqx.analysis import profiling

    compiled, live = compiled_and_live(step.lower(state, batch))
    return {**profiling.memory(compiled), "live_peak_bytes": live}, compiled


def resident_bytes(step, state, batch) -> int:
    """Resident bytes per device of a compiled step (arguments and temporaries)."""
    from diloco_eqx.analysis import profiling

    return profiling.memory(step.lower(state, batch).compile())["resident_bytes"]
