"""The outer optimization: pseudo-gradients, the Nesterov outer step, the blend, and the
dtype policy that keeps the outer side in float32 whatever the islands train in."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree

from diloco_eqx.config import DiLoCoConfig


def outer_optimizer(cfg: DiLoCoConfig) -> optax.GradientTransformation:
    """optax.sgd(η_outer, momentum=β, nesterov=True): v <- Δ + βv, θ <- θ - η(Δ + βv)."""
    return optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)


def wide(dtype) -> jnp.dtype:
    """The dtype outer arithmetic runs in: at least float32 (bf16/f16 -> f32; f64 stays)."""
    return jnp.promote_types(dtype, jnp.float32)


def to_outer_dtype(tree: PyTree, policy: str) -> PyTree:
    """`tree` with its floating-point leaves in the outer storage dtype of `policy`
    ("float32": widened to at least float32; "param": unchanged)."""
    if policy == "param":
        return tree
    return jax.tree.map(lambda x: x.astype(wide(x.dtype)) if eqx.is_inexact_array(x) else x, tree)


def cast_like(tree: PyTree, like: PyTree) -> PyTree:
    """Each array leaf of `tree` cast to the dtype of the matching leaf of `like`."""
    return jax.tree.map(lambda x, y: x if x is None else jnp.asarray(x).astype(y.dtype), tree, like)


def pseudo_gradient(outer: PyTree, inner: PyTree) -> PyTree:
    """Δ_k = θ_outer − θ_k (outer minus inner: a descent direction), in at least float32."""

    def delta(o, i):
        dtype = wide(jnp.promote_types(o.dtype, i.dtype))
        return o.astype(dtype) - i.astype(dtype)

    return jax.tree.map(delta, outer, inner)


def outer_step(
    optimizer: optax.GradientTransformation, delta: PyTree, opt_state: PyTree, outer: PyTree
) -> tuple[PyTree, PyTree, PyTree]:
    """One outer step on the mean pseudo-gradient: (new outer, new state, update). The new
    outer model and state keep the dtypes they are stored in."""
    updates, new_state = optimizer.update(delta, opt_state, outer)
    return optax.apply_updates(outer, updates), cast_like(new_state, opt_state), updates


def blend(inner: PyTree, outer: PyTree, alpha: float) -> PyTree:
    """α·inner + (1−α)·outer in at least float32, cast to each inner leaf's dtype;
    α = 0 is plain replacement and α = 1 keeps `inner`, with no arithmetic."""
    if alpha == 1.0:
        return inner
    if alpha == 0.0:
        return cast_like(outer, inner)

    def mix(i, o):
        dtype = wide(jnp.promote_types(i.dtype, o.dtype))
        return (alpha * i.astype(dtype) + (1.0 - alpha) * o.astype(dtype)).astype(i.dtype)

    return jax.tree.map(mix, inner, outer)


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every value of every leaf is finite (True for a tree with no leaves)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.ones((), bool)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def tree_norm(tree: PyTree) -> Float[Array, ""]:
    """Global L2 norm of a tree (0 for a tree with no leaves)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return optax.tree.norm(tree).astype(jnp.float32)
