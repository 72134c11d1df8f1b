"""Plan: everything static about a run's step, bound into the step's functions with `partial`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PyTree

from diloco_eqx import mesh as mesh_lib
from diloco_eqx import speeds
from diloco_eqx import stash as stash_lib
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import Fragmentation
from diloco_eqx.islands import Islands, make_islands
from diloco_eqx.stash import Stash
from diloco_eqx.sync import SyncMetrics

LossFn = Callable[[eqx.Module, PyTree], Float[Array, ""]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about a run's step; bound into the step functions with `partial`.
    `fragments` is filled in from the state's outer model when the step is traced.

    `deferred` (streaming with V >= 1) runs each exchange in the step after its sync, off the
    inner step's critical path; `exchange_after_inner` makes that exchange wait for the inner
    step (where nothing crosses devices, there is no transfer to hide). Neither changes a
    number the step computes."""

    cfg: DiLoCoConfig
    loss_fn: LossFn
    inner_optimizer: optax.GradientTransformation
    outer_optimizer: optax.GradientTransformation
    mesh: Mesh | None
    layers: Callable[[Any], Any]
    deferred: bool
    param_specs: mesh_lib.ParamSpecs | None = None
    backend: str = "shard_map"
    exchange_after_inner: bool = False
    fragments: Fragmentation | None = None
    stash: Stash | None = None

    @property
    def schedule(self):
        return self.cfg.schedule

    @property
    def alpha(self) -> float:
        return float(self.cfg.alpha) if self.cfg.streaming else 0.0

    @property
    def num_islands(self) -> int:
        return self.cfg.num_replicas

    @property
    def delayed(self) -> bool:
        """Whether exchanges stay in flight for whole rounds (delayed_outer naive or eager)."""
        return self.cfg.delayed_outer != "none"

    def island_steps(self) -> Int[Array, " k"]:
        """Inner steps per period of each island the body sees."""
        return jnp.asarray(self.cfg.island_steps, jnp.int32)[self.islands.ids()]

    def island_weights(self, t) -> Float[Array, " k"] | None:
        """Each seen island's weight in the mean of a sync at t (None: uniform)."""
        if self.cfg.island_weighting == "uniform":
            return None
        return speeds.steps_since_sync(self.island_steps(), self.schedule.period, t)

    @property
    def islands(self) -> Islands:
        """The island operations of the chosen backend."""
        return make_islands(self.backend, self.mesh, self.cfg.num_replicas)

    def pin_islands(self, tree: PyTree, like_outer: bool = False) -> PyTree:
        """Island leaves (a leading island axis) kept in their layout inside an island, or in
        the outer leaves' layout (`like_outer`: split over all of the island's devices)."""
        return self._pin(tree, True, mesh_lib.default_outer_specs if like_outer else mesh_lib.default_param_specs)

    def pin_outer(self, tree: PyTree) -> PyTree:
        """Outer leaves kept in their layout (split over the island's devices)."""
        return self._pin(tree, False, mesh_lib.default_outer_specs)

    def on_islands(self, tree: PyTree, like_outer: bool = False) -> PyTree:
        """Outer leaves copied to each island the body sees (a leading island axis), laid out
        like an island's leaves, or `like_outer`. Any reshard then happens inside each island:
        from a value replicated over the islands, GSPMD may fetch pieces from any of them."""
        return self.pin_islands(self.islands.broadcast(tree), like_outer)

    def pin_stash(self, rows: PyTree) -> PyTree:
        """Stash rows (a leading island axis) kept in their layout: one row per device."""
        return mesh_lib.pin(rows, mesh_lib.shardings(rows, self.mesh, True, stash_lib.row_spec))

    def _pin(self, tree: PyTree, on_islands: bool, default) -> PyTree:
        specs = self.param_specs or default(self.mesh)
        return mesh_lib.pin(tree, mesh_lib.shardings(tree, self.mesh, on_islands, specs))

    def for_model(self, model: eqx.Module) -> Plan:
        frags = Fragmentation.from_model(model, self.cfg, self.layers)
        stash = stash_lib.for_model(params(model), frags, self.mesh, self.param_specs) if self.deferred else None
        return dataclasses.replace(self, fragments=frags, stash=stash)

    def stashed_like(self, outer: PyTree, f: int) -> PyTree:
        """Shapes and dtypes of one island's stashed pseudo-gradient of fragment f."""
        return jax.eval_shape(partial(self.fragments.take, f=f), stash_lib.deltas_like(params(outer)))


class StepReport(eqx.Module):
    """The device-side metrics of one step (see `StepMetrics` for the host-side keys)."""

    step: Int[Array, ""]
    loss_island: Float[Array, " k"]
    sync: SyncMetrics
    reset_island: Bool[Array, " k"]

    @staticmethod
    def specs(compressed: bool) -> StepReport:
        r, i = mesh_lib.REPLICATED, mesh_lib.ISLANDS
        return StepReport(r, i, SyncMetrics(r, r, r, i if compressed else None), i)

    def as_dict(self) -> dict[str, Array]:
        out = {"step": self.step, "loss_island": self.loss_island, "reset_island": self.reset_island,
               "pseudo_grad_norm": self.sync.pseudo_grad_norm,
               "outer_update_norm": self.sync.outer_update_norm,
               "islands_contributed": self.sync.islands_contributed}
        if self.sync.compression_error is not None:
            out["compression_error"] = self.sync.compression_error
        return out


def params(tree: PyTree) -> PyTree:
    return eqx.filter(tree, eqx.is_inexact_array)
