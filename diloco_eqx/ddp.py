"""The Data-Parallel baseline: gradients averaged over all islands every step, one optimizer.

Same islands, same batch split and the same `diloco` axis as DiLoCo, so curves compare at
equal tokens per step; the difference is that the cross-island mean runs on gradients at
every step instead of on pseudo-gradients at syncs.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Int, PyTree

from diloco_eqx import mesh as islands
from diloco_eqx.metrics import StepMetrics, check_batch, split_batch
from diloco_eqx.state import owned_copy
from diloco_eqx.step import LossFn
from diloco_eqx.sync import tree_norm


class DDPState(eqx.Module):
    """One model and one optimizer state, replicated on every island's device."""

    model: eqx.Module
    opt_state: PyTree
    step: Int[Array, ""]


def init_ddp_state(
    model: eqx.Module, optimizer: optax.GradientTransformation, mesh: Mesh | None = None
) -> DDPState:
    model = owned_copy(model)
    state = DDPState(
        model=model,
        opt_state=optimizer.init(eqx.filter(model, eqx.is_inexact_array)),
        step=jnp.zeros((), jnp.int32),
    )
    return islands.place(state, mesh, islands.REPLICATED)


def make_ddp_step(
    num_replicas: int,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh | None = None,
) -> Callable[[DDPState, PyTree], tuple[DDPState, StepMetrics]]:
    """`(state, batch) -> (state, metrics)`: island k's gradient on rows
    [k·GBS/K, (k+1)·GBS/K), averaged over the K islands, then one optimizer update."""
    islands.check_divides(num_replicas, mesh)

    def run(state: DDPState, batch: PyTree):
        arrays, static = eqx.partition(state.model, eqx.is_array)

        def body(arrays, opt_state, step, island_batches):
            model = eqx.combine(arrays, static)
            # Differentiate a per-device copy: through the replicated model itself, JAX's
            # transpose would already sum the gradient over the axis (D times too large
            # after the mean below, and a second all-reduce).
            local = eqx.combine(islands.island_local(arrays, mesh), static)
            losses, grads = jax.vmap(
                lambda b: eqx.filter_value_and_grad(loss_fn)(local, b)
            )(island_batches)
            grads = islands.mean_over_islands(grads, mesh)
            params = eqx.filter(model, eqx.is_inexact_array)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            model = eqx.apply_updates(model, updates)
            return eqx.filter(model, eqx.is_array), opt_state, step + 1, losses, tree_norm(grads)

        R, I = islands.REPLICATED, islands.ISLANDS
        body = islands.shard_islands(body, mesh, in_specs=(R, R, R, I), out_specs=(R, R, R, I, R))
        arrays, opt_state, t, losses, grad_norm = body(
            arrays, state.opt_state, state.step, split_batch(batch, num_replicas)
        )
        new = DDPState(eqx.combine(arrays, static), opt_state, t)
        return new, {"step": t, "loss_island": losses, "grad_norm": grad_norm}

    compiled = eqx.filter_jit(lambda batch, state: run(state, batch), donate="all-except-first")

    def ddp_step(state: DDPState, batch: PyTree) -> tuple[DDPState, StepMetrics]:
        check_batch(batch, num_replicas)
        state, metrics = compiled(islands.place(batch, mesh, islands.ISLANDS), state)
        return state, StepMetrics(metrics)

    def lower(state: DDPState, batch: PyTree) -> jax.stages.Lowered:
        """The step lowered for these arguments: `.compile().as_text()` is its HLO."""
        return compiled.lower(islands.place(batch, mesh, islands.ISLANDS), state).lowered

    ddp_step.lower = lower
    return ddp_step
