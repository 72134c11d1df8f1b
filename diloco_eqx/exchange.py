"""The sync of one fragment: each island's pseudo-gradient, their mean over the islands that
contribute (the only cross-island collective), and one outer step on the fragment.

The direct form (`sync_stage`) does all of it in the step of the sync. The deferred form
(V >= 1) splits it: `stash_stage` keeps each island's pseudo-gradient at the sync, and the
next step's `exchange_stage` takes the mean and the outer step from the stash alone, so
nothing in that step's inner step waits for it. A lossless sync is first taken unchecked
and, only if its result is not trusted, again checked (`checked_again`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, PyTree

from diloco_eqx import sync
from diloco_eqx.events import when
from diloco_eqx.plan import Plan, params
from diloco_eqx.schedule import RECHECK_SCOPE
from diloco_eqx.sync import SyncMetrics


def island_deltas(plan: Plan, f: int, inner: PyTree, outer: PyTree,
                  blocks: bool = False) -> tuple[PyTree, Bool[Array, " k"]]:
    """Each island's pseudo-gradient of fragment f, and whether the island's own fragment is
    finite (no communication); with `blocks`, layer leaves as `Blocks` (see `take`)."""
    take = partial(plan.fragments.take, blocks=blocks)
    outer_f = plan.on_islands(take(params(outer), f), like_outer=True)
    inner = plan.pin_islands(inner)  # the islands are read where they live, not moved first

    def one(island, o):
        own = take(params(island), f)
        return sync.pseudo_gradient(o, own), sync.all_finite(own)

    deltas, finite = plan.islands.map(one, inner, outer_f)
    return plan.pin_islands(deltas, like_outer=True), finite


def exchange_fragment(plan: Plan, f: int, t_sync, deltas, finite, outer, outer_opt, residual, checked: bool = True):
    """The mean of fragment f's pseudo-gradients over the islands that contribute to the sync
    at `t_sync` (finite ones the fault model lets through), and one outer step on f with f's
    own optimizer state; if no island contributes, the outer fragment and its state stay as
    they were. Returns (outer, its optimizer states, residual, report, which islands are
    finite, whether the sync was trusted).

    Unchecked (`checked=False`, lossless codecs only), `finite` is not read: the mean is
    taken as if every island were finite, and its norm tells, since one non-finite island
    makes it non-finite. Only a finite norm with every island sending is trusted (then
    every island is known finite, for an apply in the same step) and stepped on; otherwise
    `checked_again` does the sync again, checked, with the numbers of checking first. So a
    healthy sync reads no island's fragment twice."""
    frags, islands, cfg = plan.fragments, plan.islands, plan.cfg
    missing = cfg.fault_model.missing(t_sync, islands.ids(), deltas)
    weights = plan.island_weights(t_sync)
    outer_f = frags.take(params(outer), f)
    res_f = None if residual is None else islands.map(lambda r: frags.take(r, f), residual)
    # unchecked, ids + t >= 0 stands in for `finite`: always true, but like the flags it varies
    # over the islands and is read from the event loop's own copy of t (see `checked_again`),
    # so that XLA keeps the count's collective inside the loop
    sent = ~missing & (finite if checked else islands.ids() + t_sync >= 0)
    mean, count, res_f, err = sync.mean_pseudo_gradient(cfg.codec, deltas, sent, res_f, outer_f, islands,
                                                        weights=weights, decay=cfg.error_decay)
    mean = frags.join(mean)
    if residual is not None:
        residual = islands.map(lambda r, e: frags.put(r, f, e), residual, res_f)
    pg_norm = sync.tree_norm(mean)
    trusted = jnp.asarray(True)
    if not checked:
        trusted = jnp.isfinite(pg_norm) & (count == plan.num_islands)
        finite = all_finite_islands(plan)
    # a loop of zero or one trip, not a select: the outer state is updated in place and the
    # mean read once (t_sync >= 0 always; it keeps XLA from folding a loop of known count)
    no_update = jnp.zeros((), jnp.float32)
    outer, outer_opt, update_norm = when((count > 0) & trusted & (t_sync >= 0), 0, [partial(outer_update, plan, f)],
                                         (outer, outer_opt, no_update), mean)
    return outer, outer_opt, residual, SyncMetrics(pg_norm, update_norm, count, err), finite, trusted


def outer_update(plan: Plan, f: int, carry, mean):
    """One outer step on fragment f from the mean pseudo-gradient: (outer, its optimizer
    states, the update's norm)."""
    outer, outer_opt, _ = carry
    frags = plan.fragments
    outer_f = frags.take(params(outer), f)
    update, new_opt = sync.outer_updates(plan.outer_optimizer, mean, outer_opt[f], outer_f)
    outer_opt = (*outer_opt[:f], new_opt, *outer_opt[f + 1:])
    return frags.update(outer, f, sync.apply_update, update), outer_opt, sync.tree_norm(update)


