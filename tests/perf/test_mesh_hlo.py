"""The diloco mesh axis in the compiled step (read from its HLO): the cross-island collectives
run only inside the sync branches, and none without a mesh."""

import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import comms
from tests.core.test_mesh import CFG
from tests.reference import make_toy, toy_loss


def compiled_hlo(cfg, mesh):
    inner = optax.adamw(0.01)
    algo = dl.DiLoCo(cfg, toy_loss, inner, mesh=mesh)
    return algo.lower(algo.init(make_toy(4, 3)), np.zeros((8, 3), np.float32)).compile().as_text()


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("cfg", [CFG, dl.DiLoCoConfig(num_replicas=4, sync_period=5)],
                         ids=["streaming", "vanilla"])
def test_collectives_only_inside_sync_branches(cfg, d):
    hlo = compiled_hlo(cfg, dl.make_mesh(d))
    found = comms.collectives(hlo)
    assert found, "expected the pseudo-gradient all-reduce in the compiled step"
    always = comms.unconditional_computations(hlo)
    for c in found:
        assert c.computation not in always, f"{c.kind} {c.name} runs on every step"
        assert c.computation in comms.branch_computations(hlo)
        assert "diloco_sync" in c.op_name and "diloco_apply" not in c.op_name, c.op_name
        assert c.kind == "all-reduce"


def test_no_collectives_without_mesh():
    assert comms.collectives(compiled_hlo(CFG, None)) == []
