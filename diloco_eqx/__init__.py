"""diloco_eqx: DiLoCo and Streaming DiLoCo in JAX + Equinox.

The algorithm, in data-flow order: config -> schedule / fragments -> state -> sync -> step,
all behind one object, `DiLoCo`.
Training infrastructure lives in `diloco_eqx.training`, measurement in `diloco_eqx.analysis`;
both use this package, never the reverse.
"""

from diloco_eqx.codecs import AbstractCodec, register_codec, registered_codecs
from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.ddp import DDP
from diloco_eqx.diloco import DiLoCo
from diloco_eqx.faults import AbstractFaultModel, register_fault_model, registered_fault_models
from diloco_eqx.fragments import Fragmentation
from diloco_eqx.islands import Islands, register_backend, registered_backends
from diloco_eqx.mesh import AXIS, make_mesh
from diloco_eqx.metrics import StepMetrics
from diloco_eqx.orders import register_order, registered_orders
from diloco_eqx.outer import register_outer_optimizer, registered_outer_optimizers
from diloco_eqx.schedule import Schedule
from diloco_eqx.state import DiLoCoState
from diloco_eqx.sync import outer_optimizer

__all__ = [
    "AXIS",
    "AbstractCodec",
    "AbstractFaultModel",
    "DDP",
    "DiLoCo",
    "DiLoCoConfig",
    "DiLoCoState",
    "Fragmentation",
    "Islands",
    "Schedule",
    "StepMetrics",
    "make_mesh",
    "outer_optimizer",
    "register_backend",
    "register_codec",
    "register_fault_model",
    "register_order",
    "register_outer_optimizer",
    "registered_backends",
    "registered_codecs",
    "registered_fault_models",
    "registered_orders",
    "registered_outer_optimizers",
]