def sync_fragment(plan: Plan, f: int, t, inner, outer, outer_opt, residual, checked: bool = True):
    """Sync of fragment f inside step t: pseudo-gradients, exchange, outer step."""
    with jax.named_scope(f"fragment_{f}"):
        # lossless, the mean is taken block by block; a codec sees each leaf of f whole
        deltas, finite = island_deltas(plan, f, inner, outer, blocks=plan.cfg.codec.lossless)
        return exchange_fragment(plan, f, t, deltas, finite, outer, outer_opt, residual, checked)


def exchange_stashed(plan: Plan, f: int, t_sync, pending, outer, outer_opt, residual, checked: bool = True):
    """The exchange of the sync stashed at `t_sync` (the previous step): reads only the stash
    and the outer state, never this step's inner work."""
    with jax.named_scope(f"fragment_{f}"):
        like = plan.stashed_like(outer, f)
        deltas = plan.islands.map(lambda row: plan.stash.unpack(row, like), plan.pin_stash(pending))
        deltas = plan.pin_islands(deltas, like_outer=True)
        finite = plan.islands.map(sync.all_finite, deltas)  # of a finite outer fragment: the island's
        return exchange_fragment(plan, f, t_sync, deltas, finite, outer, outer_opt, residual, checked)


def stash_fragment(plan: Plan, f: int, pending, inner, outer):
    """At a sync with V >= 1: keep each island's pseudo-gradient of f for the next step, in
    place of the stash's rows (the stash holds one fragment; the previous one was exchanged
    at the start of this step)."""
    deltas = island_deltas(plan, f, inner, outer, blocks=True)[0]
    return plan.islands.map(plan.stash.pack, deltas, plan.pin_stash(pending))


def no_exchange(plan: Plan, outer, outer_opt, residual):
    return outer, outer_opt, residual, no_report(plan), all_finite_islands(plan), jnp.asarray(True)


def all_finite_islands(plan: Plan) -> Bool[Array, " k"]:
    """Every island of this device finite: what a step without a sync found."""
    return plan.islands.local(jnp.ones((plan.islands.local_count,), bool))


def no_report(plan: Plan) -> SyncMetrics:
    """The sync report of a step without an exchange: zeros."""
    return SyncMetrics.zeros(plan.islands, not plan.cfg.codec.lossless)


def pin_exchange(plan: Plan, out):
    outer, outer_opt, residual, *rest = out
    return plan.pin_outer(outer), plan.pin_outer(outer_opt), plan.pin_islands(residual), *rest


def checked_again(plan: Plan, t, f, exchange: Callable, first, source, count: bool = False):
    """The sync event at step `t` (of fragment f(t), if t is a sync step), taken unchecked
    (lossless codecs), then, if it was not trusted, again checked (see `exchange_fragment`);
    `exchange(f, t, source, outer, outer_opt, residual, checked=)` is one fragment's. With
    `count`, the trips of both. The second pass is an event of its own, not nested in the
    first's loop, so its temporaries are not added to the first's (where the deferred
    exchange runs beside the inner step, they would meet the activations)."""
    p, pin, predicate = plan.schedule.num_fragments, partial(pin_exchange, plan), plan.schedule.is_sync(t)
    lossless = plan.cfg.codec.lossless
    branches = [lambda c, src, t, f=f: exchange(f, t, src, *c[:3], checked=not lossless) for f in range(p)]
    ran, out = when(predicate, f, branches, first, source, t, pin=pin, count=True)
    if lossless:
        again = [lambda c, src, t, f=f: exchange(f, t, src, *c[:3], checked=True) for f in range(p)]
        with jax.named_scope(RECHECK_SCOPE):
            ran_again, out = when(predicate & ~out[5], f, again, out, source, t, pin=pin, count=True)
        ran = ran + ran_again
    return (ran, out) if count else out


def sync_stage(plan: Plan, t, inner, outer, outer_opt, residual):
    """The direct form: the sync of fragment f(t), if t is a sync step: (outer, its optimizer
    states, residual, report, which islands the sync found finite)."""
    out = checked_again(plan, t, plan.schedule.fragment_at(t), partial(sync_fragment, plan),
                        no_exchange(plan, outer, outer_opt, residual), inner)
    return out[:5]


def exchange_stage(plan: Plan, t_sync, pending, outer, outer_opt, residual):
    """The deferred form: the exchange of a sync stashed at `t_sync`, if it was a sync step,
    with its checked second pass: (trips run, (outer, its optimizer states, residual, report))."""
    with jax.named_scope("diloco_sync"):
        ran, out = checked_again(plan, t_sync, plan.schedule.fragment_at(t_sync), partial(exchange_stashed, plan),
                                 no_exchange(plan, outer, outer_opt, residual), pending, count=True)
    return ran, out[:4]


def stash_stage(plan: Plan, t, inner, outer, pending, after=None):
    """The stash of fragment f(t), if t is a sync step, once the exchange that counted
    `after` has read the previous one; returns (trips run, stash)."""
    s, p = plan.schedule, plan.schedule.num_fragments
    branches = [lambda pend, i, o, f=f: stash_fragment(plan, f, pend, i, o) for f in range(p)]
    return when(s.is_sync(t), s.fragment_at(t), branches, pending, inner, outer, pin=plan.pin_stash,
                after=after, count=True)
