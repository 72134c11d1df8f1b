"""Islands that span several devices, in the compiled step (read from its HLO and its memory
analysis): inside an island the gradient reductions run every step, across islands only the
syncs' collectives, on 1/m of a fragment per device with fsdp = m; DiLoCo's memory per device
is plain training's plus the split outer model; steps without an event communicate and copy
as plain training does."""

import collections
import functools
import math

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import comms
from tests.core.test_island_mesh import CONFIGS, MESHES


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
        step = dl.DiLoCo(hlo_config(config), loss_fn, inner, mesh=mesh)
        state = step.init(model)
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
