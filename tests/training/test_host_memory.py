"""host_memory: with freed memory kept, a call reuses the pages of the calls before and
faults none in; as glibc does by default, each call faults its whole temporaries block in
again, one fault per page. Each setting runs in a process of its own, set before JAX starts."""

import json
import subprocess
import sys

import numpy as np
import pytest

from diloco_eqx.training import host_memory
from tests.helpers import subprocess_env

SCRIPT = r"""
import json, resource, sys, time
from diloco_eqx.training import host_memory
if sys.argv[1] == "keep":
    assert host_memory.keep_freed_memory()  # before JAX starts, as a training run does
import jax, jax.numpy as jnp

# the running sum (8M float32 values, 32 MiB) is a temporary the product reads backwards
f = jax.jit(lambda a: jnp.sum(jnp.cumsum(a) * a[::-1]))
a = jnp.ones((1 << 23,), jnp.float32)
temp = f.lower(a).compile().memory_analysis().temp_size_in_bytes
faults = []
for i in range(14):  # the first calls grow the heap to what a call needs
    time.sleep(0.1)  # the last call's block is freed on XLA's thread after its result is ready
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(a))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(json.dumps({"temp": temp, "page": resource.getpagesize(), "faults": faults[4:]}))
"""


def faults_per_call(setting: str) -> tuple[float, float, list[int]]:
    """(median page faults of a call, pages of the temporaries block, each call's faults) in a
    fresh process. Each call starts after a pause: started at once, it can allocate its block
    before XLA has freed the last one's, and the heap grows by a block (more often when other
    processes share the cores)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting], env=host_memory.without_malloc_settings(subprocess_env()),
                         check=True,
                         capture_output=True, text=True, timeout=300)
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["temp"] >= 4 << 23  # the running sum is a temporary
    return float(np.median(r["faults"])), r["temp"] / r["page"], r["faults"]


@pytest.mark.skipif(not host_memory.available(), reason="sets glibc's malloc only")
@pytest.mark.skipif(host_memory.transparent_huge_pages() == "always",
                    reason="transparent huge pages: a fresh mapping faults in 2 MiB at a time, not per page")
def test_kept_memory_is_reused_where_glibc_faults_every_call_in():
    released, pages, each = faults_per_call("default")
    assert released >= 0.95 * pages, each  # every page of the block, fresh again
    kept, _, each = faults_per_call("keep")
    assert kept <= 0.01 * pages, each


def test_off_glibc_nothing_is_set(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert not host_memory.available()
    assert host_memory.keep_freed_memory() is False


@pytest.mark.parametrize("keep", [True, False])
def test_a_run_keeps_host_memory_unless_told_not_to(keep, monkeypatch, tmp_path):
    """`run` sets malloc when `keep_host_memory` holds and JAX's CPU backend has not started
    (the check that follows then stops the run: its directory is taken)."""
    from diloco_eqx.training import runner
    from diloco_eqx.training.config import RunConfig

    calls = []
    monkeypatch.setattr(host_memory, "before_cpu_backend", lambda: True)
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append("kept") or True)
    (tmp_path / "run.json").write_text("{}")
    with pytest.raises(ValueError, match="--resume"):
        runner.run(RunConfig(out=str(tmp_path), keep_host_memory=keep))
    assert calls == (["kept"] if keep else [])


def test_not_before_a_started_backend(monkeypatch):
    import jax

    jax.devices()  # the backend has started
    assert not host_memory.before_cpu_backend()
