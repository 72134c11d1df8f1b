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

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from diloco_eqx.schedule import Schedule, Step


class IslandOuter(eqx.Module):
    """Each island's own outer model, outer optimizer states and in-flight exchanges; every
    array leaf has a leading island axis."""

    params: PyTree
    """Each island's copy of the outer model's parameters (outer storage dtype)."""
    opt_state: tuple[PyTree, ...]
    """Each island's outer optimizer state, one per fragment."""
    in_flight: tuple[PyTree, ...]
    """d parameter-shaped trees (float32 or wider): slot j holds, for each fragment, u_k of
    its latest round r with r mod d = j."""


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
