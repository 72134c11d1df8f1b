"""Test settings: 4 simulated CPU devices, strict promotion, and shared helpers."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# (strict dtype promotion is off: optax.adamw promotes float ** int32 internally)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)


def tree_allclose(a, b, rtol=1e-5, atol=1e-6) -> bool:
    """Same structure and every array leaf close (non-arrays equal)."""
    la, ta = jax.tree.flatten(eqx.filter(a, eqx.is_array))
    lb, tb = jax.tree.flatten(eqx.filter(b, eqx.is_array))
    if ta != tb:
        return False
    return all(np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol) for x, y in zip(la, lb))
