"""The two island backends (islands.py): shard_map and drjax give the NumPy reference's numbers
and each other's on no mesh, a 1-D diloco axis and two island meshes; both compile once and keep
the state's layout (the bytes they move across islands: tests/perf/test_islands_hlo.py).

`pytest --backend drjax` reruns the whole suite on drjax; the default run covers four configs
here, the slow set every config on every mesh."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.islands import BACKENDS, ShardMapIslands, register_backend
from tests.helpers import drops_of, run_counting_compilations
from tests.reference import NpAdamW, NpSGD, make_toy, np_run, toy_loss, toy_to_numpy

N_LAYERS, WIDTH, ROWS = 4, 4, 4  # ROWS per island: divisible by every data size below

MESHES = {
    "none": None,
    "1d": dict(num_devices=2),
    "2x2data": dict(diloco=2, data=2),
    "2x2datax2fsdp": dict(diloco=2, data=2, fsdp=2),
}
STREAMING = dict(streaming=True, sync_period=6, num_fragments=3)
# (config, inner optimizer, island dtype)
CONFIGS = {
    "vanilla_sgd": (dict(sync_period=4), "sgd", "float32"),
    "vanilla_adamw": (dict(num_replicas=2, sync_period=4), "adamw", "float32"),
    "v0_alpha05": ({**STREAMING, "alpha": 0.5}, "sgd", "float32"),
    "v1_alpha0_sequential": ({**STREAMING, "overlap_steps": 1, "fragment_order": "sequential"}, "sgd", "float32"),
    "v1_alpha1": ({**STREAMING, "overlap_steps": 1, "alpha": 1.0}, "sgd", "float32"),
    "v2_alpha05_adamw": ({**STREAMING, "overlap_steps": 2, "alpha": 0.5}, "adamw", "float32"),
    "bf16_payload": ({**STREAMING, "overlap_steps": 1, "compression": "bf16"}, "sgd", "float32"),
    "fp4_error_feedback": ({**STREAMING, "overlap_steps": 1, "compression": "fp4", "error_feedback": True},
                           "sgd", "float32"),
    "fp8_vanilla": (dict(sync_period=4, compression="fp8"), "sgd", "float32"),
    "drops": (dict(sync_period=4, drops=[(4, 3), (8, 0)], drop_prob=0.3, fault_seed=2), "sgd", "float32"),
    "drops_streaming": ({**STREAMING, "overlap_steps": 1, "drops": [(6, 1)], "drop_prob": 0.25}, "adamw",
                        "float32"),
    "bfloat16_islands": ({**STREAMING, "overlap_steps": 1, "alpha": 0.5}, "sgd", "bfloat16"),
}
GRID = [(m, c) for c in CONFIGS for m in MESHES]
# the fast run: four configs that between them reach the parts of the step the backends
# implement differently (vanilla with faults, Streaming with V = 2 and AdamW, a lossy codec
# with error feedback, bf16 islands), on the three meshes short of the 8-device one (the
# slowest to compile; the drjax tests below and the slow grid cover it); the slow set runs
# every config on every mesh
FAST = {("none", "drops"), ("1d", "v2_alpha05_adamw"), ("1d", "fp4_error_feedback"),
        ("2x2data", "bfloat16_islands")}
INNER = {"sgd": (lambda: optax.sgd(0.05), lambda dt: NpSGD(0.05, dt)),
         "adamw": (lambda: optax.adamw(0.01, weight_decay=1e-4), lambda dt: NpAdamW(0.01))}
DTYPES = {"float32": (jnp.float32, None), "bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16)}


def mesh_for(name):
    spec = MESHES[name]
    return None if spec is None else dl.make_mesh(**spec)


def config(name):
    settings, _, _ = CONFIGS[name]
    return dl.DiLoCoConfig(**{"num_replicas": 4, **settings})


def data_for(k: int, steps: int = 18):
    rng = np.random.default_rng(3)
    return [rng.normal(size=(k * ROWS, WIDTH)).astype(np.float32) for _ in range(steps)]


def run(cfg, mesh, data, inner, dtype, backend):
    algo = dl.DiLoCo(cfg, toy_loss, inner, mesh=mesh, backend=backend)
    state = algo.init(make_toy(N_LAYERS, WIDTH, dtype=dtype))
    losses = []
    for x in data:
        state, m = algo.step(state, x)
        losses.append([m[f"loss_island_{i}"] for i in range(cfg.num_replicas)])
    islands = [toy_to_numpy(state.island(i)) for i in range(cfg.num_replicas)]
    return np.array(losses), toy_to_numpy(algo.outer_model(state)), islands


def reference(cfg, data, inner_np, dtype):
    return np_run(toy_to_numpy(make_toy(N_LAYERS, WIDTH, dtype=DTYPES[dtype][0])), data, k=cfg.num_replicas,
                  h=cfg.sync_period, inner=inner_np, streaming=cfg.streaming, p=cfg.num_fragments,
                  order=cfg.fragment_order, v=cfg.overlap_steps, alpha=cfg.alpha, outer_lr=cfg.outer_lr,
                  momentum=cfg.outer_momentum, compression=cfg.compression,
                  error_feedback=cfg.error_feedback, dropped=drops_of(cfg), dtype=DTYPES[dtype][1])


def assert_close(got, want, tol=2e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for name, value in got[1].items():
        np.testing.assert_allclose(value, want[1][name], rtol=tol, atol=tol)
    for island, want_island in zip(got[2], want[2]):
        for name, value in island.items():
            np.testing.assert_allclose(value, want_island[name], rtol=tol, atol=tol)


@pytest.mark.parametrize("mesh_name,name", [g if g in FAST else pytest.param(*g, marks=pytest.mark.slow)
                                            for g in GRID])
def test_backends_equal_the_reference_and_each_other(mesh_name, name):
    cfg = config(name)
    _, inner, dtype = CONFIGS[name]
    make_inner, make_np = INNER[inner]
    data = data_for(cfg.num_replicas)  # 18 steps: 3·H_eff for streaming, 4.5·H for vanilla
    mesh = mesh_for(mesh_name)
    shard_map = run(cfg, mesh, data, make_inner(), DTYPES[dtype][0], "shard_map")
    drjax = run(cfg, mesh, data, make_inner(), DTYPES[dtype][0], "drjax")
    assert_close(drjax, shard_map)
    ref = reference(cfg, data, make_np(DTYPES[dtype][1]), dtype)
    for got in (shard_map, drjax):
        assert_close(got, ref)


@pytest.mark.parametrize("mesh_name", [pytest.param("1d", marks=pytest.mark.slow), "2x2datax2fsdp"])
def test_drjax_compiles_once_and_keeps_the_layout(mesh_name):
    """Over 2·H_eff steps (every schedule position): one compilation, the state's shardings
    unchanged, the old state's buffers donated."""
    mesh = mesh_for(mesh_name)
    cfg = config("v2_alpha05_adamw")
    algo = dl.DiLoCo(cfg, toy_loss, optax.adamw(0.01), mesh=mesh, backend="drjax")
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    layout = [x.sharding for x in jax.tree.leaves(state)]
    state, old, compiles = run_counting_compilations(algo, state, data_for(cfg.num_replicas, 12))
    assert compiles == 1
    assert [x.sharding for x in jax.tree.leaves(state)] == layout
    assert old.inner_model.embed.is_deleted()


