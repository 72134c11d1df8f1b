"""One global step of DiLoCo and Streaming DiLoCo, as named pure functions of a static `Plan`.

In order: the inner step on every island; t += 1; the sync stage (fragment f(t):
pseudo-gradients, their mean over the contributing islands, one outer step on f,
`exchange.py`); the apply stage (fragment f(t−V): blend the outer fragment into every
island, or reset an island whose fragment went non-finite, `apply.py`). Every schedule
event is a loop built by `events.when`, so the step compiles once. Vanilla DiLoCo is the
one-fragment, V = 0 case of the same functions.

With V >= 1 the exchange is deferred (`deferred_step`): the sync stage of step t only
stashes each island's pseudo-gradient, and step t+1 begins with the exchange and outer step
on that stash, which nothing in its inner step depends on, so the collective can run while
the inner step computes (`analysis.critical_path` checks it). The numbers are those of the
direct form (`direct_step`). Delayed outer updates are the variant in `delayed.py`.

Every cross-island operation goes through the plan's `Islands` backend (`islands.py`).
"""

from __future__ import annotations

from functools import partial

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

from diloco_eqx import delayed
from diloco_eqx import mesh as mesh_lib
from diloco_eqx import speeds, sync
from diloco_eqx.apply import apply_stage, no_reset
from diloco_eqx.events import after_inner
from diloco_eqx.exchange import exchange_stage, no_report, pin_exchange, stash_stage, sync_stage
from diloco_eqx.plan import Plan, StepReport, params
from diloco_eqx.state import DiLoCoState, state_shardings, state_specs


def inner_step(plan: Plan, static: eqx.Module, inner: PyTree, inner_opt: PyTree, batches: PyTree, t=None):
    """One inner optimizer step on each island of this device: (islands, states, losses).
    `inner` holds the islands' array leaves; `static` the model's other parts. With
    heterogeneous islands, an island idle at step t keeps its parameters and state."""

    def one(arrays, opt_state, batch):
        model = eqx.combine(arrays, static)
        loss, grads = eqx.filter_value_and_grad(plan.loss_fn)(model, batch)
        updates, opt_state = plan.inner_optimizer.update(grads, opt_state, params(model))
        return eqx.filter(eqx.apply_updates(model, updates), eqx.is_array), opt_state, loss

    new_inner, new_opt, losses = plan.islands.map(one, inner, inner_opt, batches)
    if not plan.cfg.heterogeneous:
        return new_inner, new_opt, losses
    active = speeds.is_active(plan.island_steps(), plan.schedule.period, t)
    keep = lambda new, old: jax.tree.map(lambda a, b: sync._per_island(active, a, b), new, old)  # noqa: E731
    return keep(new_inner, inner), keep(new_opt, inner_opt), losses


def direct_step(plan: Plan, static: DiLoCoState, s: DiLoCoState, batches) -> tuple[DiLoCoState, StepReport]:
    """Inner step, sync (exchange included) and apply, all in step t."""
    t = s.step + 1
    with jax.named_scope("inner_step"):
        inner, inner_opt, losses = inner_step(plan, static.inner_model, s.inner_model, s.inner_opt_state, batches, t)
    if plan.delayed:
        return delayed.delayed_step(plan, s, t, inner, inner_opt, losses)
    # With V >= 1 the apply never reads the fragment synced in the same step, and an island
    # reset there takes the outer model without that sync (in the deferred form it is still
    # in flight): both forms apply from the outer model before this step's sync. With V = 0
    # the apply takes the sync's finding of which islands are finite instead of its own.
    same_step = plan.schedule.overlap_steps == 0

    def events(c):
        inner, inner_opt, outer, outer_opt, residual, _, _ = c
        with jax.named_scope("diloco_sync"):
            outer, outer_opt, residual, report, finite = sync_stage(plan, t, inner, outer, outer_opt, residual)
        with jax.named_scope("diloco_apply"):
            inner, inner_opt, reset = apply_stage(plan, t, inner, inner_opt, outer if same_step else s.outer,
                                                  finite=finite if same_step else None)
        return inner, inner_opt, outer, outer_opt, residual, report, reset

    def pin(c):
        return (*plan.pin_islands(c[:2]), *pin_exchange(plan, c[2:5]), *c[5:])

    first = (inner, inner_opt, s.outer, s.outer_opt_state, s.residual, no_report(plan), no_reset(plan))
    inner, inner_opt, outer, outer_opt, residual, report, reset = after_inner(plan.schedule, t, events, first, pin)
    new = DiLoCoState(inner, inner_opt, outer, outer_opt, t, residual, s.pending)
    return new, StepReport(t, losses, report, reset)


