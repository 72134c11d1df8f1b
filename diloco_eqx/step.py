"""The compiled global step of DiLoCo and Streaming DiLoCo, as named pure functions over a
static `Plan`.

One step, in order: the inner step on every island; t += 1; the sync stage (fragment f(t):
pseudo-gradients, their mean over the contributing islands, one outer step on f); the apply
stage (fragment f(t−V): blend the outer fragment into every island, or reset an island
whose fragment went non-finite). Every schedule event is built by `when` (one loop of zero
or one trip per fragment, on the schedule), so the step compiles once.
Vanilla DiLoCo is the one-fragment, V = 0 case of the same functions.

With V >= 1 the exchange is deferred (`deferred_step`): the sync stage of step t only
stashes each island's pseudo-gradient, and step t+1 begins with the exchange and outer step
on that stash — work that nothing in its inner step depends on, so the collective can run
while the inner step computes (`analysis.critical_path` checks it). The numbers are those
of the direct form (`direct_step`).

Every cross-island operation goes through the plan's `Islands` backend (`islands.py`): by
default the body runs inside `jax.shard_map` over the "diloco" axis, with specs from the
state's fields (`state_specs`); with `backend="drjax"` it is a drjax program under plain jit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PyTree

from diloco_eqx import compiler
from diloco_eqx import delayed as delayed_lib
from diloco_eqx import mesh as mesh_lib
from diloco_eqx import speeds
from diloco_eqx import stash as stash_lib
from diloco_eqx import sync
from diloco_eqx.islands import Islands, make_islands
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import Fragmentation, default_layers
from diloco_eqx.metrics import StepMetrics
from diloco_eqx.schedule import EVENT_SCOPE, RECHECK_SCOPE
from diloco_eqx.state import DiLoCoState, state_shardings, state_specs
from diloco_eqx.stash import Stash
from diloco_eqx.sync import SyncMetrics

LossFn = Callable[[eqx.Module, PyTree], Float[Array, ""]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about a run's step; bound into the step functions with `partial`.
    `fragments` is filled in from the state's outer model when the step is traced."""

    cfg: DiLoCoConfig
    loss_fn: LossFn
    inner_optimizer: optax.GradientTransformation
    outer_optimizer: optax.GradientTransformation
    mesh: Mesh | None
    layers: Callable[[Any], Any]
    deferred: bool
    param_specs: mesh_lib.ParamSpecs | None = None
    backend: str = "shard_map"
    exchange_after_inner: bool = False
    fragments: Fragmentation | None = None
    stash: Stash | None = None

    @property
    def schedule(self):
        return self.cfg.schedule

    @property
    def alpha(self) -> float:
        return float(self.cfg.alpha) if self.cfg.streaming else 0.0

    @property
    def num_islands(self) -> int:
        return self.cfg.num_replicas

    @property
    def delayed(self) -> bool:
        """Whether exchanges stay in flight for whole rounds (delayed_outer naive or eager)."""
        return self.cfg.delayed_outer != "none"

    def island_steps(self) -> Int[Array, " k"]:
        """Inner steps per period of each island the body sees."""
        return jnp.asarray(self.cfg.island_steps, jnp.int32)[self.islands.ids()]

    def island_weights(self, t) -> Float[Array, " k"] | None:
        """Each seen island's weight in the mean of a sync at t (None: uniform)."""
        if self.cfg.island_weighting == "uniform":
            return None
        return speeds.steps_since_sync(self.island_steps(), self.schedule.period, t)

    @property
    def islands(self) -> Islands:
        """The island operations of the chosen backend."""
        return make_islands(self.backend, self.mesh, self.cfg.num_replicas)

    def pin_islands(self, tree: PyTree, like_outer: bool = False) -> PyTree:
        """Island leaves (a leading island axis) kept in their layout inside an island, or in
        the outer leaves' layout (`like_outer`: split over all of the island's devices)."""
        return self._pin(tree, True, mesh_lib.default_outer_specs if like_outer else mesh_lib.default_param_specs)

    def pin_outer(self, tree: PyTree) -> PyTree:
        """Outer leaves kept in their layout (split over the island's devices)."""
        return self._pin(tree, False, mesh_lib.default_outer_specs)

    def on_islands(self, tree: PyTree, like_outer: bool = False) -> PyTree:
        """Outer leaves copied to each island the body sees (a leading island axis), laid out
        like an island's leaves, or `like_outer`. Any reshard then happens inside each island:
        from a value replicated over the islands, GSPMD may fetch pieces from any of them."""
        return self.pin_islands(self.islands.broadcast(tree), like_outer)

    def pin_stash(self, rows: PyTree) -> PyTree:
        """Stash rows (a leading island axis) kept in their layout: one row per device."""
        return mesh_lib.pin(rows, mesh_lib.shardings(rows, self.mesh, True, stash_lib.row_spec))

    def _pin(self, tree: PyTree, on_islands: bool, default) -> PyTree:
        specs = self.param_specs or default(self.mesh)
        return mesh_lib.pin(tree, mesh_lib.shardings(tree, self.mesh, on_islands, specs))

    def for_model(self, model: eqx.Module) -> Plan:
        frags = Fragmentation.from_model(model, self.cfg, self.layers)
        stash = stash_lib.for_model(params(model), frags, self.mesh, self.param_specs) if self.deferred else None
        return dataclasses.replace(self, fragments=frags, stash=stash)

    def stashed_like(self, outer: PyTree, f: int) -> PyTree:
        """Shapes and dtypes of one island's stashed pseudo-gradient of fragment f."""
        return jax.eval_shape(partial(self.fragments.take, f=f), stash_lib.deltas_like(params(outer)))