def test_unknown_backend_names_the_knob():
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4)
    with pytest.raises(ValueError, match=r"backend must be one of \('shard_map', 'drjax'.*\); got 'gspmd'"):
        dl.DiLoCo(cfg, toy_loss, optax.sgd(0.1), backend="gspmd")


def test_a_new_backend_is_one_class_and_one_call():
    """A backend registered from outside runs the step; this one counts the sums it is asked
    for (one per leaf of the fragment, plus the count of contributing islands, per sync; a
    sync is traced twice: its first pass and the pass checked again if that is not trusted)."""
    calls = []

    @dataclasses.dataclass(frozen=True)
    class Counting(ShardMapIslands):
        def sum(self, tree):
            calls.append(len(jax.tree.leaves(tree)))
            return super().sum(tree)

    register_backend("counting", Counting)
    try:
        cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4)
        data = data_for(2, 8)
        got = run(cfg, None, data, optax.sgd(0.05), jnp.float32, "counting")
        assert_close(got, run(cfg, None, data, optax.sgd(0.05), jnp.float32, "shard_map"))
        n_leaves = len(jax.tree.leaves(dl.DiLoCo(cfg, toy_loss, optax.sgd(0.05)).init(make_toy(N_LAYERS, WIDTH)).outer))
        assert sorted(calls) == [1, 1, n_leaves - 1, n_leaves - 1]  # the count, every float leaf
    finally:
        BACKENDS.items.pop("counting")


class Lookup(eqx.Module):
    """Embeds by indexing its table: a gather from a table the fsdp axis splits."""

    embed: jax.Array
    head: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = jax.random.normal(k1, (16, 8)) * 0.1
        self.head = jax.random.normal(k2, (8, 16)) * 0.1


def lookup_loss(model, batch):
    logits = model.embed[batch[:, :-1]] @ model.head
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], -1))


def test_drjax_trains_a_model_that_gathers_from_a_split_table():
    """Indexing a table split over fsdp inside the partly manual shard_map aborts XLA's
    partitioner (jax 0.10 and 0.12, islands of data × fsdp); under plain jit GSPMD partitions it.
    On 2 islands of data 2 × fsdp 2 the drjax step equals the one-device step."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=2)
    tokens = np.random.default_rng(0).integers(0, 16, (6, 8, 5), dtype=np.int32)

    def losses(mesh, backend):
        algo = dl.DiLoCo(cfg, lookup_loss, optax.adamw(1e-2), mesh=mesh, backend=backend)
        state = algo.init(Lookup(jax.random.key(0)))
        out = []
        for batch in tokens:
            state, m = algo.step(state, batch)
            out.append(m["loss"])
        return np.array(out)

    np.testing.assert_allclose(losses(mesh_for("2x2datax2fsdp"), "drjax"), losses(None, "shard_map"), rtol=2e-5)
