"""Schedule events as loops: the one shape every sync, exchange and apply takes in the step.

An event that fires at some steps and not others is a `lax.while_loop` of zero or one trip,
never a `lax.cond`: XLA updates a loop's carry in place, where a conditional copies each
operand that a branch writes into or passes through, on every step. So one compiled step
serves every schedule position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Int, PyTree

from diloco_eqx.schedule import EVENT_SCOPE, Schedule


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


def after_inner(schedule: Schedule, t, events: Callable, carry, pin: Callable, after=None, also=False):
    """`events(carry)`, the schedule events that follow step t's inner step, inside one guard
    loop on whether any of them fires at t (a sync or an apply, or `also`): a step without an
    event tests one predicate after its inner step, not one per event (XLA:GPU reads each
    loop predicate on the host). `after` as in `when`."""
    return when(schedule.is_sync(t) | schedule.is_apply(t) | also, 0, [events], carry, pin=pin, after=after)
