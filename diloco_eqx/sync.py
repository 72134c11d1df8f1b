"""What a sync computes: pseudo-gradients, their mean over the contributing islands, the
outer step, and the blend an apply uses; plus the dtype policy that keeps the outer side in
float32 whatever the islands train in.

The mean is over the islands the fault model lets through. Uncompressed pseudo-gradients
are summed with one float32 all-reduce; compressed ones cross as an all-gather of the
codec's integer payloads and are decoded and averaged in float32. Besides the
pseudo-gradients a sync moves a few control values (the count of contributing islands, or
with compression their mask), never in a payload dtype.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PyTree

from diloco_eqx import codecs
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.islands import Islands
from diloco_eqx.outer import make_outer_optimizer


def outer_optimizer(cfg: DiLoCoConfig) -> optax.GradientTransformation:
    """The outer optimizer `cfg.outer_optimizer` names (default: Nesterov SGD,
    v <- Δ + βv, θ <- θ - η(Δ + βv)); see diloco_eqx/outer.py."""
    return make_outer_optimizer(cfg)


class SyncMetrics(eqx.Module):
    """Diagnostics of one exchange; `zeros` gives the same structure for steps without one,
    so the carry of the schedule's event loop has one structure."""

    pseudo_grad_norm: Float[Array, ""]
    """Norm of the mean pseudo-gradient."""
    outer_update_norm: Float[Array, ""]
    islands_contributed: Int[Array, ""]
    compression_error: Float[Array, " k"] | None
    """Per island on this device: ‖decoded − sent‖ / ‖sent‖ (None without compression)."""

    @classmethod
    def zeros(cls, islands: Islands, compressed: bool) -> SyncMetrics:
        zero = jnp.zeros((), jnp.float32)
        err = None
        if compressed:
            err = islands.local(jnp.zeros((islands.local_count,), jnp.float32))
        return cls(zero, zero, jnp.zeros((), jnp.int32), err)


# ---------------------------------------------------------------- dtypes


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


# ---------------------------------------------------------------- the outer side


def pseudo_gradient(outer: PyTree, inner: PyTree) -> PyTree:
    """Δ_k = θ_outer − θ_k (outer minus inner: a descent direction), in at least float32."""

    def delta(o, i):
        dtype = wide(jnp.promote_types(o.dtype, i.dtype))
        return o.astype(dtype) - i.astype(dtype)

    return jax.tree.map(delta, outer, inner)


def outer_updates(
    optimizer: optax.GradientTransformation, delta: PyTree, opt_state: PyTree, outer: PyTree
) -> tuple[PyTree, PyTree]:
    """The outer optimizer on the mean pseudo-gradient: (update, new state in the dtypes the
    state is stored in); `apply_update` adds the update to the outer model."""
    updates, new_state = optimizer.update(delta, opt_state, outer)
    return updates, cast_like(new_state, opt_state)


def apply_update(outer: Array, update: Array) -> Array:
    """outer + update in outer's dtype, as `optax.apply_updates` computes it for one leaf."""
    return (outer + update).astype(outer.dtype)


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


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """Whether every value of every leaf is finite (True for a tree with no leaves): the sum
    of x − x over every value is 0, or NaN when any is NaN or ±Inf (one read of each leaf by
    the cheapest reduction, a sum, rather than an `all` over `isfinite`)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.ones((), bool)
    return jnp.isfinite(sum(jnp.sum(x - x, dtype=wide(x.dtype)) for x in leaves))


def tree_norm(tree: PyTree) -> Float[Array, ""]:
    """Global L2 norm of a tree (0 for a tree with no leaves)."""
    if not jax.tree.leaves(tree):
        return jnp.zeros((), jnp.float32)
    return optax.tree.norm(tree).astype(jnp.float32)


# ---------------------------------------------------------------- the exchange


def mean_pseudo_gradient(
    codec: codecs.AbstractCodec,
    deltas: PyTree,
    ok: Bool[Array, " k_local"],
    residual: PyTree | None,
    like: PyTree,
    islands: Islands,
    *,
    weights: Float[Array, " k_local"] | None = None,
    decay: float = 1.0,
) -> tuple[PyTree, Int[Array, ""], PyTree | None, Float[Array, " k_local"] | None]:
    """(mean over contributing islands, their number, new residual, per-island relative
    coding error). `deltas`/`residual` have a leading axis over the islands the body sees;
    `like` is one island's fragment (the shapes to decode into). Islands that do not
    contribute send zeros and keep their residual. With `weights` (one per island seen
    here, >= 0) the mean is weighted and an island of weight 0 does not contribute. With a
    residual, each island sends Δ + decay·residual (error feedback with a decaying buffer)."""
    if weights is not None:
        ok = ok & (weights > 0)
    if codec.lossless:
        if weights is not None:
            total = islands.sum(jax.tree.map(lambda x: _per_island(ok, x * _rows(weights, x), 0.0), deltas))
            return (_divide(total, islands.sum(jnp.where(ok, weights, 0.0))),
                    islands.sum(ok.astype(jnp.int32)), residual, None)
        total = islands.sum(jax.tree.map(lambda x: _per_island(ok, x, 0.0), deltas))
        count = islands.sum(ok.astype(jnp.int32))
        return _divide(total, count), count, residual, None

    sent = deltas if residual is None else jax.tree.map(  # the carried error times β = decay
        jnp.add if decay == 1.0 else (lambda d, r: d + decay * r), deltas, residual)
    sent = jax.tree.map(lambda x: _per_island(ok, x, 0.0), sent)
    payload = jax.vmap(lambda d: codecs.tree_encode(codec, d))(sent)
    every_ok = islands.gather(ok)
    decoded = islands.gather(payload, then=jax.vmap(lambda p: codecs.tree_decode(codec, p, like)))
    # what the others received from the islands seen here: their rows of the decoded set
    err = jax.tree.map(jnp.subtract, sent, islands.own_rows(decoded))
    if residual is not None:
        residual = jax.tree.map(lambda e, r: _per_island(ok, e, r), err, residual)
    rel_err = jax.vmap(lambda e, s: tree_norm(e) / tree_norm(s))(err, sent)
    count = jnp.sum(every_ok.astype(jnp.int32))
    if weights is not None:
        w = jnp.where(every_ok, islands.gather(weights), 0.0)
        total = jax.tree.map(lambda x: jnp.sum(_per_island(every_ok, x * _rows(w, x), 0.0), axis=0), decoded)
        return _divide(total, jnp.sum(w)), count, residual, jnp.nan_to_num(rel_err)
    total = jax.tree.map(lambda x: jnp.sum(_per_island(every_ok, x, 0.0), axis=0), decoded)
    return _divide(total, count), count, residual, jnp.nan_to_num(rel_err)


def _per_island(mask: Bool[Array, " k"], x: Array, other) -> Array:
    """x where its island's mask entry holds, else `other` (NaN·0 would stay NaN)."""
    return jnp.where(mask.reshape(-1, *[1] * (x.ndim - 1)), x, other)


def _rows(w: Float[Array, " k"], x: Array) -> Array:
    """Per-island weights shaped to multiply x's rows."""
    return w.reshape(-1, *[1] * (x.ndim - 1)).astype(x.dtype)


def _divide(total: PyTree, count: Int[Array, ""] | Float[Array, ""]) -> PyTree:
    """total / count, or total (zeros) when nothing contributed."""
    return jax.tree.map(lambda x: x / jnp.where(count > 0, count, 1).astype(x.dtype), total)
