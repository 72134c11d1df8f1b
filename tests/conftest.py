"""Test settings: 4 simulated CPU devices (set before jax is imported), implicit rank promotion raises."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# (strict dtype promotion is off: optax.adamw promotes float ** int32 internally)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)

