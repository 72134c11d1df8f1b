"""The apply of one fragment: every island takes the outer fragment, blended with α, and an
island whose fragment is not finite is reset to the outer model with fresh inner optimizer
state."""

from __future__ import annotations

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from diloco_eqx import sync
from diloco_eqx.events import when
from diloco_eqx.plan import Plan, params


def no_reset(plan: Plan) -> Bool[Array, " k"]:
    """No island of this device reset: the apply's report on a step without one."""
    return plan.islands.local(jnp.zeros((plan.islands.local_count,), bool))


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
