"""Heterogeneous islands: which steps a slow island takes, the token weights, and the step
against the NumPy reference (which counts the steps one by one)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx import speeds
from tests.helpers import N_LAYERS, WIDTH, batches, run_jax
from tests.reference import NpAdamW, make_toy, np_run, np_tokens, toy_loss, toy_to_numpy


def test_active_steps_and_weights_by_hand():
    """H_eff = 4, islands taking 4, 2 and 1 steps per period: island 1 works on steps
    1, 2, 5, 6, ..., island 2 on 1, 5, 9, ...; the window of a sync at t = 2 (a streaming
    fragment's first sync) holds 2, 2, 1 of their steps, any later full window 4, 2, 1."""
    n = jnp.array([4, 2, 1])
    table = np.array([np.asarray(speeds.is_active(n, 4, t)) for t in range(1, 9)])
    np.testing.assert_array_equal(table[:, 1], [1, 1, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(table[:, 2], [1, 0, 0, 0, 1, 0, 0, 0])
    assert table[:, 0].all()
    assert np.asarray(speeds.steps_since_sync(n, 4, 2)).tolist() == [2, 2, 1]
    for t in (4, 6, 7, 8, 12):
        assert np.asarray(speeds.steps_since_sync(n, 4, t)).tolist() == [4, 2, 1]
        assert np_tokens([4, 2, 1], 3, 4, t) == [4, 2, 1]


def test_island_steps_from_speeds():
    cfg = dl.DiLoCoConfig(num_replicas=4, sync_period=30, island_speed=(1, 1, 0.5, 0.25))
    assert cfg.island_steps == (30, 30, 15, 7) and cfg.heterogeneous
    assert not dl.DiLoCoConfig(num_replicas=2).heterogeneous


CASES = {
    "tokens": dict(island_speed=(1.0, 0.5), island_weighting="tokens"),
    "uniform_slow": dict(island_speed=(1.0, 0.5)),
    "tokens_streaming_deferred": dict(island_speed=(1.0, 0.5), island_weighting="tokens", streaming=True,
                                      num_fragments=2, overlap_steps=1),
    "tokens_fp8": dict(island_speed=(0.75, 0.5), island_weighting="tokens", compression="fp8",
                       error_feedback=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_step_matches_reference(case):
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4, **CASES[case])
    inner, data = optax.adamw(0.02, weight_decay=1e-4), batches(12)
    losses, state = run_jax(cfg, inner, data)
    ref_losses, ref_outer, _ = np_run(
        toy_to_numpy(make_toy(N_LAYERS, WIDTH)), data, k=2, h=4, inner=NpAdamW(0.02), streaming=cfg.streaming,
        p=cfg.num_fragments, v=cfg.overlap_steps, compression=cfg.compression, error_feedback=cfg.error_feedback,
        speeds=cfg.island_steps, weighting=cfg.island_weighting)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for n, got in toy_to_numpy(state.outer).items():
        np.testing.assert_allclose(got, ref_outer[n], rtol=2e-5, atol=2e-5)


def test_an_island_of_speed_zero_is_left_out():
    """Token-weighted with island 1 at speed 0: island 0 trains exactly as K = 1 DiLoCo on its
    own rows (the idle island neither moves nor enters the mean)."""
    inner, data = optax.adamw(0.02, weight_decay=1e-4), batches(8)
    two = dl.DiLoCoConfig(num_replicas=2, sync_period=4, island_speed=(1.0, 0.0), island_weighting="tokens")
    one = dl.DiLoCoConfig(num_replicas=1, sync_period=4)
    got = {}
    for name, cfg, rows in (("two", two, slice(None)), ("one", one, slice(0, len(data[0]) // 2))):
        algo = dl.DiLoCo(cfg, toy_loss, inner)
        state = algo.init(make_toy(N_LAYERS, WIDTH))
        for x in data:
            state, m = algo.step(state, x[rows])
        got[name] = (toy_to_numpy(state.outer), m)
    for n in got["one"][0]:  # two programs: XLA may fuse and round them differently (a few ulps;
        # an idle island in the mean would move the outer model by its whole pseudo-gradient)
        np.testing.assert_allclose(got["two"][0][n], got["one"][0][n], rtol=1e-6, atol=0)
    assert got["two"][1]["islands_contributed"] == 1


def test_speed_knob_errors_are_named():
    with pytest.raises(ValueError, match=r"island_speed needs one value per island \(K=2\); got 3"):
        dl.DiLoCoConfig(num_replicas=2, island_speed=(1, 1, 1))
    with pytest.raises(ValueError, match=r"island_speed must be a number in \[0, 1\]; got 1.5"):
        dl.DiLoCoConfig(num_replicas=2, island_speed=1.5)
    with pytest.raises(ValueError, match=r"at least one island must take an inner step"):
        dl.DiLoCoConfig(num_replicas=2, sync_period=4, island_speed=(0.1, 0.2))
    with pytest.raises(ValueError, match=r"island_weighting must be one of \('uniform', 'tokens'\)"):
        dl.DiLoCoConfig(island_weighting="flops")
