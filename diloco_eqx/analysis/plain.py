"""Plain training on DiLoCo's layout: the floor every DiLoCo cost is measured against.

K islands each take one inner optimizer step on their rows, with the same inner step, batch
placement and mesh layout as the DiLoCo step (islands over "diloco", each island's leaves by
`param_specs` inside it), and nothing else: no outer model, no syncs. The difference in time
or memory per device between a DiLoCo step and this one is what DiLoCo costs.
"""

from __future__ import annotations

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import PyTree

from diloco_eqx import compiler
from diloco_eqx import mesh as mesh_lib
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import default_layers
from diloco_eqx.plan import LossFn, Plan
from diloco_eqx.steps import inner_step


class PlainStep:
    """`(state, batch) -> (state, losses)` on a flat (GBS, ...) batch; `state` is the pair
    (islands' array leaves, inner optimizer states), each with a leading island axis."""

    def __init__(self, plan: Plan, static: eqx.Module, layout: PyTree):
        self.plan, self.static, self.layout = plan, static, layout
        self._step = compiler.StepFunction(self._run, donate=True)

    def _run(self, batches, state):
        islands = mesh_lib.ISLANDS
        body = self.plan.islands.program(partial(inner_step, self.plan, self.static),
                                         in_specs=(islands,) * 3, out_specs=(islands,) * 3)
        arrays, opt_state, losses = body(*state, batches)
        new = (arrays, opt_state)
        if self.layout is not None:
            new = jax.tree.map(jax.lax.with_sharding_constraint, new, self.layout)
        return new, losses

    def place_batch(self, batch: PyTree) -> PyTree:
        return mesh_lib.place_island_batches(batch, self.plan.num_islands, self.plan.mesh)

    def __call__(self, state, batch):
        return self.step_placed(state, self.place_batch(batch))

    def step_placed(self, state, batches):
        return self._step(batches, state)

    def lower(self, state, batch) -> jax.stages.Lowered:
        return self._step.lower(self.place_batch(batch), state)


def make_plain_step(
    model: eqx.Module,
    loss_fn: LossFn,
    inner_optimizer: optax.GradientTransformation,
    num_replicas: int,
    mesh: Mesh | None = None,
    param_specs: mesh_lib.ParamSpecs | None = None,
) -> tuple[tuple[PyTree, PyTree], PlainStep]:
    """The initial state (every island at `model`) and the plain step."""
    mesh_lib.check_divides(num_replicas, mesh)
    arrays, static = eqx.partition(model, eqx.is_array)
    stack = partial(jax.tree.map, lambda x: jnp.broadcast_to(x, (num_replicas, *jnp.shape(x))))
    state = (stack(arrays), stack(inner_optimizer.init(eqx.filter(model, eqx.is_inexact_array))))
    layout = mesh_lib.shardings(state, mesh, True, param_specs or mesh_lib.default_param_specs(mesh))
    state = mesh_lib.place_sharded(state, layout)
    plan = Plan(DiLoCoConfig(num_replicas=num_replicas), loss_fn, inner_optimizer, optax.identity(),
                mesh, default_layers, deferred=False)
    return state, PlainStep(plan, static, layout)
