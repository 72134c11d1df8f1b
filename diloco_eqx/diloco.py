"""DiLoCo: the algorithm as one object. Given the config, the loss, the inner optimizer and
where the islands live once, it makes the state, runs the compiled global step and reads
the outer model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import equinox as eqx
import jax
import optax
from jax.sharding import Mesh
from jaxtyping import PRNGKeyArray, PyTree

from diloco_eqx import compiler
from diloco_eqx import mesh as mesh_lib
from diloco_eqx import sync
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import default_layers
from diloco_eqx.islands import make_islands
from diloco_eqx.metrics import StepMetrics
from diloco_eqx.plan import LossFn, Plan
from diloco_eqx.schedule import Schedule
from diloco_eqx.state import DiLoCoState, new_state
from diloco_eqx.steps import run_settle, run_step


class DiLoCo:
    """DiLoCo or Streaming DiLoCo over K islands, as `cfg` says.

    `loss_fn(model, island_batch)` returns a scalar; `inner_optimizer` is any optax
    transformation, one state per island. `mesh` places the islands (`make_mesh`: a
    "diloco" axis, optionally "data" and "fsdp" axes inside each island; None: every island
    on the default device). `outer_optimizer` (default: Nesterov SGD from `cfg.outer_lr`
    and `cfg.outer_momentum`, or the registered one `cfg.outer_optimizer` names) steps the
    outer model, with one state per fragment. `layers` points at the stacked layer module
    (Streaming DiLoCo). `param_specs` replaces the default layout of leaves inside an
    island. `backend` says how the step reaches across islands: "shard_map" (manual over
    the diloco axis) or "drjax" (drjax's map and reduce under plain jit); same numbers.

        algo = DiLoCo(cfg, loss_fn, optax.adamw(1e-3), mesh=make_mesh(2))
        state = algo.init(model)
        state, metrics = algo.step(state, batch)
        model = algo.outer_model(state)
    """

    def __init__(
        self,
        cfg: DiLoCoConfig,
        loss_fn: LossFn,
        inner_optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        outer_optimizer: optax.GradientTransformation | None = None,
        layers: Callable[[Any], Any] = default_layers,
        param_specs: mesh_lib.ParamSpecs | None = None,
        backend: str = "shard_map",
    ):
        if not isinstance(cfg, DiLoCoConfig):
            raise TypeError(f"DiLoCo: cfg must be a DiLoCoConfig; got {type(cfg).__name__}")
        mesh_lib.check_divides(cfg.num_replicas, mesh)
        make_islands(backend, mesh, cfg.num_replicas)  # an unknown backend fails here, by name
        deferred = cfg.streaming and cfg.overlap_steps >= 1
        outer_tx = sync.outer_optimizer(cfg) if outer_optimizer is None else outer_optimizer
        # with every island on one device nothing crosses devices: no transfer to hide
        self._bind(Plan(cfg, loss_fn, inner_optimizer, outer_tx, mesh, layers, deferred, param_specs, backend,
                        exchange_after_inner=deferred and mesh is None))

    def _bind(self, plan: Plan) -> None:
        self.plan = plan
        self._step = compiler.StepFunction(partial(run_step, plan), donate=True)  # the caller's batch is kept
        self._settle = compiler.StepFunction(partial(run_settle, plan))

    @property
    def config(self) -> DiLoCoConfig:
        return self.plan.cfg

    @property
    def schedule(self) -> Schedule:
        """When each fragment is synced and applied."""
        return self.plan.schedule

    def init(self, model: eqx.Module, key: PRNGKeyArray | None = None) -> DiLoCoState:
        """The state: every island starts from `model`, and so does the outer model. `key` is
        accepted for the usual `init(model, key)` call and not read: the state holds no
        randomness (the fault coins come from `cfg.fault_seed`)."""
        p = self.plan
        return new_state(model, p.cfg, p.inner_optimizer, p.outer_optimizer, p.mesh, p.layers, p.param_specs)

    def step(self, state: DiLoCoState, batch: PyTree) -> tuple[DiLoCoState, StepMetrics]:
        """One global step, compiled once, the state donated. `batch` leaves have a leading
        axis of GBS rows; island k trains on rows [k·GBS/K, (k+1)·GBS/K)."""
        return self.step_placed(state, self.place_batch(batch))

    def place_batch(self, batch: PyTree) -> PyTree:
        """A flat (GBS, ...) batch as placed island-major (K, GBS/K, ...) arrays."""
        return mesh_lib.place_island_batches(batch, self.plan.num_islands, self.plan.mesh)

    def step_placed(self, state: DiLoCoState, batches: PyTree) -> tuple[DiLoCoState, StepMetrics]:
        """The step on batches already island-major and placed (multi-process runs build
        them from each process's rows)."""
        with self.plan.islands.context():
            state, device_metrics = self._step(batches, state)
        return state, StepMetrics(device_metrics, self.schedule, exchange_delay=int(self.plan.deferred))

    def outer_model(self, state: DiLoCoState) -> eqx.Module:
        """The outer model with every sync up to `state.step` folded in: a sync whose exchange
        is still in flight (V >= 1) is taken here, and with delayed outer updates it is the
        mean of the islands' outer copies. The state is not changed."""
        if not (self.plan.deferred or self.plan.delayed):
            return state.outer
        with self.plan.islands.context():
            return self._settle(state)

    def lower(self, state: DiLoCoState, batch: PyTree) -> jax.stages.Lowered:
        """The step lowered for these arguments (`.compile().as_text()` is its HLO)."""
        with self.plan.islands.context():
            return self._step.lower(self.place_batch(batch), state)

    def jaxpr(self, state: DiLoCoState, batch: PyTree) -> jax.extend.core.ClosedJaxpr:
        """The step's traced program (what `analysis.critical_path` reads)."""
        with self.plan.islands.context():
            return eqx.filter_make_jaxpr(partial(run_step, self.plan))(self.place_batch(batch), state)[0]


def with_plan(algo: DiLoCo, **changes) -> DiLoCo:
    """A copy of `algo` whose plan has `changes` (for tests and tools that compare forms of
    the step that compute the same numbers, e.g. `deferred=False` with V >= 1)."""
    plan = dataclasses.replace(algo.plan, **changes)
    cfg = plan.cfg
    if plan.deferred and not (cfg.streaming and cfg.overlap_steps >= 1):
        raise ValueError("deferred=True needs streaming=True and overlap_steps (V) >= 1: with V = 0 the "
                         "outer fragment is applied in the same step it is synced")
    if plan.exchange_after_inner and not plan.deferred:
        raise ValueError("exchange_after_inner=True needs the deferred exchange (deferred=True)")
    new = object.__new__(DiLoCo)
    new._bind(plan)
    return new
