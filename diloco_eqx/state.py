"""DiLoCoState: everything the algorithm carries from one step to the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PyTree

from diloco_eqx import islands
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import Fragmentation, default_layers
from diloco_eqx.outer import outer_optimizer, to_outer_dtype, wide


class DiLoCoState(eqx.Module):
    """Inner islands, outer model and Nesterov trace, and the global step t.

    `inner_model`/`inner_opt_state` have a leading island axis of size K on every array leaf,
    laid out along the diloco mesh axis; `outer_model`/`outer_opt_state` have none.
    """

    inner_model: eqx.Module
    inner_opt_state: PyTree
    outer_model: eqx.Module
    outer_opt_state: PyTree
    step: Int[Array, ""]
    residual: PyTree = None
    """Per-island quantization error carried to the next sync (error feedback), else None."""
    pending: PyTree = None
    """Per-island pseudo-gradients stashed at a sync for the next step's exchange (streaming
    with V >= 1), else None."""

    def island(self, k: int) -> eqx.Module:
        """Island k's model (no K axis)."""
        arrays, static = eqx.partition(self.inner_model, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda x: x[k], arrays), static)


def owned_copy(tree):
    """`tree` with fresh copies of its arrays, so a step that donates them leaves the
    caller's originals intact."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def init_state(
    model: eqx.Module,
    inner_optimizer: optax.GradientTransformation,
    cfg: DiLoCoConfig,
    mesh: Mesh | None = None,
    layers: Callable[[Any], Any] = default_layers,
) -> DiLoCoState:
    """Every island starts from `model`; the outer model is `model`; the trace is zero.

    Islands keep `model`'s dtypes; the outer model and its optimizer state are stored in
    float32 (`cfg.outer_dtype="param"`: in the parameters' own dtypes). The state owns copies
    of `model`'s arrays, so donating it to the step leaves `model` intact. `layers` points at
    the stacked layer module (streaming only; checked against the fragment knobs here).
    """
    islands.check_divides(cfg.num_replicas, mesh)
    Fragmentation.from_model(model, cfg, layers)
    params = eqx.filter(model, eqx.is_inexact_array)
    k = cfg.num_replicas

    def per_island(tree):
        return jax.tree.map(
            lambda x: jnp.broadcast_to(x, (k, *x.shape)) if eqx.is_array(x) else x, tree
        )

    model = owned_copy(model)
    inner_model = per_island(model)
    inner_opt_state = per_island(inner_optimizer.init(params))
    outer_model = to_outer_dtype(model, cfg.outer_dtype)
    outer_opt_state = outer_optimizer(cfg).init(eqx.filter(outer_model, eqx.is_inexact_array))
    # pseudo-gradients (stashed, or their carried quantization error) are at least float32
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, wide(x.dtype)), params)
    residual = None
    if carries_residual(cfg):
        residual = islands.place(per_island(zeros), mesh, islands.ISLANDS)
    pending = None
    if cfg.streaming and cfg.overlap_steps >= 1:
        pending = islands.place(per_island(zeros), mesh, islands.ISLANDS)
    return DiLoCoState(
        inner_model=islands.place(inner_model, mesh, islands.ISLANDS),
        inner_opt_state=islands.place(inner_opt_state, mesh, islands.ISLANDS),
        outer_model=islands.place(outer_model, mesh, islands.REPLICATED),
        outer_opt_state=islands.place(outer_opt_state, mesh, islands.REPLICATED),
        step=islands.place(jnp.zeros((), jnp.int32), mesh, islands.REPLICATED),
        residual=residual,
        pending=pending,
    )


def carries_residual(cfg: DiLoCoConfig) -> bool:
    """Whether the state holds an error-feedback residual (|Θ| floats per island)."""
    return cfg.error_feedback and cfg.compression != "none"
