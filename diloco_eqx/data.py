"""Token sources. For now: a synthetic byte stream with a known entropy rate."""

from __future__ import annotations

import math

import numpy as np
from jaxtyping import Int


class MarkovSource:
    """A random sparse Markov chain over bytes: each byte has `branching` equally likely
    successors, so the entropy rate is exactly ln(branching) nats per token."""

    def __init__(self, vocab_size: int = 256, branching: int = 2, seed: int = 0):
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in 1..vocab_size={vocab_size}; got {branching}")
        rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.successors = np.stack(
            [rng.choice(vocab_size, branching, replace=False) for _ in range(vocab_size)]
        )
        self.rng = np.random.default_rng(seed + 1)

    @property
    def entropy_rate(self) -> float:
        """Nats per token of the chain: the lowest loss any model can reach."""
        return math.log(self.successors.shape[1])

    def batch(self, rows: int, length: int) -> Int[np.ndarray, "rows length"]:
        """`rows` independent sequences of `length` tokens, each from a uniform start."""
        out = np.empty((rows, length), np.int32)
        out[:, 0] = self.rng.integers(0, self.vocab_size, rows)
        choice = self.rng.integers(0, self.successors.shape[1], (rows, length))
        for t in range(1, length):
            out[:, t] = self.successors[out[:, t - 1], choice[:, t]]
        return out
