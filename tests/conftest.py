"""Test settings, set before jax is imported: 8 simulated CPU devices, XLA's quick compile
mode, a compilation cache shared by every test process, implicit rank promotion raises.

The tests are dominated by compiling small programs, not by running them, so they ask XLA's
CPU backend for no LLVM optimization (`--xla_backend_optimization_level=0`), which compiles
several times faster; XLA's HLO passes (what the HLO tests read) run as usual. On jaxlib 0.10
they also use XLA:CPU's older kernel emitter, which compiles faster still. On x86-64 they
also cap its instruction set at AVX2: with AVX-512, XLA:CPU rounds float16 arithmetic
differently (p − 0.05·g on float16 arrays differs in some values from rounding each
operation, as NumPy and the reference do; under AVX2 in none), so the float16 cases would
agree with the reference only on some machines. Subprocesses started by tests inherit these
settings (`tests.helpers.subprocess_env`).
"""

import importlib.metadata
import os
import platform
from pathlib import Path


def _jaxlib_before(*version: int) -> bool:
    release = importlib.metadata.version("jaxlib").split(".")
    return tuple(int(p) for p in release[:len(version)] if p.isdigit()) < version


QUICK_COMPILE = " ".join(flag for flag in [
    "--xla_backend_optimization_level=0",
    # jaxlib 0.10's MLIR fusion emitters compile a toy step several times slower than its
    # older emitter; jaxlib 0.11 has no such flag
    "--xla_cpu_use_fusion_emitters=false" if _jaxlib_before(0, 11) else "",
    "--xla_cpu_max_isa=AVX2" if platform.machine() in ("x86_64", "AMD64") else "",
] if flag)
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", QUICK_COMPILE]
).strip()
# identical programs compiled by different tests or processes are compiled once
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # eager ops too: every worker and subprocess compiles the same ones
# tokenized corpora the tests make go beside it, not into ~/.cache/diloco_eqx
os.environ.setdefault("DILOCO_EQX_CACHE", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "diloco_eqx"))

import jax  # noqa: E402
import pytest  # noqa: E402

# (strict dtype promotion is off: optax.adamw promotes float ** int32 internally)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)


def pytest_addoption(parser):
    parser.addoption(
        "--backend", default="shard_map", choices=("shard_map", "drjax"),
        help="the island backend DiLoCo uses where a test names none: `pytest "
             "--backend drjax` runs the whole suite (the reference grid included) on drjax")


def pytest_configure(config):
    from diloco_eqx.diloco import DiLoCo

    DiLoCo.__init__.__kwdefaults__["backend"] = config.getoption("--backend")
