"""Checkpoints: exact round trip of a sharded state and extras, retention, atomicity."""

import jax
import numpy as np
import optax

import diloco_eqx as dl
from diloco_eqx.training.checkpoint import Checkpointer, key_from_json, key_to_json
from tests.reference import make_toy, toy_loss

CFG = dl.DiLoCoConfig(num_replicas=4, sync_period=6, streaming=True, num_fragments=3)


def trained_state(mesh, steps=5):
    opt = optax.adamw(0.01)
    state = dl.init_state(make_toy(4, 3), opt, CFG, mesh)
    step = dl.make_train_step(CFG, toy_loss, opt, mesh)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        state, _ = step(state, rng.normal(size=(8, 3)).astype(np.float32))
    return state, opt


def test_round_trip_is_exact_and_keeps_sharding(tmp_path):
    mesh = dl.make_mesh(2)
    state, opt = trained_state(mesh)
    ckpt = Checkpointer(tmp_path / "ck")
    key = jax.random.key(42)
    ckpt.save(5, state, {"data": {"next_index": 5}, "rng": key_to_json(key)})
    like = dl.init_state(make_toy(4, 3), opt, CFG, mesh)
    step, restored, extra = ckpt.restore(like)
    assert step == 5 and extra["data"] == {"next_index": 5}
    assert np.array_equal(jax.random.key_data(key_from_json(extra["rng"])), jax.random.key_data(key))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert restored.inner_model.embed.sharding.spec == dl.mesh.ISLANDS
    assert int(restored.outer.calls) == 7


def test_keeps_the_last_two_and_ignores_unfinished_writes(tmp_path):
    state, _ = trained_state(None, steps=1)
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    for s in (10, 20, 30):
        ckpt.save(s, state, {"data": {}})
    assert ckpt.all_steps() == [20, 30]
    # a save that died before it was committed leaves only a temporary directory
    (tmp_path / "ck" / "40.orbax-checkpoint-tmp-1234").mkdir()
    assert Checkpointer(tmp_path / "ck").latest_step() == 30
