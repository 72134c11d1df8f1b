"""The quickstart trains: loss falls well below its start on every island."""

import math

import numpy as np

from experiments import quickstart


def test_streaming_diloco_learns_the_markov_stream():
    history = quickstart.train(steps=150, quiet=True)
    first, last = history[0], history[-10:]
    for i in range(2):
        start = first[f"loss_island_{i}"]
        end = np.mean([m[f"loss_island_{i}"] for m in last])
        assert start > 0.95 * math.log(256)
        assert end < 0.35 * start, (i, start, end)  # ~5.5 -> below ~1.9 nats (optimum ln 2)
    assert sum("sync_fragment" in m for m in history) == 150 // 4
