"""Delayed outer updates: each exchange stays in flight for d = `outer_delay` rounds, so the
islands never wait for it (delayed_outer = "naive" or "eager").

A round of fragment f is one of its syncs; r counts them (r = t div H_eff). The mean Δ̄(r)
of the islands' pseudo-gradients sent at round r arrives at round r + d. At round r
island k takes one outer step, on its own copy of the outer fragment, on

    naive:  Δ̃_k(r) = Δ̄(r − d)
    eager:  Δ̃_k(r) = ŵ_k·Δ_k(r) + Δ̄(r − d) − w_k(r − d)·Δ_k(r − d)

where Δ_k is island k's pseudo-gradient against its own outer copy, w_k(r) its weight in
the mean Δ̄(r) (1/K when every island contributes with uniform weighting), and ŵ_k the
weight it expects to have (1/K uniform; its token share). Eager uses the island's fresh
pseudo-gradient in place of its stale share of the arrived mean, so the arrived part is
the mean of the *other* islands. Before the first arrival the arrived part is zero. The
islands' outer copies (and outer optimizer states) are identical with naive and differ
with eager; the model evaluated is their mean (`consensus`).

What is in flight is kept by each island as what it will add on arrival,
u_k(r) = Δ̄(r) − [eager] w_k(r)·Δ_k(r), in slot r mod d of `IslandOuter.in_flight`.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from diloco_eqx import speeds, sync
from diloco_eqx.apply import apply_stage, no_reset
from diloco_eqx.events import after_inner, when, written_out
from diloco_eqx.exchange import all_finite_islands, no_report
from diloco_eqx.plan import Plan, StepReport, params
from diloco_eqx.schedule import Schedule, Step
from diloco_eqx.state import DiLoCoState, IslandOuter
from diloco_eqx.sync import SyncMetrics


def slot(schedule: Schedule, delay: int, t: Step) -> Int[Array, ""]:
    """The in-flight slot of the round synced at step t: (t div H_eff) mod d."""
    return (jnp.asarray(t) // schedule.period) % delay


def read_slot(in_flight: tuple[PyTree, ...], j: Int[Array, ""]) -> PyTree:
    """Slot j of the in-flight trees (one select per slot: d is a few rounds)."""
    out = in_flight[0]
    for i, tree in enumerate(in_flight[1:], start=1):
        out = jax.tree.map(lambda a, b, i=i: jnp.where(j == i, b, a), out, tree)
    return out


def write_slot(in_flight: tuple[PyTree, ...], j: Int[Array, ""], value: PyTree) -> tuple[PyTree, ...]:
    """The in-flight trees with slot j replaced by `value`."""
    if len(in_flight) == 1:
        return (value,)
    return tuple(jax.tree.map(lambda old, new, i=i: jnp.where(j == i, new, old), tree, value)
                 for i, tree in enumerate(in_flight))


def outer_delta(mode: str, fresh: PyTree, expected_share: Float[Array, ""], arrived: PyTree) -> PyTree:
    """Δ̃_k: what island k steps its outer copy on (one island, one fragment)."""
    if mode == "naive":
        return arrived
    return jax.tree.map(lambda d, a: expected_share.astype(d.dtype) * d + a, fresh, arrived)


def in_flight_part(mode: str, mean: PyTree, fresh: PyTree, share: Float[Array, ""]) -> PyTree:
    """u_k: what island k will add when this round's mean arrives (one island, one fragment)."""
    if mode == "naive":
        return mean
    return jax.tree.map(lambda m, d: m - share.astype(d.dtype) * d, mean, fresh)


# ---------------------------------------------------------------- the variant's step


