"""Islands that span several devices: (diloco × data × fsdp) meshes on 8 simulated devices.

The step on every island mesh equals the NumPy reference (which the one-device step equals:
test_step); it compiles once and keeps the state's layout; inside an island the gradient reductions run
every step, across islands only the syncs' collectives, on 1/m of a fragment per device
with fsdp = m."""

import collections
import functools
import itertools
import math

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import comms
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
# below); the slow set runs every config on every mesh
FAST = {("2x2data", 2, "drops"), ("2x2fsdp", 2, "v2_alpha05"), ("2x2fsdp", 1, "fp4")}


def data_for(k: int, steps: int = 18):
    rng = np.random.default_rng(3)
    return [rng.normal(size=(k * ROWS, WIDTH)).astype(np.float32) for _ in range(steps)]


def run(cfg, mesh, data):
    state = dl.init_state(make_toy(N_LAYERS, WIDTH), optax.sgd(0.05), cfg, mesh)
    step = dl.make_train_step(cfg, toy_loss, optax.sgd(0.05), mesh)
    losses = []
    for x in data:
        state, m = step(state, x)
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
    return np.array(losses), toy_to_numpy(step.outer_model(state)), state


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
    state = dl.init_state(make_toy(N_LAYERS, WIDTH), optax.adamw(0.01), cfg, mesh)
    step = dl.make_train_step(cfg, toy_loss, optax.adamw(0.01), mesh)
    layout = [x.sharding for x in jax.tree.leaves(state)]
    state, old, compiles = run_counting_compilations(step, state, data_for(cfg.num_replicas, 12))
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


def hlo_config(config: str) -> dl.DiLoCoConfig:
    """CONFIGS[config] for the HLO tests' two islands, at H = 6."""
    return dl.DiLoCoConfig(num_replicas=2, **{**CONFIGS[config], "sync_period": 6})


@functools.cache
def compiled_transformer_step(mesh_name: str, config: str | None, width: int = 32):
    """The compiled step of a 2-layer Transformer on an island mesh, two islands, AdamW: plain
    training's (config None) or DiLoCo's with CONFIGS[config] at H = 6. Cached: the HLO tests
    below read the same few programs (and run on one worker, so compile each once)."""
    from diloco_eqx.analysis.plain import make_plain_step
    from diloco_eqx.models.transformer import Transformer, TransformerConfig, loss_fn

    model = Transformer(TransformerConfig(num_layers=2, width=width, num_heads=2, seq_len=16), jax.random.key(0))
    mesh, inner, batch = dl.make_mesh(**MESHES[mesh_name]), optax.adamw(1e-3), np.zeros((8, 17), np.int32)
    if config is None:
        state, step = make_plain_step(model, loss_fn, inner, 2, mesh)
    else:
        cfg = hlo_config(config)
        state, step = dl.init_state(model, inner, cfg, mesh), dl.make_train_step(cfg, loss_fn, inner, mesh)
    return model, mesh, step.lower(state, batch).compile()


