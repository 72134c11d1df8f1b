"""Checkpoints: exact round trip of a sharded state and extras, retention, atomicity, damaged
checkpoints found and passed over, a full disk refused before a write."""

import errno
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.training.checkpoint import (
    Checkpointer,
    DamagedCheckpoint,
    fingerprint,
    key_from_json,
    key_to_json,
)
from tests.reference import make_toy, toy_loss

CFG = dl.DiLoCoConfig(num_replicas=4, sync_period=6, streaming=True, num_fragments=3)


def trained_state(mesh, steps=5):
    algo = dl.DiLoCo(CFG, toy_loss, optax.adamw(0.01), mesh=mesh)
    state = algo.init(make_toy(4, 3))
    rng = np.random.default_rng(0)
    for _ in range(steps):
        state, _ = algo.step(state, rng.normal(size=(8, 3)).astype(np.float32))
    return state, algo


def test_round_trip_is_exact_and_keeps_sharding(tmp_path):
    mesh = dl.make_mesh(2)
    state, algo = trained_state(mesh)
    ckpt = Checkpointer(tmp_path / "ck")
    key = jax.random.key(42)
    ckpt.save(5, state, {"data": {"next_index": 5}, "rng": key_to_json(key)})
    like = algo.init(make_toy(4, 3))
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


def _data_file(ckpt_dir):
    """The largest file the checkpoint's arrays are read from (orbax's merged data files)."""
    return max((ckpt_dir / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def forge_fingerprint(ckpt_dir):
    """Arrays that read back fine but are not what was saved (as a storage layer without
    checksums, or memory that flipped a bit before the write, would give)."""
    meta = ckpt_dir / "extra" / "metadata"
    extra = json.loads(meta.read_text())
    extra["fingerprint"][0][1] ^= 1
    meta.write_text(json.dumps(extra))


DAMAGE = {
    "truncated data file": lambda d: truncate(_data_file(d)),
    "garbled data file": lambda d: flip_middle_byte(_data_file(d)),
    "garbled extra": lambda d: flip_middle_byte(d / "extra" / "metadata"),
    "arrays not as saved": forge_fingerprint,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    early, algo = trained_state(None, steps=1)
    late, _ = trained_state(None, steps=3)
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(10, early, {"data": {"i": 10}})
    ckpt.save(20, late, {"data": {"i": 20}})
    DAMAGE[damage](tmp_path / "ck" / "20")
    said = []
    like = algo.init(make_toy(4, 3))
    step, restored, extra = Checkpointer(tmp_path / "ck").restore_intact(like, say=said.append)
    assert step == 10 and extra == {"data": {"i": 10}}
    for a, b in zip(jax.tree.leaves(early), jax.tree.leaves(restored)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert len(said) == 1 and said[0].startswith(f"checkpoint step 20 in {tmp_path / 'ck'} is damaged (")
    assert said[0].endswith(f"moved to {tmp_path / 'ck' / 'damaged-20'}; falling back to step 10")
    # the damaged one is kept aside and out of the way: step 20 can be written again
    again = Checkpointer(tmp_path / "ck")
    assert again.all_steps() == [10]
    again.save(20, late, {"data": {"i": 20}})
    assert again.restore(like)[0] == 20 and (tmp_path / "ck" / "damaged-20").is_dir()


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path):
    state, algo = trained_state(None, steps=1)
    ckpt = Checkpointer(tmp_path / "ck")
    for s in (10, 20):
        ckpt.save(s, state, {"data": {}})
        truncate(_data_file(tmp_path / "ck" / str(s)))
    said = []
    with pytest.raises(DamagedCheckpoint, match=r"no intact checkpoint left in .*\(damaged: steps 20, 10"):
        Checkpointer(tmp_path / "ck").restore_intact(algo.init(make_toy(4, 3)), say=said.append)
    assert said[-1].endswith("no earlier checkpoint")
    assert Checkpointer(tmp_path / "empty").restore_intact(state) is None


def test_fingerprint_is_the_plain_and_odd_weighted_sum_of_each_arrays_bits():
    words = np.array([1, 2, 3], np.uint32)
    got = fingerprint([jnp.asarray(words.view(np.float32)), jnp.asarray([True, False]),
                       jnp.asarray([0x0102, 0xFFFF], jnp.uint16)])
    # (sum w_i, sum (2i+1) w_i) mod 2^32 per leaf
    assert got.tolist() == [[6, 1 * 1 + 3 * 2 + 5 * 3], [1, 1], [0x0102 + 0xFFFF, 0x0102 + 3 * 0xFFFF]]
    big = jnp.full((1000,), 0xFFFFFFFF, jnp.uint32)
    assert fingerprint([big]).tolist() == [[(1000 * 0xFFFFFFFF) % 2**32, (10**6 * 0xFFFFFFFF) % 2**32]]
    x = jax.random.normal(jax.random.key(0), (64,), jnp.bfloat16)
    assert not np.array_equal(fingerprint([x]), fingerprint([x.at[17].set(x[17] + 1)]))
    assert fingerprint([jax.random.key(3)]).shape == (1, 2)


def test_a_save_the_disk_cannot_hold_is_refused_before_it_writes(tmp_path, monkeypatch):
    state, _ = trained_state(None, steps=1)
    ckpt = Checkpointer(tmp_path / "ck")
    ckpt.save(10, state, {"data": {}})
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(free, free - 1000, 1000))
    with pytest.raises(OSError) as e:
        ckpt.save(20, state, {"data": {}})
    assert e.value.errno == errno.ENOSPC
    assert e.value.strerror.startswith(f"no space left on device in {tmp_path / 'ck'} while saving checkpoint "
                                       "step 20 (not kept; the last complete checkpoint, step 10, is intact)")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["10"] and ckpt.all_steps() == [10]