def sync_fragment(plan: Plan, f: int, t, inner, island_outer: IslandOuter):
    """Round t of fragment f with the exchange in flight for `outer_delay` rounds: each island
    steps its own outer copy on the rule in this module's docstring, and keeps this round's
    mean for the round it arrives in. The mean is taken now (the numbers); that it would cross
    the link during the next rounds is what the mode models. Fragments are read as `Blocks`
    and written block by block in place, as in `exchange.sync_fragment`."""
    frags, islands, cfg = plan.fragments, plan.islands, plan.cfg
    take, mode = partial(frags.take, blocks=True), cfg.delayed_outer
    with jax.named_scope(f"fragment_{f}"):
        own_outer = islands.map(lambda o: take(o, f), island_outer.params)

        def one(island, o):
            own = take(params(island), f)
            return sync.pseudo_gradient(o, own), sync.all_finite(own)

        deltas, finite = islands.map(one, plan.pin_islands(inner), own_outer)
        ok = finite & ~cfg.fault_model.missing(t, islands.ids(), deltas)
        weights = plan.island_weights(t)
        mean, count, _, _ = sync.mean_pseudo_gradient(cfg.codec, deltas, ok, None, None, islands, weights=weights)
        w = jnp.ones(ok.shape, jnp.float32) if weights is None else weights
        ok = ok & (w > 0)
        share = jnp.where(ok, w, 0.0) / jnp.maximum(islands.sum(jnp.where(ok, w, 0.0)), 1e-30)
        expected = w / jnp.sum(jnp.asarray(_all_weights(plan, t)))
        fresh = jax.tree.map(lambda d: sync._per_island(finite, d, 0.0), deltas)
        j = slot(plan.schedule, cfg.outer_delay, t)
        slot_now = read_slot(island_outer.in_flight, j)
        arrived = islands.map(lambda u: take(u, f), slot_now)
        # Every read of the old outer copies and in-flight slot ends in these buffers, which
        # both in-place writes then read, so each write waits for them. Without them the outer
        # write reads the slot and the slot's write reads the outer copies (through the mean):
        # no order of the two writes is in place, and XLA copies both whole trees.
        mean, fresh, arrived = written_out((frags.join(mean), islands.map(frags.join, fresh) if mode == "eager"
                                            else None, islands.map(frags.join, arrived)), t)
        step_on = islands.map(partial(outer_delta, mode), fresh, expected, arrived)
        u = islands.map(lambda d, sh: in_flight_part(mode, mean, d, sh), fresh, share)
        update, new_opt = islands.map(lambda d, st, o: sync.outer_updates(plan.outer_optimizer, d, st, frags.join(o)),
                                      step_on, island_outer.opt_state[f], own_outer)
        new_outer = islands.map(lambda o, up: frags.update(o, f, sync.apply_update, up), island_outer.params, update)
        slot_j = islands.map(lambda all_u, uf: frags.put(all_u, f, uf), slot_now, u)
        report = SyncMetrics(sync.tree_norm(mean), islands.mean(islands.map(sync.tree_norm, update)), count, None)
        return IslandOuter(
            new_outer, (*island_outer.opt_state[:f], new_opt, *island_outer.opt_state[f + 1:]),
            write_slot(island_outer.in_flight, j, slot_j)), report, finite


def _all_weights(plan: Plan, t):
    """Every island's weight at a sync at t (uniform: ones), for the share it expects."""
    if plan.cfg.island_weighting == "uniform":
        return jnp.ones((plan.num_islands,), jnp.float32)
    return speeds.steps_since_sync(jnp.asarray(plan.cfg.island_steps, jnp.int32), plan.schedule.period, t)


def delayed_sync_stage(plan: Plan, t, inner, island_outer):
    """The delayed form's sync of fragment f(t), if t is a sync step: (island outer, report,
    which islands the sync found finite)."""
    s, p = plan.schedule, plan.schedule.num_fragments
    branches = [lambda c, i, f=f: sync_fragment(plan, f, t, i, c[0]) for f in range(p)]
    carry = (island_outer, no_report(plan), all_finite_islands(plan))
    return when(s.is_sync(t), s.fragment_at(t), branches, carry, inner,
                pin=lambda out: (plan.pin_islands(out[0]), *out[1:]))


def consensus(plan: Plan, s: DiLoCoState) -> PyTree:
    """The model a delayed run evaluates: the mean of the islands' outer copies."""
    mean = sync.cast_like(plan.islands.mean(s.island_outer.params), params(s.outer))
    return eqx.combine(mean, eqx.filter(s.outer, eqx.is_inexact_array, inverse=True))


def delayed_step(plan: Plan, s: DiLoCoState, t, inner, inner_opt, losses) -> tuple[DiLoCoState, StepReport]:
    """After the inner step, with delayed outer updates (V = 0): each island's outer step on
    its own copy, then the apply from that copy, which takes the
    sync's finding of which islands are finite."""
    def events(c):
        inner, inner_opt, island_outer, _, _ = c
        with jax.named_scope("diloco_sync"):
            island_outer, report, finite = delayed_sync_stage(plan, t, inner, island_outer)
        with jax.named_scope("diloco_apply"):
            inner, inner_opt, reset = apply_stage(plan, t, inner, inner_opt, island_outer.params, per_island=True,
                                                  finite=finite)
        return inner, inner_opt, island_outer, report, reset

    def pin(c):
        return (*plan.pin_islands(c[:3]), *c[3:])

    inner, inner_opt, island_outer, report, reset = after_inner(
        plan.schedule, t, events, (inner, inner_opt, s.island_outer, no_report(plan), no_reset(plan)), pin)
    new = dataclasses.replace(s, inner_model=inner, inner_opt_state=inner_opt, step=t, island_outer=island_outer)
    return new, StepReport(t, losses, report, reset)