class StepReport(eqx.Module):
    """The device-side metrics of one step (see `StepMetrics` for the host-side keys)."""

    step: Int[Array, ""]
    loss_island: Float[Array, " k"]
    sync: SyncMetrics
    reset_island: Bool[Array, " k"]

    @staticmethod
    def specs(compressed: bool) -> StepReport:
        r, i = mesh_lib.REPLICATED, mesh_lib.ISLANDS
        return StepReport(r, i, SyncMetrics(r, r, r, i if compressed else None), i)

    def as_dict(self) -> dict[str, Array]:
        out = {"step": self.step, "loss_island": self.loss_island, "reset_island": self.reset_island,
               "pseudo_grad_norm": self.sync.pseudo_grad_norm,
               "outer_update_norm": self.sync.outer_update_norm,
               "islands_contributed": self.sync.islands_contributed}
        if self.sync.compression_error is not None:
            out["compression_error"] = self.sync.compression_error
        return out


def params(tree: PyTree) -> PyTree:
    return eqx.filter(tree, eqx.is_inexact_array)


def when(predicate, f, branches: Sequence[Callable], carry, *invariants, pin: Callable = lambda out: out,
         after: Int[Array, ""] | None = None, count: bool = False, zero: bool = False):
    """`branches[f](carry, *invariants)` when `predicate` holds, else `carry`: the one shape
    of every schedule event, so the step compiles once.

    Each branch is its own loop of zero or one trip (f = j), with no conditional inside: XLA
    updates a loop's carry in place, where a conditional copies an operand that a branch
    writes into (or passes through) on every step. With several branches, their loops sit
    inside one guard loop on `predicate`, so a step without the event tests one predicate,
    not one per fragment (XLA:GPU reads each loop's predicate on the host). The invariants
    reach each body through a select on its trip counter, so XLA cannot hoist work that
    reads only them out of the loop to run on every step; with `zero`, they reach it as they
    are, after a zero that XLA sees change with the trip (`branch(carry, zero, *invariants)`),
    for a body that reads only a fragment of them through it (`Fragmentation.take(at=)`):
    the select would copy all of each invariant. `pin` fixes the carry's layout
    on an island mesh. `count` returns (trips run, carry); given as `after` to another
    event, that event's loops wait for this one (their trip counts read it), so this one
    may read what the other updates in place without XLA copying it."""
    trips = jnp.asarray(predicate).astype(jnp.int32)
    if after is not None:  # still `trips`, as after >= 0
        trips = jnp.maximum(trips, jnp.minimum(after, 0))
    with jax.named_scope(EVENT_SCOPE):
        if len(branches) == 1:
            ran, carry = _once(trips, branches[0], pin(carry), invariants, pin, zero)
        else:
            def each(state, *_):
                ran, c = state
                for j, branch in enumerate(branches):
                    trip, c = _once((f == j).astype(jnp.int32), branch, c, invariants, pin, zero)
                    ran = ran + trip
                return ran, c

            _, (ran, carry) = _once(trips, each, (jnp.zeros((), jnp.int32), pin(carry)), (), lambda out: out)
    return (ran, carry) if count else carry


