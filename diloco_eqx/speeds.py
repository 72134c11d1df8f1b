"""Heterogeneous islands: which inner steps a slower island takes, and the tokens each
contributed since a fragment's last sync (pure arithmetic on the global step t).

Island k takes n_k = ⌊s_k·H_eff⌋ inner steps of every period H_eff (`DiLoCoConfig.island_steps`):
the first n_k of each period; on the others it idles (its parameters and optimizer state
do not change and its batch is not used). Every island reaches each sync at the same
time, the slow ones having done less work, as with dynamic local updates. Any window of
H_eff consecutive steps holds exactly n_k of island k's steps; a fragment's first sync,
earlier than H_eff, counts only the steps since the start.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from diloco_eqx.schedule import Step


def is_active(steps: Int[Array, " k"], period: int, t: Step) -> Bool[Array, " k"]:
    """Whether each island takes inner step t (t >= 1): ((t − 1) mod H_eff) < n_k."""
    return (jnp.asarray(t) - 1) % period < steps


def steps_taken(steps: Int[Array, " k"], period: int, t: Step) -> Int[Array, " k"]:
    """Inner steps each island has taken in steps 1..t (0 for t <= 0)."""
    t = jnp.maximum(jnp.asarray(t), 0)
    return (t // period) * steps + jnp.minimum(t % period, steps)


def steps_since_sync(steps: Int[Array, " k"], period: int, t: Step) -> Float[Array, " k"]:
    """Inner steps each island took in the window (t − H_eff, t] a sync at t averages over:
    its weight under island_weighting = "tokens" (every island's batch holds as many tokens)."""
    return (steps_taken(steps, period, t) - steps_taken(steps, period, jnp.asarray(t) - period)).astype(jnp.float32)
