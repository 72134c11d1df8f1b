"""The compiled step's traffic across islands (islands.py, read from its HLO): the shard_map
and drjax backends move the same bytes per fragment, and only inside the sync branches."""

import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import comms
from diloco_eqx.mesh import island_size
from tests.core.test_islands import N_LAYERS, ROWS, config, mesh_for
from tests.reference import make_toy, toy_loss


def crossing(cfg, mesh, backend):
    """(bytes per device across islands per fragment, cross-island collectives outside the
    syncs) of the compiled step."""
    algo = dl.DiLoCo(cfg, toy_loss, optax.adamw(0.01), mesh=mesh, backend=backend)
    state = algo.init(make_toy(N_LAYERS, 8))
    batch = np.zeros((cfg.num_replicas * ROWS, 8), np.float32)
    hlo = algo.lower(state, batch).compile().as_text()
    p = algo.schedule.num_fragments
    return comms.fragment_payload_bytes(hlo, p, mesh), comms.cross_island_outside_syncs(hlo, mesh)


@pytest.mark.parametrize("mesh_name,name", [("1d", "fp4_error_feedback"),
                                            pytest.param("2x2datax2fsdp", "v1_alpha0_sequential", marks=pytest.mark.slow),
                                            pytest.param("2x2datax2fsdp", "fp4_error_feedback", marks=pytest.mark.slow),
                                            pytest.param("2x2data", "vanilla_sgd", marks=pytest.mark.slow)])
def test_same_bytes_cross_islands_and_only_inside_syncs(mesh_name, name):
    """Uncompressed, and compressed on one device per island: the same payload bytes. A
    compressed payload of islands of several devices is split differently by GSPMD (never
    more bytes: decoded floats do not cross)."""
    mesh = mesh_for(mesh_name)
    cfg = config(name)
    written, outside = crossing(cfg, mesh, "shard_map")
    gspmd, gspmd_outside = crossing(cfg, mesh, "drjax")
    assert all(b > 0 for b in written)
    if cfg.codec.lossless or island_size(mesh) == 1:
        assert gspmd == written
    else:
        assert all(0 < g <= w for g, w in zip(gspmd, written))
    assert outside == [] and gspmd_outside == []