def _once(trips: Int[Array, ""], branch: Callable, carry, invariants: tuple, pin: Callable, zero: bool = False):
    """`branch(carry, *invariants)` as a loop of `trips` (0 or 1) trips: (trips run, carry)."""
    def body(state):
        trip, c = state
        args = ((trip < 0).astype(jnp.int32), *invariants) if zero else _loop_variant(trip, invariants)
        return trip + 1, pin(branch(c, *args))

    return lax.while_loop(lambda state: state[0] < trips, body, (jnp.zeros((), jnp.int32), carry))


def _loop_variant(trip: Int[Array, ""], tree: PyTree) -> PyTree:
    """`tree` as a value XLA sees as changing with the loop's trip (trip >= 0 always);
    typed PRNG keys, which have no zero, pass through."""
    def one(x):
        if not eqx.is_array(x) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        return jnp.where(trip >= 0, x, jnp.zeros((), x.dtype))

    return jax.tree.map(one, tree)


def written_out(tree: PyTree, t: Int[Array, ""]) -> PyTree:
    """`tree` written to buffers of its own: passed through a loop of no trips that XLA
    cannot see has none (t >= 0). A reader of cheap elementwise work otherwise recomputes it
    in its own fusion from the inputs (an optimization barrier does not stop XLA:CPU)."""
    def body(state):
        trip, x = state
        return trip + 1, _loop_variant(trip, x)

    trips = (jnp.asarray(t) < 0).astype(jnp.int32)
    return lax.while_loop(lambda state: state[0] < trips, body, (jnp.zeros((), jnp.int32), tree))[1]


# ---------------------------------------------------------------- the inner step


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


# ---------------------------------------------------------------- sync of one fragment


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
    first's loop: nested, its temporaries joined the first's, and where the deferred exchange
    is free to run beside the inner step they met the activations (10M on CPU, allocated
    extra over the formula: 1.05 -> 1.23)."""
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


# ---------------------------------------------------------------- delayed outer updates


def sync_fragment_delayed(plan: Plan, f: int, t, inner, island_outer: delayed_lib.IslandOuter):
    """Round t of fragment f with the exchange in flight for `outer_delay` rounds: each island
    steps its own outer copy on the rule of delayed.py, and keeps this round's mean for the
    round it arrives in. The mean is taken now (the numbers); that it would cross the link
    during the next rounds is what the mode models. Fragments are read as `Blocks` and
    written block by block in place, as in `sync_fragment`."""
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
        j = delayed_lib.slot(plan.schedule, cfg.outer_delay, t)
        slot_now = delayed_lib.read_slot(island_outer.in_flight, j)
        arrived = islands.map(lambda u: take(u, f), slot_now)
        # Every read of the old outer copies and in-flight slot ends in these buffers (one
        # array each, as the outer state holds f), which both in-place writes then read: each
        # write waits for them, where the outer write reading the slot and the slot's write
        # reading the outer copies (through the mean) left XLA no order for them and it copied
        # both whole trees on every sync.
        mean, fresh, arrived = written_out((frags.join(mean), islands.map(frags.join, fresh) if mode == "eager"
                                            else None, islands.map(frags.join, arrived)), t)
        step_on = islands.map(partial(delayed_lib.outer_delta, mode), fresh, expected, arrived)
        u = islands.map(lambda d, sh: delayed_lib.in_flight_part(mode, mean, d, sh), fresh, share)
        update, new_opt = islands.map(lambda d, st, o: sync.outer_updates(plan.outer_optimizer, d, st, frags.join(o)),
                                      step_on, island_outer.opt_state[f], own_outer)
        new_outer = islands.map(lambda o, up: frags.update(o, f, sync.apply_update, up), island_outer.params, update)
        slot_j = islands.map(lambda all_u, uf: frags.put(all_u, f, uf), slot_now, u)
        report = SyncMetrics(sync.tree_norm(mean), islands.mean(islands.map(sync.tree_norm, update)), count, None)
        return delayed_lib.IslandOuter(
            new_outer, (*island_outer.opt_state[:f], new_opt, *island_outer.opt_state[f + 1:]),
            delayed_lib.write_slot(island_outer.in_flight, j, slot_j)), report, finite


def _all_weights(plan: Plan, t):
    """Every island's weight at a sync at t (uniform: ones), for the share it expects."""
    if plan.cfg.island_weighting == "uniform":
        return jnp.ones((plan.num_islands,), jnp.float32)
    return speeds.steps_since_sync(jnp.asarray(plan.cfg.island_steps, jnp.int32), plan.schedule.period, t)


