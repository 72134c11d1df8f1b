"""A small transformer learns with Streaming DiLoCo: loss falls far below its start on
every island (K=2, P=3, V=1, α=0.5, a synthetic Markov byte stream with optimum ln 2)."""

import math

import jax
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.training import data
from diloco_eqx.models.transformer import Transformer, TransformerConfig, loss_fn


@pytest.mark.slow  # end to end: 300 steps of a real model
def test_streaming_diloco_learns_the_markov_stream():
    model_cfg = TransformerConfig(num_layers=4, width=64, num_heads=4, seq_len=64)
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=12, streaming=True, num_fragments=3,
                          overlap_steps=1, alpha=0.5)
    inner = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 150), b2=0.95)
    corpus = data.Corpus.markov(num_bytes=600_000, branching=2, seed=0)
    train_ids, _ = corpus.split()
    batches = iter(data.train_batches(corpus, train_ids, seq_len=64, global_batch=16,
                                      num_islands=2, seed=0))
    algo = dl.DiLoCo(cfg, loss_fn, inner)
    state = algo.init(Transformer(model_cfg, jax.random.key(0)))
    history = []
    for _ in range(150):
        state, m = algo.step(state, next(batches))
        history.append(dict(m))
    for i in range(2):
        start = history[0][f"loss_island_{i}"]
        end = np.mean([m[f"loss_island_{i}"] for m in history[-10:]])
        assert start > 0.95 * math.log(256)
        assert end < 0.35 * start, (i, start, end)  # ~5.5 -> below ~1.9 nats (optimum ln 2)
    assert sum("sync_fragment" in m for m in history) == 150 // 4
