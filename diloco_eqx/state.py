"""DiLoCoState: everything the algorithm carries from one step to the next, and where each
part lives on the mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PyTree

from diloco_eqx import mesh as mesh_lib
from diloco_eqx import stash as stash_lib
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import Fragmentation
from diloco_eqx.sync import to_outer_dtype, wide


class IslandOuter(eqx.Module):
    """With delayed outer updates (`delayed.py`): each island's own outer model, outer
    optimizer states and in-flight exchanges; every array leaf has a leading island axis."""

    params: PyTree
    """Each island's copy of the outer model's parameters (outer storage dtype)."""
    opt_state: tuple[PyTree, ...]
    """Each island's outer optimizer state, one per fragment."""
    in_flight: tuple[PyTree, ...]
    """d parameter-shaped trees (float32 or wider): slot j holds, for each fragment, u_k of
    its latest round r with r mod d = j."""


class DiLoCoState(eqx.Module):
    """Inner islands, the outer model and its optimizer state, and the global step t.

    `inner_model`/`inner_opt_state` (and `residual`, `pending`) have a leading island axis
    of size K on every array leaf, laid out along the diloco mesh axis; `outer` and
    `outer_opt_state` have none. `outer_opt_state` holds one optimizer state per fragment,
    each initialised on that fragment's parameters, so a stateful outer optimizer (Adam's
    step count, a learning-rate schedule) advances only on its own fragment's syncs.
    """

    inner_model: eqx.Module
    inner_opt_state: PyTree
    outer: eqx.Module
    """The outer model as of the last completed exchange. With V >= 1 a sync at the last step
    may still be in flight: read the outer model with `DiLoCo.outer_model(state)`, which
    folds it in."""
    outer_opt_state: tuple[PyTree, ...]
    step: Int[Array, ""]
    residual: PyTree = None
    """Per-island quantization error carried to the next sync (error feedback), else None."""
    pending: PyTree = None
    """Per-island pseudo-gradient of the fragment synced at the last step, kept for the next
    step's exchange (streaming with V >= 1; one (fsdp, data, size) row per island sized to
    the largest fragment, see `stash.py`), else None."""

    island_outer: IslandOuter | None = None
    """With delayed_outer naive or eager: each island's own outer copy, outer optimizer
    states and in-flight exchanges (see `delayed.py`); `outer` then stays the initial model
    and `outer_opt_state` is empty, and `DiLoCo.outer_model(state)` is the islands' mean."""

    ON_ISLANDS: ClassVar[frozenset[str]] = frozenset({"inner_model", "inner_opt_state", "residual", "pending",
                                                      "island_outer"})
    """Fields with a leading island axis (sharded over "diloco"); the others are replicated."""

    def island(self, k: int) -> eqx.Module:
        """Island k's model (no K axis)."""
        arrays, static = eqx.partition(self.inner_model, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda x: x[k], arrays), static)


_FIELDS = tuple(f.name for f in dataclasses.fields(DiLoCoState))


def state_specs(state: DiLoCoState) -> DiLoCoState:
    """Each field's partition spec (a prefix of the state's tree): island fields sharded over
    "diloco", the rest replicated, absent fields None."""
    return DiLoCoState(**{
        name: None if getattr(state, name) is None
        else mesh_lib.ISLANDS if name in DiLoCoState.ON_ISLANDS else mesh_lib.REPLICATED
        for name in _FIELDS
    })