def delayed_sync_stage(plan: Plan, t, inner, island_outer):
    """The delayed form's sync of fragment f(t), if t is a sync step: (island outer, report,
    which islands the sync found finite)."""
    s, p = plan.schedule, plan.schedule.num_fragments
    branches = [lambda c, i, f=f: sync_fragment_delayed(plan, f, t, i, c[0]) for f in range(p)]
    carry = (island_outer, no_report(plan), all_finite_islands(plan))
    return when(s.is_sync(t), s.fragment_at(t), branches, carry, inner,
                pin=lambda out: (plan.pin_islands(out[0]), *out[1:]))


def consensus(plan: Plan, s: DiLoCoState) -> PyTree:
    """The model a delayed run evaluates: the mean of the islands' outer copies."""
    mean = sync.cast_like(plan.islands.mean(s.island_outer.params), params(s.outer))
    return eqx.combine(mean, eqx.filter(s.outer, eqx.is_inexact_array, inverse=True))


# ---------------------------------------------------------------- apply of one fragment


def apply_fragment(plan: Plan, f: int, inner, inner_opt, outer, per_island: bool = False, finite=None, at=None):
    """Every island takes outer fragment f, blended with α, and says whether its own fragment
    f was not finite (checked here, or `finite` as this step's sync of f found it): those are
    reset (`reset_islands`), here when the backend cannot branch on island values, else by
    `apply_stage`. `at` reads the outer fragment inside an event's loop (see `when`).
    Returns (islands, their optimizer states, which were found non-finite)."""
    take = plan.fragments.take
    if per_island:  # delayed outer updates: each island's own outer copy
        outer_f = plan.islands.map(lambda o: take(o, f, at), outer)
    else:
        outer_f = plan.on_islands(take(params(outer), f, at))
    inner = plan.pin_islands(inner)

    def one(island, o, ok=None):
        bad = ~sync.all_finite(take(params(island), f)) if ok is None else ~ok
        # a non-finite island keeps its fragment until its reset; reading `bad` here also
        # orders the check before the write, so the island is updated in place
        mix = lambda x, y: jnp.where(bad, x, sync.blend(x, y, plan.alpha))  # noqa: E731
        return plan.fragments.update(island, f, mix, o), bad

    inner, bad = plan.islands.map(one, inner, outer_f, *(() if finite is None else (finite,)))
    if not plan.islands.local_branches:  # a branch on `bad` would gather it from every island
        return (*reset_islands(plan, bad, inner, inner_opt, outer, per_island), bad)
    return inner, inner_opt, bad


