"""The Data-Parallel baseline's compiled step (read from its HLO): one all-reduce of the
gradient on every step, and nothing else crosses islands."""

import numpy as np
import optax

import diloco_eqx as dl
from diloco_eqx.analysis import comms
from tests.core.test_ddp import data, jax_leaves
from tests.reference import make_toy, toy_loss


def test_ddp_all_reduces_every_step():
    mesh = dl.make_mesh(2)
    ddp = dl.DDP(2, toy_loss, optax.sgd(0.1), mesh=mesh)
    hlo = ddp.lower(ddp.init(make_toy(4, 3)), data(1)[0]).compile().as_text()
    found = comms.collectives(hlo)
    assert found and all(c.computation in comms.unconditional_computations(hlo) for c in found)
    # one mean of the gradient: |Θ| float32 values, nothing else
    n = sum(x.size for x in jax_leaves(make_toy(4, 3)) if x.dtype == np.float32)
    assert comms.every_step_payload_bytes(hlo) == 4 * n
