"""The outer optimization: pseudo-gradients, the Nesterov outer step, and the blend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PyTree

from diloco_eqx.config import DiLoCoConfig


def outer_optimizer(cfg: DiLoCoConfig) -> optax.GradientTransformation:
    """optax.sgd(η_outer, momentum=β, nesterov=True): v <- Δ + βv, θ <- θ - η(Δ + βv)."""
    return optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)


def pseudo_gradient(outer: PyTree, inner: PyTree) -> PyTree:
    """Δ_k = θ_outer − θ_k: outer minus inner, a descent direction."""
    return jax.tree.map(jnp.subtract, outer, inner)


def outer_step(
    optimizer: optax.GradientTransformation, delta: PyTree, opt_state: PyTree, outer: PyTree
) -> tuple[PyTree, PyTree, PyTree]:
    """One outer step on the mean pseudo-gradient: (new outer, new state, update)."""
    updates, opt_state = optimizer.update(delta, opt_state, outer)
    return optax.apply_updates(outer, updates), opt_state, updates


def blend(inner: PyTree, outer: PyTree, alpha: float) -> PyTree:
    """α·inner + (1−α)·outer; α = 0 is plain replacement with no arithmetic."""
    if alpha == 0.0:
        return outer
    return jax.tree.map(lambda i, o: alpha * i + (1.0 - alpha) * o, inner, outer)


def tree_norm(tree: PyTree) -> Float[Array, ""]:
    """Global L2 norm of a tree (0 for a tree with no leaves)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return optax.tree.norm(tree).astype(jnp.float32)
