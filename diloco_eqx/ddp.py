"""The Data-Parallel baseline: gradients averaged over all islands every step, one optimizer.

Same islands, same batch split and the same mesh as DiLoCo, so curves compare at equal
tokens per step; the difference is that the cross-island mean runs on gradients at every
step instead of on pseudo-gradients at syncs. The model is replicated over "diloco" and
"data" and laid out over "fsdp" like DiLoCo's outer model.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PyTree

from diloco_eqx import compiler
from diloco_eqx import mesh as mesh_lib
from diloco_eqx.islands import ShardMapIslands
from diloco_eqx.metrics import StepMetrics
from diloco_eqx.state import owned_copy
from diloco_eqx.plan import LossFn
from diloco_eqx.sync import tree_norm


class DDPState(eqx.Module):
    """One model and one optimizer state, replicated on every island's device."""

    model: eqx.Module
    opt_state: PyTree
    step: Int[Array, ""]


def _layout(state: DDPState, mesh: Mesh | None, param_specs) -> DDPState | None:
    if mesh is None:
        return None
    return mesh_lib.shardings(eqx.filter(state, eqx.is_array), mesh, False,
                              param_specs or mesh_lib.default_param_specs(mesh))


@dataclasses.dataclass(frozen=True)
class DDPPlan:
    num_replicas: int
    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    mesh: Mesh | None
    param_specs: mesh_lib.ParamSpecs | None


def ddp_body(plan: DDPPlan, static, arrays, opt_state, step, island_batches):
    """Each local island's gradient, their mean over all islands, one optimizer update."""
    model = eqx.combine(arrays, static)
    # Differentiate a per-device copy: through the replicated model itself, JAX's transpose
    # would already sum the gradient over the axis (D times too large after the mean below).
    islands = ShardMapIslands(plan.mesh, plan.num_replicas)
    local = eqx.combine(islands.local(arrays), static)
    losses, grads = jax.vmap(lambda b: eqx.filter_value_and_grad(plan.loss_fn)(local, b))(island_batches)
    grads = islands.mean(grads)
    updates, opt_state = plan.optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    model = eqx.apply_updates(model, updates)
    return eqx.filter(model, eqx.is_array), opt_state, step + 1, losses, tree_norm(grads)


def run_ddp_step(plan: DDPPlan, batches: PyTree, state: DDPState):
    arrays, static = eqx.partition(state.model, eqx.is_array)
    r, i = mesh_lib.REPLICATED, mesh_lib.ISLANDS
    body = ShardMapIslands(plan.mesh, plan.num_replicas).program(
        partial(ddp_body, plan, static), in_specs=(r, r, r, i), out_specs=(r, r, r, i, r))
    arrays, opt_state, t, losses, grad_norm = body(arrays, state.opt_state, state.step, batches)
    new = DDPState(eqx.combine(arrays, static), opt_state, t)
    layout = _layout(state, plan.mesh, plan.param_specs)
    if layout is not None:
        new_arrays, new_static = eqx.partition(new, eqx.is_array)
        new = eqx.combine(jax.tree.map(jax.lax.with_sharding_constraint, new_arrays, layout), new_static)
    return new, {"step": t, "loss_island": losses, "grad_norm": grad_norm}


class DDP:
    """The Data-Parallel baseline with DiLoCo's interface: island k's gradient on rows
    [k·GBS/K, (k+1)·GBS/K), averaged over the K islands, then one update of one model.

        ddp = DDP(2, loss_fn, optax.adamw(1e-3))
        state = ddp.init(model)
        state, metrics = ddp.step(state, batch)
    """

    def __init__(self, num_replicas: int, loss_fn: LossFn, optimizer: optax.GradientTransformation, *,
                 mesh: Mesh | None = None, param_specs: mesh_lib.ParamSpecs | None = None):
        mesh_lib.check_divides(num_replicas, mesh)
        self.plan = DDPPlan(num_replicas, loss_fn, optimizer, mesh, param_specs)
        self._step = compiler.StepFunction(partial(run_ddp_step, self.plan), donate=True)

    def init(self, model: eqx.Module, key=None) -> DDPState:
        """The state: `model` (a copy of its arrays) and its optimizer state; `key` is not read."""
        p = self.plan
        model = owned_copy(model)
        state = DDPState(model, p.optimizer.init(eqx.filter(model, eqx.is_inexact_array)), jnp.zeros((), jnp.int32))
        if p.mesh is None:
            return state
        arrays, static = eqx.partition(state, eqx.is_array)
        return eqx.combine(mesh_lib.place_sharded(arrays, _layout(state, p.mesh, p.param_specs)), static)

    def place_batch(self, batch: PyTree) -> PyTree:
        return mesh_lib.place_island_batches(batch, self.plan.num_replicas, self.plan.mesh)

    def step(self, state: DDPState, batch: PyTree) -> tuple[DDPState, StepMetrics]:
        return self.step_placed(state, self.place_batch(batch))

    def step_placed(self, state: DDPState, batches: PyTree) -> tuple[DDPState, StepMetrics]:
        state, metrics = self._step(batches, state)
        return state, StepMetrics(metrics)

    def outer_model(self, state: DDPState) -> eqx.Module:
        """The trained model (DDP has one)."""
        return state.model

    def lower(self, state: DDPState, batch: PyTree) -> jax.stages.Lowered:
        """The step lowered for these arguments: `.compile().as_text()` is its HLO."""
        return self._step.lower(self.place_batch(batch), state)