def reset_islands(plan: Plan, bad, inner, inner_opt, outer, per_island: bool = False):
    """Islands flagged in `bad` take the outer model (in their own dtypes; with
    `per_island`, each its own outer copy), and every leaf of their inner optimizer state
    that is not finite restarts from `init` on it (finite leaves, such as step counts, are
    kept so schedules continue)."""
    whole = outer if per_island else plan.on_islands(params(outer))
    fresh = sync.cast_like(whole, params(inner))
    fresh_opt = plan.islands.map(plan.inner_optimizer.init, fresh)

    def pick(x, new, only_non_finite):
        if not eqx.is_inexact_array(x):
            return x
        drop = bad
        if only_non_finite:
            drop = drop & ~jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)))
        return jnp.where(drop.reshape(-1, *[1] * (x.ndim - 1)), new, x)

    new_params = jax.tree.map(lambda x, n: pick(x, n, False), params(inner), fresh)
    inner = eqx.combine(new_params, eqx.filter(inner, eqx.is_inexact_array, inverse=True))
    return inner, jax.tree.map(lambda x, n: pick(x, n, True), inner_opt, fresh_opt)


def apply_stage(plan: Plan, t, inner, inner_opt, outer, after=None, per_island: bool = False, finite=None):
    """The apply of fragment f(t−V), if t is an apply step, and the reset of any island found
    non-finite; after the event that counted `after` (see `when`). `outer` is the outer
    model, or with `per_island` each island's outer copy; `finite` (V = 0) says which
    islands this step's sync found finite. Returns (islands, their optimizer states, which
    were reset)."""
    s, p = plan.schedule, plan.schedule.num_fragments
    reset = lambda c, b, o: reset_islands(plan, b, *c, o, per_island)  # noqa: E731

    def branch(c, zero, o, *ok, f):
        inner, inner_opt, bad = apply_fragment(plan, f, c[0], c[1], o, per_island, *ok, at=zero)
        if plan.islands.local_branches:  # each device slice resets its own islands, when one is bad
            inner, inner_opt = when(jnp.any(bad), 0, [reset], (inner, inner_opt), bad, o, pin=plan.pin_islands)
        return inner, inner_opt, bad

    outer = outer if per_island else params(outer)
    return when(s.is_apply(t), s.fragment_at(t - s.overlap_steps), [partial(branch, f=f) for f in range(p)],
                (inner, inner_opt, no_reset(plan)), outer, *(() if finite is None else (finite,)),
                pin=lambda out: (*plan.pin_islands(out[:2]), out[2]), after=after, zero=True)


# ---------------------------------------------------------------- whole steps


def direct_step(plan: Plan, static: DiLoCoState, s: DiLoCoState, batches) -> tuple[DiLoCoState, StepReport]:
    """Inner step, sync (exchange included) and apply, all in step t."""
    t = s.step + 1
    with jax.named_scope("inner_step"):
        inner, inner_opt, losses = inner_step(plan, static.inner_model, s.inner_model, s.inner_opt_state, batches, t)
    if plan.delayed:
        return delayed_step(plan, s, t, inner, inner_opt, losses)
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

    inner, inner_opt, outer, outer_opt, residual, report, reset = after_inner(
        plan, t, events, (inner, inner_opt, s.outer, s.outer_opt_state, s.residual, no_report(plan), no_reset(plan)),
        pin)
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
    pending, inner, inner_opt, (outer, outer_opt, residual, report), reset = after_inner(
        plan, t, events, (s.pending, inner, inner_opt, exchange, no_reset(plan)), pin, after=exchanged, also=also)
    new = DiLoCoState(inner, inner_opt, outer, outer_opt, t, residual, pending)
    return new, StepReport(t, losses, report, reset)


def after_inner(plan: Plan, t, events: Callable, carry, pin: Callable, after=None, also=False):
    """`events(carry)`, the schedule events that follow step t's inner step, inside one guard
    loop on whether any of them fires at t (a sync or an apply, or `also`): a step without an
    event tests one predicate after its inner step, not one per event (on XLA:GPU each is a
    read on the host, and the step's call returns only after the last). `after` as in `when`."""
    s = plan.schedule
    return when(s.is_sync(t) | s.is_apply(t) | also, 0, [events], carry, pin=pin, after=after)


def no_reset(plan: Plan) -> Bool[Array, " k"]:
    """No island of this device reset: the apply's report on a step without one."""
    return plan.islands.local(jnp.zeros((plan.islands.local_count,), bool))


