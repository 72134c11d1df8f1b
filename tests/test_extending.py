"""A codec and a fault model added from outside the package — one class and one register
call each — run through the step (against the NumPy reference), the training CLI's flags
and the communication report, with nothing in diloco_eqx/ changed."""

import json
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import diloco_eqx as dl
from diloco_eqx import codecs, faults
from tests.helpers import N_LAYERS, WIDTH, batches, run_jax
from tests.reference import NpSGD, make_toy, np_run, toy_to_numpy


class Int8(dl.AbstractCodec):
    """Symmetric int8 with a per-tensor float32 scale: max |x| maps to 127."""

    bits: ClassVar[int] = 8

    def encode(self, flat):
        m = jnp.max(jnp.abs(flat))
        scale = jnp.where(m > 0, m / 127.0, 1.0).astype(jnp.float32)
        q = jnp.round(flat / scale).astype(jnp.int8)
        return {"values": lax.bitcast_convert_type(q, jnp.uint8), "scale": scale}

    def decode(self, payload, n):
        return lax.bitcast_convert_type(payload["values"], jnp.int8).astype(jnp.float32) * payload["scale"]

    def error_bound(self, x):
        return jnp.full(jnp.shape(x), jnp.max(jnp.abs(x)) / 254.0 * (1 + 1e-6))

    def payload_bytes(self, n):
        return n + 4


class Offline(dl.AbstractFaultModel):
    """Island `island` misses every sync at start <= t < stop (its machine is down)."""

    island: int
    start: int
    stop: int

    def missing(self, t, ids, deltas):
        return (ids == self.island) & (t >= self.start) & (t < self.stop)


def np_int8(x):
    """What int8 delivers for x, written with NumPy (round half to even, as jnp.round)."""
    x32 = np.asarray(x, np.float32)
    m = float(np.max(np.abs(x32)))
    scale = np.float32(m / np.float32(127.0)) if m > 0 else np.float32(1.0)
    return np.round(x32 / scale).astype(np.float32).astype(np.float64) * np.float64(scale)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """Register both for one test only (a copy of each registry is restored afterwards)."""
    monkeypatch.setattr(codecs.CODECS, "items", dict(codecs.CODECS.items))
    monkeypatch.setattr(faults.MODELS, "items", dict(faults.MODELS.items))
    dl.register_codec("int8", Int8())
    dl.register_fault_model("island1_down", Offline(island=1, start=5, stop=13))


def test_codec_roundtrip_is_within_its_bound():
    x = np.random.default_rng(0).standard_cauchy(999).astype(np.float32)
    got = np.asarray(codecs.roundtrip(jnp.asarray(x), "int8"))
    assert np.all(np.abs(got - x) <= np.asarray(codecs.error_bound(jnp.asarray(x), "int8")))
    np.testing.assert_allclose(got, np_int8(x), rtol=1e-6)
    assert codecs.payload_bytes(999, "int8") == 1003 == sum(v.nbytes for v in codecs.encode(x, "int8").values())


@pytest.mark.parametrize("streaming", [False, True])
def test_both_run_through_the_step_as_the_reference_says(streaming):
    knobs = dict(num_replicas=4, sync_period=4, compression="int8", faults=("island1_down",))
    if streaming:
        knobs.update(streaming=True, sync_period=6, num_fragments=3, overlap_steps=1, alpha=0.5)
    cfg = dl.DiLoCoConfig(**knobs)
    data = batches(18)
    losses, state = run_jax(cfg, optax.sgd(0.05), data)
    log = {}
    ref_losses, ref_outer, _ = _reference_with(np_int8, knobs, data, log)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    for name, got in toy_to_numpy(state.outer).items():
        np.testing.assert_allclose(got, ref_outer[name], rtol=2e-5, atol=2e-5)
    assert any(n == 3 for _, n in log["contributed"]) and log["contributed"][-1][1] == 4


def _reference_with(quantize, knobs, data, log):
    """The NumPy reference with island 1 down for 5 <= t < 13 and `quantize` on the wire."""
    cfg = dl.DiLoCoConfig(**{**knobs, "compression": "none", "faults": ()})
    return np_run(toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=cfg.num_replicas, h=cfg.sync_period,
                  inner=NpSGD(0.05), streaming=cfg.streaming, p=cfg.num_fragments,
                  v=cfg.overlap_steps, alpha=cfg.alpha, outer_lr=cfg.outer_lr,
                  momentum=cfg.outer_momentum, compression=quantize,
                  dropped=lambda t, i: i == 1 and 5 <= t < 13, log=log)


def test_both_through_the_training_cli(tmp_path):
    from experiments import train

    out = tmp_path / "run"
    argv = ["--corpus", "markov", "num_bytes=200000", "doc_bytes=20000", "--layers", "2", "--width", "32",
            "--heads", "2", "--seq-len", "32", "--global-batch", "8", "--num-replicas", "4",
            "--no-streaming", "--sync-period", "3", "--steps", "12", "--eval-every", "12",
            "--no-progress", "--compression", "int8", "--faults", "island1_down", "--out", str(out)]
    assert train.main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    contributed = {r["step"]: r["islands_contributed"] for r in rows if "islands_contributed" in r}
    assert contributed == {3: 4, 6: 3, 9: 3, 12: 3}  # island 1 is down for 5 <= t < 13
    assert all(r["compression_error"] > 0 for r in rows if "compression_error" in r)
    settings = json.loads((out / "run.json").read_text())["settings"]
    assert settings["compression"] == "int8" and settings["faults"] == ["island1_down"]


@pytest.mark.slow  # compiles two steps on a 2-device mesh; the CLI test runs both in the fast set
def test_both_through_the_comm_report():
    from tools import comm_report

    small = ["--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16", "--num-fragments", "3"]
    r = comm_report.measure(comm_report.build_parser().parse_args(
        small + ["--compression", "int8", "--faults", "island1_down"]))
    # one byte per value plus a 4-byte scale per tensor: 4 tensors in fragment 0, 6 in a layer one
    assert [f["collective_bytes"] for f in r["fragments"]] == [
        f["params"] + 4 * n for f, n in zip(r["fragments"], (4, 6, 6))]
