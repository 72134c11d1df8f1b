"""Islands that span several devices: (diloco × data × fsdp) meshes on 8 simulated devices.

The step on every island mesh equals the NumPy reference (which the one-device step equals:
test_step); it compiles once and keeps the state's layout (what its compiled program moves
and holds per device: tests/perf/test_island_mesh_hlo.py)."""

import itertools

import jax
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from tests.helpers import drops_of, run_counting_compilations
from tests.reference import NpSGD, make_toy, np_run, toy_loss, toy_to_numpy

N_LAYERS, WIDTH, ROWS = 4, 4, 4  # ROWS per island: divisible by every data size below

MESHES = {
    "2x2data": dict(diloco=2, data=2),
    "2x4data": dict(diloco=2, data=4),
    "2x2fsdp": dict(diloco=2, fsdp=2),
    "2x2datax2fsdp": dict(diloco=2, data=2, fsdp=2),
    "1x4data": dict(diloco=1, data=4),
}
STREAMING = dict(streaming=True, sync_period=6, num_fragments=3)
CONFIGS = {
    "vanilla": dict(sync_period=4),
    "v0_alpha0": STREAMING,
    "v0_alpha05": {**STREAMING, "alpha": 0.5},
    "v1_alpha0": {**STREAMING, "overlap_steps": 1},
    "v1_alpha05": {**STREAMING, "overlap_steps": 1, "alpha": 0.5},
    "v2_alpha05": {**STREAMING, "overlap_steps": 2, "alpha": 0.5},
    "fp4": {**STREAMING, "overlap_steps": 1, "compression": "fp4", "error_feedback": True},
    "drops": dict(sync_period=4, drops=[(4, 1), (8, 0)], drop_prob=0.3, fault_seed=2),
}
GRID = list(itertools.product(MESHES, (1, 2), CONFIGS))
# the fast run: islands of data 2 and of fsdp 2, one and two islands per device, vanilla with
# faults, Streaming with V = 2 and with V = 1 under fp4 (data × fsdp islands: the HLO tests
# in tests/perf); the slow set runs every config on every mesh
FAST = {("2x2data", 2, "drops"), ("2x2fsdp", 2, "v2_alpha05"), ("2x2fsdp", 1, "fp4")}


def data_for(k: int, steps: int = 18):
    rng = np.random.default_rng(3)
    return [rng.normal(size=(k * ROWS, WIDTH)).astype(np.float32) for _ in range(steps)]


def run(cfg, mesh, data):
    algo = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05), mesh=mesh)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
    return np.array(losses), toy_to_numpy(algo.outer_model(state)), state


def reference(cfg, data):
    return np_run(toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=cfg.num_replicas, h=cfg.sync_period,
                  inner=NpSGD(0.05), streaming=cfg.streaming, p=cfg.num_fragments, v=cfg.overlap_steps,
                  alpha=cfg.alpha, outer_lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                  compression=cfg.compression, error_feedback=cfg.error_feedback, dropped=drops_of(cfg))


@pytest.mark.parametrize(
    "mesh_name,per_device,config",
    [g if g in FAST else pytest.param(*g, marks=pytest.mark.slow) for g in GRID],
)
def test_island_mesh_equals_the_reference(mesh_name, per_device, config):
    mesh = dl.make_mesh(**MESHES[mesh_name])
    k = mesh.shape["diloco"] * per_device
    settings = dict(CONFIGS[config])
    if "drops" in settings:  # drop the last island, whatever K is
        settings["drops"] = [(4, k - 1), (8, 0)]
    cfg = dl.DiLoCoConfig(num_replicas=k, **settings)
    data = data_for(k)  # 18 steps: 3·H_eff for the streaming configs, 4.5·H for vanilla
    losses, outer, state = run(cfg, mesh, data)
    ref_losses, ref_outer, ref_islands = reference(cfg, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    for name, got in outer.items():
        np.testing.assert_allclose(got, ref_outer[name], rtol=2e-5, atol=2e-5)
    for i, isl in enumerate(ref_islands):
        for name, got in toy_to_numpy(state.island(i)).items():
            np.testing.assert_allclose(got, isl[name], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mesh_name", [m if m in ("2x2datax2fsdp", "1x4data") else pytest.param(m, marks=pytest.mark.slow)
                                       for m in MESHES])
def test_compiles_once_and_keeps_the_layout(mesh_name):
    """Over 2·H_eff steps (every schedule position): one compilation, output shardings equal
    to the input ones, the old state's buffers donated."""
    mesh = dl.make_mesh(**MESHES[mesh_name])
    cfg = dl.DiLoCoConfig(num_replicas=2 * mesh.shape["diloco"], **CONFIGS["v1_alpha05"])
    algo = dl.DiLoCo(cfg, toy_loss, optax.adamw(0.01), mesh=mesh)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    layout = [x.sharding for x in jax.tree.leaves(state)]
    state, old, compiles = run_counting_compilations(algo, state, data_for(cfg.num_replicas, 12))
    assert compiles == 1
    assert [x.sharding for x in jax.tree.leaves(state)] == layout
    assert old.inner_model.embed.is_deleted()
    def split_over(x):
        return {n for e in x.sharding.spec if e is not None for n in (e if isinstance(e, tuple) else (e,))}

    def sizes_over_1(*names):
        return {n for n in names if mesh.shape.get(n, 1) > 1}

    # islands split their leaves over fsdp; the outer copy and its trace over all of an
    # island's devices
    assert split_over(state.inner_model.layers.w) == sizes_over_1("diloco", "fsdp")
    assert split_over(state.outer.layers.w) == sizes_over_1("data", "fsdp")
    traces = [x for x in jax.tree.leaves(state.outer_opt_state) if x.ndim == 2]
    assert traces and all(split_over(x) == sizes_over_1("data", "fsdp") for x in traces)