def delayed_step(plan: Plan, s: DiLoCoState, t, inner, inner_opt, losses) -> tuple[DiLoCoState, StepReport]:
    """After the inner step, with delayed outer updates (V = 0): each island's outer step on
    its own copy, then the apply from that copy, which takes the sync's finding of which
    islands are finite."""
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
        plan, t, events, (inner, inner_opt, s.island_outer, no_report(plan), no_reset(plan)), pin)
    new = dataclasses.replace(s, inner_model=inner, inner_opt_state=inner_opt, step=t, island_outer=island_outer)
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
            "delayed_outer: the state was made for a different delayed_outer setting than this "
            "step's; give init_state and make_train_step the same config")
    outer = params(state.outer)
    want = jax.eval_shape(lambda: tuple(plan.outer_optimizer.init(plan.fragments.take(outer, f))
                                        for f in range(plan.fragments.num_fragments)))
    have = state.outer_opt_state
    if plan.delayed:
        have = jax.eval_shape(lambda: jax.tree.map(lambda x: x[0], state.island_outer.opt_state))
    if jax.tree.structure(want) != jax.tree.structure(have):
        raise ValueError(
            "outer_optimizer: the state's outer optimizer states do not have the structure this "
            "step's outer optimizer makes; give init_state and make_train_step the same "
            "outer_optimizer (and the same config)")


