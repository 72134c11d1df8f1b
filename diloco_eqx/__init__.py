"""diloco_eqx: DiLoCo and Streaming DiLoCo in JAX + Equinox.

Read in data-flow order: config -> schedule / fragments -> state -> step.
"""

from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.fragments import Fragmentation
from diloco_eqx.islands import AXIS, make_mesh
from diloco_eqx.orders import register_order, registered_orders
from diloco_eqx.outer import outer_optimizer
from diloco_eqx.schedule import Schedule
from diloco_eqx.state import DiLoCoState, init_state
from diloco_eqx.step import StepMetrics, make_train_step

__all__ = [
    "AXIS",
    "DiLoCoConfig",
    "DiLoCoState",
    "Fragmentation",
    "Schedule",
    "StepMetrics",
    "init_state",
    "make_mesh",
    "make_train_step",
    "outer_optimizer",
    "register_order",
    "registered_orders",
]
