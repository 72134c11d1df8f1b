"""make_train_step: one compiled global step of DiLoCo / Streaming DiLoCo.

Inside the step, in order: one inner step on every island; t += 1; the sync stage
(`lax.cond` on the schedule, `lax.switch` over fragments): pseudo-gradients of fragment
f(t), their mean over the contributing islands (exchange.py), one Nesterov step on the
outer fragment; the apply stage (same shape): blend the outer fragment f(t−V) into every
island. Schedule positions are branches, not Python control flow, so the step compiles once.

With V >= 1 the exchange is deferred: the sync stage of step t only stashes the islands'
pseudo-gradients, and step t+1 begins with the exchange and outer step on that stash, which
nothing in its inner step depends on (critical_path.py shows it), so the collective can run
while the inner step computes. The apply at t+V sees the same outer values either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Float, PyTree

from diloco_eqx import exchange, islands
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import Fragmentation, default_layers
from diloco_eqx.outer import (
    all_finite,
    blend,
    cast_like,
    outer_optimizer,
    outer_step,
    pseudo_gradient,
    tree_norm,
)
from diloco_eqx.schedule import Schedule
from diloco_eqx.state import DiLoCoState

LossFn = Callable[[eqx.Module, PyTree], Float[Array, ""]]


class StepMetrics(Mapping):
    """The step's metrics, fetched from the device on first access (so the host can
    dispatch the next step before reading this one).

    Keys: "step" (t), "loss" (mean over islands), "loss_island_{i}", any other scalar the
    step reports; with a schedule, on sync steps also "sync_fragment", "pseudo_grad_norm"
    (norm of the mean pseudo-gradient), "outer_update_norm", "islands_contributed" (islands
    in the mean: not dropped, finite) and, with compression, "compression_error"
    (‖decoded − sent‖/‖sent‖, mean over islands); on apply steps "apply_fragment". With the
    deferred exchange the sync diagnostics arrive one step later, with "exchanged_fragment".
    On apply steps also "islands_reset": islands whose applied fragment was not finite and
    that were reset to the outer model with fresh inner optimizer state.
    """

    SYNC_KEYS = ("pseudo_grad_norm", "outer_update_norm")
    ISLAND_SYNC_KEYS = ("compression_error",)
    """Per-island sync metrics, reported as their mean over islands."""

    def __init__(
        self,
        device_metrics: dict[str, Array],
        schedule: Schedule | None = None,
        exchange_delay: int = 0,
    ):
        self._device = device_metrics
        self._schedule = schedule
        self._delay = exchange_delay
        self._host: dict[str, float | int] | None = None

    def _fetch(self) -> dict[str, float | int]:
        if self._host is None:
            m = islands.to_host(self._device)
            t = int(m["step"])
            losses = np.asarray(m["loss_island"], np.float64)
            host: dict[str, float | int] = {"step": t, "loss": float(losses.mean())}
            host.update({f"loss_island_{i}": float(x) for i, x in enumerate(losses)})
            host.update(
                {k: float(v) for k, v in m.items()
                 if k not in ("step", "loss_island", "islands_contributed", "reset_island",
                              *self.SYNC_KEYS, *self.ISLAND_SYNC_KEYS)}
            )
            if self._schedule is not None:
                synced = self._schedule.sync_fragment(t)
                if synced is not None:
                    host["sync_fragment"] = synced
                exchanged = self._schedule.sync_fragment(t - self._delay)
                if exchanged is not None:
                    if self._delay:
                        host["exchanged_fragment"] = exchanged
                    host.update({k: float(m[k]) for k in self.SYNC_KEYS})
                    host["islands_contributed"] = int(m["islands_contributed"])
                    host.update(
                        {k: float(np.mean(m[k])) for k in self.ISLAND_SYNC_KEYS if k in m}
                    )
                applied = self._schedule.apply_fragment(t)
                if applied is not None:
                    host["apply_fragment"] = applied
                    host["islands_reset"] = int(np.sum(m["reset_island"]))
            self._host = host
        return self._host

    def __getitem__(self, key: str):
        return self._fetch()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetch())

    def __len__(self) -> int:
        return len(self._fetch())

    def __repr__(self) -> str:
        return f"StepMetrics({self._fetch()})"


def make_train_step(
    cfg: DiLoCoConfig,
    loss_fn: LossFn,
    inner_optimizer: optax.GradientTransformation,
    mesh: Mesh | None = None,
    *,
    layers: Callable[[Any], Any] = default_layers,
    deferred: bool | None = None,
) -> Callable[[DiLoCoState, PyTree], tuple[DiLoCoState, StepMetrics]]:
    """The global step `(state, batch) -> (state, metrics)`; the state is donated.

    `batch` leaves have a leading axis of GBS rows; island k gets rows [k·GBS/K, (k+1)·GBS/K).
    `loss_fn(model, island_batch)` returns a scalar. `layers` points at the layer stack.

    `deferred` (default: on exactly when streaming with V >= 1): the sync at step t only
    stashes each island's pseudo-gradient; the exchange and outer step run in step t+1,
    independent of its inner step, so the collective can overlap that step's compute. The
    numbers are those of the direct form. `train_step.outer_model(state)` gives the outer
    model with any pending sync folded in.
    """
    if deferred is None:
        deferred = cfg.streaming and cfg.overlap_steps >= 1
    if deferred and not (cfg.streaming and cfg.overlap_steps >= 1):
        raise ValueError(
            "deferred=True needs streaming=True and overlap_steps (V) >= 1: with V = 0 the "
            "outer fragment is applied in the same step it is synced"
        )
    schedule = Schedule.from_config(cfg)
    islands.check_divides(cfg.num_replicas, mesh)
    outer_tx = outer_optimizer(cfg)
    alpha = float(cfg.alpha) if cfg.streaming else 0.0
    k = cfg.num_replicas
    fmt = cfg.compression

    def params(tree):
        return eqx.filter(tree, eqx.is_inexact_array)

    def run(state: DiLoCoState, batch: PyTree) -> tuple[DiLoCoState, dict[str, Array]]:
        frags = Fragmentation.from_model(state.outer_model, cfg, layers)
        inner_arrays, inner_static = eqx.partition(state.inner_model, eqx.is_array)
        island_step = inner_step(loss_fn, inner_optimizer, inner_static)
        local_k = k // islands.axis_size(mesh)

        def switch(f, make_branch, *operands):
            branches = [make_branch(i) for i in range(schedule.num_fragments)]
            if len(branches) == 1:
                return branches[0](*operands)
            return lax.switch(f, branches, *operands)

        def local_deltas(f, inner, outer):
            """Each island's pseudo-gradient of fragment f (no communication)."""
            outer_f = frags.take(params(outer), f)
            return jax.vmap(lambda m: pseudo_gradient(outer_f, frags.take(params(m), f)))(inner)

        def reduce_and_step(f, t_sync, deltas, outer, outer_opt, residual):
            """The exchange and outer step of fragment f for the sync at step t_sync."""
            outer_f = frags.take(params(outer), f)
            ok = exchange.contributes(cfg, t_sync, deltas, mesh)
            res_f = None if residual is None else jax.vmap(lambda r: frags.take(r, f))(residual)
            delta, count, res_f, per_island = exchange.mean_pseudo_gradient(
                cfg, deltas, ok, res_f, outer_f, mesh
            )
            if residual is not None:
                residual = jax.vmap(lambda r, e: frags.put(r, f, e))(residual, res_f)
            opt_f = frags.take_state(outer_tx, outer_opt, f)
            new_f, new_opt_f, update = outer_step(outer_tx, delta, opt_f, outer_f)
            anyone = count > 0  # nobody reported: the outer fragment and its trace stay
            new_f = exchange.keep_if(anyone, new_f, outer_f)
            new_opt_f = exchange.keep_if(anyone, new_opt_f, opt_f)
            sync_metrics = {
                "pseudo_grad_norm": tree_norm(delta),
                "outer_update_norm": jnp.where(anyone, tree_norm(update), 0.0),
                "islands_contributed": count,
            }
            outer = frags.put(outer, f, new_f)
            outer_opt = frags.put_state(outer_tx, outer_opt, f, new_opt_f)
            return outer, outer_opt, residual, sync_metrics, per_island

        def no_exchange(outer, outer_opt, residual):
            zero = jnp.zeros((), jnp.float32)
            sync_metrics = {"pseudo_grad_norm": zero, "outer_update_norm": zero,
                            "islands_contributed": jnp.zeros((), jnp.int32)}
            per_island = {}
            if fmt != "none":
                zeros = jnp.zeros((local_k,), jnp.float32)
                per_island = {"compression_error": islands.island_local(zeros, mesh)}
            return outer, outer_opt, residual, sync_metrics, per_island

        def at_sync(t, make_branch, otherwise, *operands):
            """`make_branch(f)(*operands)` for the fragment synced at t, else `otherwise`."""
            return lax.cond(
                schedule.is_sync_traced(t),
                lambda *ops: switch(schedule.fragment_at_traced(t), make_branch, *ops),
                otherwise,
                *operands,
            )

        def direct_sync(t, inner, outer, outer_opt, residual):
            """Sync at t inside step t: pseudo-gradients, exchange, outer step."""

            def branch(f):
                def sync(inner, outer, outer_opt, residual):
                    with jax.named_scope(f"fragment_{f}"):
                        deltas = local_deltas(f, inner, outer)
                        return reduce_and_step(f, t, deltas, outer, outer_opt, residual)

                return sync

            skip = lambda inner, *rest: no_exchange(*rest)  # noqa: E731
            return at_sync(t, branch, skip, inner, outer, outer_opt, residual)

        def deferred_exchange(t_sync, pending, outer, outer_opt, residual):
            """Exchange and outer step for the sync stashed at t_sync (the previous step);
            reads only the stash and the outer state, never this step's inner work."""

            def branch(f):
                def sync(pending, outer, outer_opt, residual):
                    with jax.named_scope(f"fragment_{f}"):
                        deltas = jax.vmap(lambda p: frags.take(p, f))(pending)
                        return reduce_and_step(f, t_sync, deltas, outer, outer_opt, residual)

                return sync

            skip = lambda pending, *rest: no_exchange(*rest)  # noqa: E731
            return at_sync(t_sync, branch, skip, pending, outer, outer_opt, residual)

        def stash(t, inner, outer, pending):
            """At a sync step: keep each island's pseudo-gradient for the next step."""

            def branch(f):
                def keep(inner, outer, pending):
                    deltas = local_deltas(f, inner, outer)
                    return jax.vmap(lambda p, d: frags.put(p, f, d))(pending, deltas)

                return keep

            return at_sync(t, branch, lambda inner, outer, pending: pending, inner, outer, pending)

        def apply(t, inner, inner_opt, outer):
            """Blend the outer fragment f(t−V) into every island; an island whose fragment
            holds a NaN or Inf is reset instead (the whole outer model, and fresh inner
            optimizer state for its non-finite leaves). Returns the islands reset."""

            def branch(f):
                def apply_f(inner, outer):
                    outer_f = frags.take(params(islands.island_local(outer, mesh)), f)
                    bad = jax.vmap(lambda m: ~all_finite(frags.take(params(m), f)))(inner)
                    inner = jax.vmap(
                        lambda m: frags.put(m, f, blend(frags.take(params(m), f), outer_f, alpha))
                    )(inner)
                    return inner, bad

                return apply_f

            def no_apply(inner, outer):
                return inner, islands.island_local(jnp.zeros((local_k,), bool), mesh)

            inner, bad = lax.cond(
                schedule.is_apply_traced(t),
                lambda *ops: switch(schedule.fragment_at_traced(t - schedule.overlap_steps), branch, *ops),
                no_apply,
                inner, outer,
            )
            inner, inner_opt = lax.cond(
                jnp.any(bad), reset_islands, lambda b, i, o, _: (i, o), bad, inner, inner_opt,
                islands.island_local(outer, mesh),
            )
            return inner, inner_opt, bad

        def reset_islands(bad, inner, inner_opt, outer):
            """Islands flagged in `bad` take the outer model (in their own dtypes), and every
            optimizer-state leaf of theirs that is not finite restarts from `init` on it
            (finite leaves, such as step counts, are kept so schedules continue)."""
            fresh = cast_like(params(outer), params(inner))
            fresh_opt = inner_optimizer.init(fresh)

            def pick(x, new, only_non_finite):
                if not eqx.is_inexact_array(x):
                    return x
                drop = bad
                if only_non_finite:
                    drop = drop & ~jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))
                return jnp.where(drop.reshape(-1, *[1] * (x.ndim - 1)), new[None], x)

            new_params = jax.tree.map(lambda x, n: pick(x, n, False), params(inner), fresh)
            inner = eqx.combine(new_params, eqx.filter(inner, eqx.is_inexact_array, inverse=True))
            inner_opt = jax.tree.map(lambda x, n: pick(x, n, True), inner_opt, fresh_opt)
            return inner, inner_opt

        def body(inner, inner_opt, outer, outer_opt, step, island_batches, residual, pending):
            if deferred:
                with jax.named_scope("diloco_sync"):
                    outer, outer_opt, residual, sync_metrics, per_island = deferred_exchange(
                        step, pending, outer, outer_opt, residual
                    )
            with jax.named_scope("inner_step"):
                inner, inner_opt, losses = jax.vmap(island_step)(inner, inner_opt, island_batches)
            t = step + 1
            if deferred:
                with jax.named_scope("diloco_stash"):
                    pending = stash(t, inner, outer, pending)
            # With V >= 1 the apply never reads the fragment synced in the same step, and an
            # island reset there takes the outer model without that sync (in the deferred
            # form it is still in flight): both forms apply from the outer before this sync.
            applied_from = outer
            if not deferred:
                with jax.named_scope("diloco_sync"):
                    outer, outer_opt, residual, sync_metrics, per_island = direct_sync(
                        t, inner, outer, outer_opt, residual
                    )
                if schedule.overlap_steps == 0:
                    applied_from = outer
            with jax.named_scope("diloco_apply"):
                inner, inner_opt, reset = apply(t, inner, inner_opt, applied_from)
            per_island = {**per_island, "reset_island": reset}
            return inner, inner_opt, outer, outer_opt, t, residual, pending, losses, sync_metrics, per_island

        R, I = islands.REPLICATED, islands.ISLANDS
        outer_arrays, outer_static = eqx.partition(state.outer_model, eqx.is_array)
        if batch is None:  # settle: fold a pending exchange into the outer model, nothing else

            def settle_body(outer, outer_opt, step, residual, pending):
                outer, *_ = deferred_exchange(step, pending, outer, outer_opt, residual)
                return outer

            settle = islands.shard_islands(settle_body, mesh, in_specs=(R, R, R, I, I), out_specs=R)
            outer = settle(outer_arrays, state.outer_opt_state, state.step, state.residual, state.pending)
            return eqx.combine(outer, outer_static), {}

        sharded_body = islands.shard_islands(
            body, mesh, in_specs=(I, I, R, R, R, I, I, I), out_specs=(I, I, R, R, R, I, I, I, R, I)
        )
        inner, inner_opt, outer, outer_opt, t, residual, pending, losses, sync_metrics, per_island = (
            sharded_body(
                inner_arrays,
                state.inner_opt_state,
                outer_arrays,
                state.outer_opt_state,
                state.step,
                split_batch(batch, k),
                state.residual,
                state.pending if deferred else None,
            )
        )
        new_state = DiLoCoState(
            inner_model=eqx.combine(inner, inner_static),
            inner_opt_state=inner_opt,
            outer_model=eqx.combine(outer, outer_static),
            outer_opt_state=outer_opt,
            step=t,
            residual=residual,
            pending=pending if deferred else state.pending,
        )
        return new_state, {"step": t, "loss_island": losses, **sync_metrics, **per_island}

    # Donate the state, not the caller's batch: filter_jit donates every argument but the
    # first, so the compiled function takes (batch, state).
    compiled = eqx.filter_jit(lambda batch, state: run(state, batch), donate="all-except-first")

    settled = eqx.filter_jit(lambda state: run(state, None)[0])

    def train_step(state: DiLoCoState, batch: PyTree) -> tuple[DiLoCoState, StepMetrics]:
        check_batch(batch, k)
        state, device_metrics = compiled(islands.place(batch, mesh, islands.ISLANDS), state)
        return state, StepMetrics(device_metrics, schedule, exchange_delay=int(deferred))

    def outer_model(state: DiLoCoState) -> eqx.Module:
        """The outer model with every sync up to state.step applied: with the deferred
        exchange a sync at the last step is still pending in the state; this folds it in
        (for evaluation and comparisons) without changing the state."""
        if not deferred:
            return state.outer_model
        return settled(state)

    def lower(state: DiLoCoState, batch: PyTree) -> jax.stages.Lowered:
        """The step lowered for these arguments: `.compile().as_text()` is its HLO."""
        return compiled.lower(islands.place(batch, mesh, islands.ISLANDS), state).lowered

    def jaxpr(state: DiLoCoState, batch: PyTree) -> jax.extend.core.ClosedJaxpr:
        """The step's traced program (for dependency analysis: `critical_path`)."""
        placed = islands.place(batch, mesh, islands.ISLANDS)
        return eqx.filter_make_jaxpr(lambda batch, state: run(state, batch))(placed, state)[0]

    train_step.lower = lower
    train_step.jaxpr = jaxpr
    train_step.schedule = schedule
    train_step.outer_model = outer_model
    train_step.deferred = deferred
    return train_step


def inner_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, static: PyTree):
    """One island's inner step on its array leaves: `(arrays, opt_state, batch) ->
    (arrays, opt_state, loss)`; `static` is the model's non-array part."""

    def step(model_arrays, opt_state, island_batch):
        model = eqx.combine(model_arrays, static)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, island_batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    return step


def check_batch(batch: PyTree, num_replicas: int) -> int:
    """GBS of a batch; ValueError unless every leaf has the same GBS, divisible by K."""
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every batch leaf needs the same leading global-batch axis; got sizes {sizes}"
        )
    gbs = sizes.pop()
    if gbs % num_replicas:
        raise ValueError(
            f"global batch size (GBS)={gbs} must be divisible by num_replicas (K)="
            f"{num_replicas}: each island takes GBS/K rows"
        )
    return gbs


def split_batch(batch: PyTree, num_replicas: int) -> PyTree:
    """(GBS, ...) -> (K, GBS/K, ...): island k takes rows [k·GBS/K, (k+1)·GBS/K)."""
    return jax.tree.map(lambda x: x.reshape(num_replicas, -1, *x.shape[1:]), batch)