def run_step(plan: Plan, batches: PyTree, state: DiLoCoState) -> tuple[DiLoCoState, dict[str, Array]]:
    """One global step on placed island-major batches (K, GBS/K, ...); what `TrainStep` jits.
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
    plan = plan.for_model(state.outer)
    arrays, static = eqx.partition(state, eqx.is_array)
    settle = consensus if plan.delayed else settled_outer
    body = plan.islands.program(partial(settle, plan), in_specs=(state_specs(arrays),),
                                out_specs=mesh_lib.REPLICATED)
    return eqx.combine(body(arrays), static.outer)


class TrainStep:
    """`(state, batch) -> (state, metrics)`, compiled once with the state donated.

    `outer_model(state)` is the outer model with every sync up to `state.step` folded in;
    `lower(state, batch)` the lowered step (`.compile().as_text()` is its HLO);
    `jaxpr(state, batch)` its traced program (for `analysis.critical_path`).
    """

    def __init__(self, plan: Plan):
        self.plan = plan
        # the state is donated, the caller's batch kept
        self._step = compiler.StepFunction(partial(run_step, plan), donate=True, mesh=plan.mesh)
        self._settle = compiler.StepFunction(partial(run_settle, plan), mesh=plan.mesh)

    @property
    def schedule(self):
        return self.plan.schedule

    @property
    def deferred(self) -> bool:
        return self.plan.deferred

    def place_batch(self, batch: PyTree) -> PyTree:
        """A flat (GBS, ...) batch as placed island-major (K, GBS/K, ...) arrays."""
        return mesh_lib.place_island_batches(batch, self.plan.num_islands, self.plan.mesh)

    def __call__(self, state: DiLoCoState, batch: PyTree) -> tuple[DiLoCoState, StepMetrics]:
        return self.step_placed(state, self.place_batch(batch))

    def step_placed(self, state: DiLoCoState, batches: PyTree) -> tuple[DiLoCoState, StepMetrics]:
        """The step on batches already island-major and placed (multi-process runs build
        them from each process's rows)."""
        with self.plan.islands.context():
            state, device_metrics = self._step(batches, state)
        return state, StepMetrics(device_metrics, self.schedule, exchange_delay=int(self.deferred))

    def outer_model(self, state: DiLoCoState) -> eqx.Module:
        """The outer model with every sync up to state.step applied (with the deferred
        exchange, a sync at the last step is folded in here; with delayed outer updates,
        the mean of the islands' outer copies; the state is not changed)."""
        if not (self.deferred or self.plan.delayed):
            return state.outer
        with self.plan.islands.context():
            return self._settle(state)

    def lower(self, state: DiLoCoState, batch: PyTree) -> jax.stages.Lowered:
        with self.plan.islands.context():
            return self._step.lower(self.place_batch(batch), state)

    def jaxpr(self, state: DiLoCoState, batch: PyTree) -> jax.extend.core.ClosedJaxpr:
        with self.plan.islands.context():
            return eqx.filter_make_jaxpr(partial(run_step, self.plan))(self.place_batch(batch), state)[0]


def make_train_step(
    cfg: DiLoCoConfig,
    loss_fn: LossFn,
    inner_optimizer: optax.GradientTransformation,
    mesh: Mesh | None = None,
    *,
    outer_optimizer: optax.GradientTransformation | None = None,
    layers: Callable[[Any], Any] = default_layers,
    deferred: bool | None = None,
    param_specs: mesh_lib.ParamSpecs | None = None,
    backend: str = "shard_map",
    exchange_after_inner: bool | None = None,
) -> TrainStep:
    """The global step for `cfg`: `train_step(state, batch) -> (state, metrics)`.

    `batch` leaves have a leading axis of GBS rows; island k gets rows [k·GBS/K, (k+1)·GBS/K).
    `loss_fn(model, island_batch)` returns a scalar. `outer_optimizer` is any optax
    transformation (default: Nesterov SGD from `outer_lr`/`outer_momentum`; give
    `init_state` the same one). `layers` points at the layer stack (streaming).
    `deferred` (default: on exactly when streaming with V >= 1) runs each exchange in the
    step after its sync, off the inner step's critical path; the numbers do not change.
    `mesh` may have "data" and "fsdp" axes inside each island (`make_mesh(diloco=D, data=n,
    fsdp=m)`); `param_specs` replaces the default layout there (give init_state the same).
    `backend` says how the step reaches across islands: "shard_map" (manual over the diloco
    axis, every cross-island collective written out) or "drjax" (MaxText's formulation:
    drjax's map and reduce under plain jit, collectives chosen by GSPMD); same numbers, same
    state. `exchange_after_inner` makes the deferred exchange wait for the inner step (default:
    without a mesh, and on XLA:CPU with islands of one device, see `exchange_waits_by_default`);
    the numbers do not change.
    """
    if deferred is None:
        deferred = cfg.streaming and cfg.overlap_steps >= 1
    if deferred and not (cfg.streaming and cfg.overlap_steps >= 1):
        raise ValueError(
            "deferred=True needs streaming=True and overlap_steps (V) >= 1: with V = 0 the "
            "outer fragment is applied in the same step it is synced"
        )
    mesh_lib.check_divides(cfg.num_replicas, mesh)
    make_islands(backend, mesh, cfg.num_replicas)  # an unknown backend fails here, by name
    if exchange_after_inner is None:
        exchange_after_inner = deferred and exchange_waits_by_default(mesh, backend)
    if exchange_after_inner and not deferred:
        raise ValueError("exchange_after_inner=True needs the deferred exchange (streaming=True, "
                         "overlap_steps (V) >= 1, deferred not False); the direct form's sync "
                         "always follows the inner step")
    outer_tx = sync.outer_optimizer(cfg) if outer_optimizer is None else outer_optimizer
    return TrainStep(Plan(cfg, loss_fn, inner_optimizer, outer_tx, mesh, layers, deferred, param_specs, backend,
                          exchange_after_inner))


def exchange_waits_by_default(mesh: Mesh | None, backend: str = "shard_map") -> bool:
    """Whether a deferred exchange waits for the inner step unless told: with every island
    on one device (no mesh), and on XLA:CPU with islands of one device whose values the
    step's body reads where they live.

    Waiting, the exchange and its checked second pass join the events after the inner step
    in one guard loop, so a step without an event tests one loop predicate, not three (XLA:GPU
    reads each on the host). Without a mesh nothing crosses devices, so a free exchange has
    no transfer to hide under the inner step. XLA:CPU's default instruction order runs a free
    exchange between the forward and backward passes, where the saved activations are live,
    and lays out its temporaries beside them: the step's block of temporaries grew by up to
    the stash's size (30M parameters) although at its peak it holds only the stash; after
    the inner step they reuse the activations' space. On islands of several devices, under
    drjax, and on an accelerator's mesh, the exchange stays free, so that its collective may
    run beside the inner step."""
    if mesh is None:
        return True
    return compiler.platform(mesh) == "cpu" and backend == "shard_map" and mesh_lib.island_size(mesh) == 1
