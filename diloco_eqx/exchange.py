"""One sync's exchange: which islands contribute, what they send, and the mean they agree on.

An island contributes to the sync at step t unless the fault knobs drop it (a listed
(step, island) pair, or a seeded coin with its drop probability) or its pseudo-gradient
holds a NaN or Inf. The mean is over the contributing islands only; with none, the caller
skips the outer step. Uncompressed pseudo-gradients are summed with one float32 all-reduce;
compressed ones are all-gathered as payloads and decoded and averaged in float32.

Besides the pseudo-gradient, a sync moves a few control values (the number of contributing
islands, or with compression the K-island mask); they are int32 / bool, never payload dtypes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Int, PyTree

from diloco_eqx import compression, islands
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.outer import tree_norm


def contributes(
    cfg: DiLoCoConfig, t: Int[Array, ""], deltas: PyTree, mesh: Mesh | None
) -> Bool[Array, " k_local"]:
    """For each island on this device slice: does it take part in the sync at step t?"""
    ids = islands.island_ids(cfg.num_replicas, mesh)
    ok = jax.vmap(
        lambda d: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(d)]))
    )(deltas)
    if cfg.drops:
        steps = jnp.array([s for s, _ in cfg.drops], jnp.int32)
        which = jnp.array([i for _, i in cfg.drops], jnp.int32)
        listed = jnp.any((steps[None, :] == t) & (which[None, :] == ids[:, None]), axis=1)
        ok = ok & ~listed
    probs = cfg.island_drop_probs
    if any(p > 0 for p in probs):
        coin = jax.random.uniform(jax.random.fold_in(jax.random.key(cfg.fault_seed), t), (len(probs),))
        ok = ok & (coin >= jnp.asarray(probs, jnp.float32))[ids]
    return ok


def mean_pseudo_gradient(
    cfg: DiLoCoConfig,
    deltas: PyTree,
    ok: Bool[Array, " k_local"],
    residual: PyTree | None,
    like: PyTree,
    mesh: Mesh | None,
) -> tuple[PyTree, Int[Array, ""], PyTree | None, dict[str, Array]]:
    """(mean over contributing islands, their number, new residual, per-island metrics).

    `deltas`/`residual` have a leading axis over this slice's islands; `like` is one
    island's fragment (the shapes to decode into). Non-contributing islands send zeros
    and keep their residual.
    """
    fmt = cfg.compression
    if fmt == "none":
        total = islands.sum_over_islands(jax.tree.map(lambda x: _per_island(ok, x, 0.0), deltas), mesh)
        count = islands.sum_over_islands(ok.astype(jnp.int32), mesh)
        return _divide(total, count), count, residual, {}

    sent = deltas if residual is None else jax.tree.map(jnp.add, deltas, residual)
    sent = jax.tree.map(lambda x: _per_island(ok, x, 0.0), sent)
    payload = jax.vmap(lambda d: compression.tree_encode(d, fmt, check=False))(sent)
    every_ok = islands.gather_islands(ok, mesh)
    decoded = jax.vmap(lambda p: compression.tree_decode(p, fmt, like))(
        islands.gather_islands(payload, mesh)
    )
    # what the others received from this slice's islands: their rows of the decoded set
    ids = islands.island_ids(cfg.num_replicas, mesh)
    err = jax.tree.map(lambda s, d: s - d[ids], sent, decoded)
    if residual is not None:
        residual = jax.tree.map(lambda e, r: _per_island(ok, e, r), err, residual)
    rel_err = jax.vmap(lambda e, s: tree_norm(e) / tree_norm(s))(err, sent)
    total = jax.tree.map(lambda x: jnp.sum(_per_island(every_ok, x, 0.0), axis=0), decoded)
    count = jnp.sum(every_ok.astype(jnp.int32))
    return _divide(total, count), count, residual, {"compression_error": jnp.nan_to_num(rel_err)}


def _per_island(mask: Bool[Array, " k"], x: Array, other) -> Array:
    """x where its island's mask entry holds, else `other` (NaN·0 would stay NaN)."""
    return jnp.where(mask.reshape(-1, *[1] * (x.ndim - 1)), x, other)


def _divide(total: PyTree, count: Int[Array, ""]) -> PyTree:
    return jax.tree.map(lambda x: x / jnp.maximum(count, 1).astype(x.dtype), total)


def keep_if(cond: Bool[Array, ""], new: PyTree, old: PyTree) -> PyTree:
    """`new` where cond holds, else `old` (leaf by leaf; None leaves pass through)."""
    return jax.tree.map(lambda a, b: lax.select(cond, a, b), new, old)