def deferred_step(plan: Plan, static: DiLoCoState, s: DiLoCoState, batches) -> tuple[DiLoCoState, StepReport]:
    """The exchange of the sync stashed in the previous step, then the stash of this step's
    sync, and the apply. The exchange reads nothing of this step's inner step: free, it may
    run beside it; with `exchange_after_inner` it joins the events after the inner step."""
    t = s.step + 1
    with jax.named_scope("inner_step"):
        inner, inner_opt, losses = inner_step(plan, static.inner_model, s.inner_model, s.inner_opt_state, batches, t)
    exchange = (s.outer, s.outer_opt_state, s.residual, no_report(plan))
    exchanged = None
    if not plan.exchange_after_inner:
        exchanged, exchange = exchange_stage(plan, s.step, s.pending, *exchange[:3])

    def events(c):
        pending, inner, inner_opt, exchange, _ = c
        read = None  # a free exchange has read the stash before the guard starts (its `after`)
        if plan.exchange_after_inner:
            read, exchange = exchange_stage(plan, s.step, pending, *exchange[:3])
        outer = exchange[0]
        with jax.named_scope("diloco_stash"):
            stashed, pending = stash_stage(plan, t, inner, outer, pending, after=read)
        with jax.named_scope("diloco_apply"):
            inner, inner_opt, reset = apply_stage(plan, t, inner, inner_opt, outer, after=stashed)
        return pending, inner, inner_opt, exchange, reset

    def pin(c):
        return plan.pin_stash(c[0]), *plan.pin_islands(c[1:3]), pin_exchange(plan, c[3]), c[4]

    also = plan.schedule.is_sync(s.step) if plan.exchange_after_inner else False
    first = (s.pending, inner, inner_opt, exchange, no_reset(plan))
    pending, inner, inner_opt, (outer, outer_opt, residual, report), reset = after_inner(
        plan.schedule, t, events, first, pin, after=exchanged, also=also)
    new = DiLoCoState(inner, inner_opt, outer, outer_opt, t, residual, pending)
    return new, StepReport(t, losses, report, reset)


def settled_outer(plan: Plan, s: DiLoCoState) -> PyTree:
    """The outer model's arrays with a stashed sync's exchange folded in."""
    _, (outer, *_) = exchange_stage(plan, s.step, s.pending, s.outer, s.outer_opt_state, s.residual)
    return outer


def check_outer_state(plan: Plan, state: DiLoCoState) -> None:
    """The state's outer optimizer states must be the ones this plan's optimizer makes, and
    the state must carry per-island outer copies exactly when the plan delays its updates."""
    if plan.delayed != (state.island_outer is not None):
        raise ValueError(
            "delayed_outer: the state was made by a DiLoCo with another delayed_outer setting; "
            "make it with this DiLoCo's init")
    outer = params(state.outer)
    want = jax.eval_shape(lambda: tuple(plan.outer_optimizer.init(plan.fragments.take(outer, f))
                                        for f in range(plan.fragments.num_fragments)))
    have = state.outer_opt_state
    if plan.delayed:
        have = jax.eval_shape(lambda: jax.tree.map(lambda x: x[0], state.island_outer.opt_state))
    if jax.tree.structure(want) != jax.tree.structure(have):
        raise ValueError(
            "outer_optimizer: the state's outer optimizer states do not have the structure this "
            "DiLoCo's outer optimizer makes; make the state with this DiLoCo's init")


def run_step(plan: Plan, batches: PyTree, state: DiLoCoState) -> tuple[DiLoCoState, dict[str, Array]]:
    """One global step on placed island-major batches (K, GBS/K, ...); what `DiLoCo.step` jits.
    The new state keeps the layout of the old one (so the step compiles once)."""
    plan = plan.for_model(state.outer)
    check_outer_state(plan, state)
    arrays, static = eqx.partition(state, eqx.is_array)
    step = partial(deferred_step if plan.deferred else direct_step, plan, static)
    layout = state_shardings(arrays, plan.mesh, plan.param_specs)

    def body(arrays, batches):  # the state keeps its layout in and out of the body
        new, report = step(mesh_lib.pin(arrays, layout), batches)
        return mesh_lib.pin(new, layout), report

    specs = state_specs(arrays)
    body = plan.islands.program(body, in_specs=(specs, mesh_lib.ISLANDS),
                                out_specs=(specs, StepReport.specs(not plan.cfg.codec.lossless)))
    new, report = body(arrays, batches)
    return eqx.combine(mesh_lib.pin(new, layout), static), report.as_dict()


def run_settle(plan: Plan, state: DiLoCoState) -> eqx.Module:
    """The outer model with every sync up to `state.step` folded in; what `DiLoCo.outer_model` jits."""
    plan = plan.for_model(state.outer)
    arrays, static = eqx.partition(state, eqx.is_array)
    settle = delayed.consensus if plan.delayed else settled_outer
    body = plan.islands.program(partial(settle, plan), in_specs=(state_specs(arrays),),
                                out_specs=mesh_lib.REPLICATED)
    return eqx.combine(body(arrays), static.outer)