def owned_copy(tree):
    """`tree` with fresh copies of its arrays, so a step that donates them leaves the
    caller's originals intact."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def new_state(
    model: eqx.Module,
    cfg: DiLoCoConfig,
    inner_optimizer: optax.GradientTransformation,
    outer_optimizer: optax.GradientTransformation,
    mesh: Mesh | None,
    layers: Callable[[Any], Any],
    param_specs: mesh_lib.ParamSpecs | None,
) -> DiLoCoState:
    """Every island starts from `model`; the outer model is `model`; each fragment's outer
    optimizer state from `outer_optimizer.init` on that fragment (what `DiLoCo.init` calls).

    Islands keep `model`'s dtypes; the outer model and its optimizer state are stored in
    float32 (`cfg.outer_dtype="param"`: in the parameters' own dtypes). The state owns
    copies of `model`'s arrays, so donating it to the step leaves `model` intact. `layers`
    points at the stacked layer module (streaming only; checked against the fragment knobs
    here). `param_specs` replaces the default layout of leaves inside an island (see
    `state_shardings`).
    """
    frags = Fragmentation.from_model(model, cfg, layers)
    tx = outer_optimizer
    params = eqx.filter(model, eqx.is_inexact_array)
    k = cfg.num_replicas

    def per_island(tree):
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (k, *x.shape)) if eqx.is_array(x) else x, tree)

    model = owned_copy(model)
    outer = to_outer_dtype(model, cfg.outer_dtype)
    outer_params = eqx.filter(outer, eqx.is_inexact_array)
    outer_opt_state = tuple(tx.init(frags.take(outer_params, f)) for f in range(frags.num_fragments))
    def zeros():  # carried coding errors of pseudo-gradients: at least float32
        return per_island(jax.tree.map(lambda x: jnp.zeros(x.shape, wide(x.dtype)), params))

    deferred = cfg.streaming and cfg.overlap_steps >= 1
    island_outer = None
    if cfg.delayed_outer != "none":
        in_flight = jax.tree.map(lambda x: jnp.zeros(x.shape, wide(x.dtype)), outer_params)
        island_outer = per_island(IslandOuter(outer_params, outer_opt_state, (in_flight,) * cfg.outer_delay))
        island_outer = owned_copy(island_outer)
        outer_opt_state = ()

    state = DiLoCoState(
        inner_model=per_island(model),
        inner_opt_state=per_island(inner_optimizer.init(params)),
        outer=outer,
        outer_opt_state=outer_opt_state,
        step=jnp.zeros((), jnp.int32),
        residual=zeros() if carries_residual(cfg) else None,
        pending=stash_lib.for_model(params, frags, mesh, param_specs).zeros(k) if deferred else None,
        island_outer=island_outer,
    )
    return place_state(state, mesh, param_specs)


def state_shardings(state: DiLoCoState, mesh: Mesh | None,
                    param_specs: mesh_lib.ParamSpecs | None = None) -> DiLoCoState | None:
    """The NamedSharding of every array leaf: island fields over "diloco" and, inside an
    island, by `param_specs` (default: `mesh.leaf_spec`, split over "fsdp"); the outer model
    and its optimizer state by `param_specs` alone (default: `mesh.outer_leaf_spec`, split
    over "data" and "fsdp"), the same on every island; the stash by device rows
    (`stash.row_spec`)."""
    if mesh is None:
        return None
    specs = param_specs or mesh_lib.default_param_specs(mesh)
    outer_specs = param_specs or mesh_lib.default_outer_specs(mesh)
    arrays = eqx.filter(state, eqx.is_array)
    field_specs = {name: specs if name in DiLoCoState.ON_ISLANDS else outer_specs for name in _FIELDS}
    field_specs["pending"] = stash_lib.row_spec
    return DiLoCoState(**{
        name: mesh_lib.shardings(getattr(arrays, name), mesh, name in DiLoCoState.ON_ISLANDS, field_specs[name])
        for name in _FIELDS
    })


def place_state(state: DiLoCoState, mesh: Mesh | None,
                param_specs: mesh_lib.ParamSpecs | None = None) -> DiLoCoState:
    """Lay every field out on `mesh` (see `state_shardings`)."""
    if mesh is None:
        return state
    arrays, static = eqx.partition(state, eqx.is_array)
    return eqx.combine(mesh_lib.place_sharded(arrays, state_shardings(state, mesh, param_specs)), static)


def carries_residual(cfg: DiLoCoConfig) -> bool:
    """Whether the state holds an error-feedback residual (|Θ| floats per island)."""
    return cfg.error_feedback and cfg.compression != "none"