@pytest.mark.xdist_group("island_mesh_hlo")
def test_what_crosses_islands_and_what_stays_inside():
    """Transformer, Streaming P=3 (V=1), mesh 2 × data 2 × fsdp 2: gradient reductions over
    "data" run on every step; every collective over "diloco" sits in a sync branch and moves
    a quarter of its fragment's bytes per device: the outer copy is split over all 4 devices
    of an island, so each island sends each fragment once, not once per data replica."""
    model, mesh, step = compiled_transformer_step("2x2datax2fsdp", "v1_alpha05")
    cfg, hlo = hlo_config("v1_alpha05"), step.as_text()
    always, branch = comms.unconditional_computations(hlo), comms.branch_computations(hlo)
    found = comms.collectives(hlo)
    across = [c for c in found if "diloco" in c.axes(mesh)]
    inside = [c for c in found if c.axes(mesh) and "diloco" not in c.axes(mesh)]
    assert across and all(c.computation in branch and c.fragment is not None for c in across)
    assert any(c.computation in always and c.axes(mesh) == {"data"} for c in inside)
    frag_bytes = [4 * n for n in dl.Fragmentation.from_model(model, cfg).param_counts(
        eqx.filter(model, eqx.is_inexact_array))]
    per_device = [sum(c.payload_bytes for c in across if c.fragment == f and not c.rechecked) for f in range(3)]
    assert per_device == [b // 4 for b in frag_bytes]
    # a sync done again after an untrusted first pass (a non-finite island) moves the same bytes
    again = [sum(c.payload_bytes for c in across if c.fragment == f and c.rechecked) for f in range(3)]
    assert again == per_device


@pytest.mark.xdist_group("island_mesh_hlo")
@pytest.mark.parametrize("mesh_name", [pytest.param("2x2data", marks=pytest.mark.slow),
                                       pytest.param("2x2fsdp", marks=pytest.mark.slow), "2x2datax2fsdp"])
def test_memory_per_device(mesh_name):
    """Compiled memory per device, vanilla DiLoCo vs plain training on the same island mesh:
    the islands' state is plain training's, byte for byte; DiLoCo adds the outer model and
    its trace, split over the island's n·m devices (2·|Θ|·4/(n·m)); no extra temporaries."""
    from diloco_eqx.analysis import profiling
    from diloco_eqx.models.transformer import count_params

    # width 64: a model whose temporaries dwarf the step's fixed few KB of scalars and flags
    model, mesh, plain_step = compiled_transformer_step(mesh_name, None, 64)
    plain = profiling.memory(plain_step)
    diloco = profiling.memory(compiled_transformer_step(mesh_name, "vanilla", 64)[2])
    split = mesh.shape["data"] * mesh.shape["fsdp"]  # every leaf of this model divides by 4
    extra = diloco["argument_bytes"] - plain["argument_bytes"]
    assert abs(extra - 2 * count_params(model) * 4 / split) < 64  # the step counter and scalars
    assert diloco["temp_bytes"] <= 1.02 * plain["temp_bytes"]


@pytest.mark.xdist_group("island_mesh_hlo")
@pytest.mark.parametrize("mesh_name,config", [("2x2datax2fsdp", "v1_alpha05"),
                                              pytest.param("2x2datax2fsdp", "vanilla", marks=pytest.mark.slow),
                                              pytest.param("2x2data", "vanilla", marks=pytest.mark.slow),
                                              pytest.param("2x2data", "v1_alpha05", marks=pytest.mark.slow)])
def test_steps_without_an_event_communicate_and_copy_like_plain_training(mesh_name, config):
    """The collectives that run on every step are exactly plain training's on the same
    island mesh (the inner step's reductions inside each island): the state is never
    resharded around the schedule's events, although the outer copy is split differently
    from the islands'. And XLA copies no more than in plain training on those steps (a few
    scalars): the events' loops update the state in place (a conditional passing the outer
    model through would copy it, +2·|Θ|·4/(n·m) bytes per step); the only extra copies are
    scalars and per-island flags."""
    cfg = hlo_config(config)
    _, mesh, plain_step = compiled_transformer_step(mesh_name, None)
    plain_hlo, hlo = plain_step.as_text(), compiled_transformer_step(mesh_name, config)[2].as_text()

    def every_step(hlo):
        always = comms.unconditional_computations(hlo)
        return sorted((c.kind, tuple(sorted(c.axes(mesh))), c.payload_bytes)
                      for c in comms.collectives(hlo) if c.computation in always)

    assert every_step(plain_hlo) and every_step(hlo) == every_step(plain_hlo)
    extra = collections.Counter(comms.every_step_copies(hlo)) - collections.Counter(comms.every_step_copies(plain_hlo))
    # at most scalars and per-island flags: the events' loop counters and masks
    assert all(math.prod(dims) <= cfg.num_replicas for _, dims in extra), extra
