"""Host memory: let the C library keep freed memory for reuse, so XLA:CPU stops faulting.

XLA:CPU allocates each call's temporaries block (activations, the sync's mean and every
other intermediate the compiled step does not keep in place) with malloc, and frees it when
the call ends. glibc serves a block that large with a mapping of its own (above its mmap
threshold; on a worker thread's arena, any block above 64 MiB) and unmaps it when freed, so
every page the next call writes is a fresh page: a fault into the kernel, which zeroes 4 KiB
before the store goes on, so a training step faults its whole block of temporaries in again
on every step (`benchmarks/` measures what that costs).

`keep_freed_memory()` has glibc serve every block from the main heap and keep what is freed
there, so each call reuses the pages of the last (once the heap has grown to the step's
needs, over its first few calls). XLA can free a call's block on its own thread after the
result is ready, so a call started at once may allocate before the last one's block is back;
the heap then holds a block more, and a call now and then faults one in. The process holds
its peak host memory until it exits (what a training process does anyway). Elsewhere (macOS, musl) it
changes nothing and says so.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import platform
from pathlib import Path

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
KEEP_UP_TO = 2**31 - 1
"""Bytes of free memory at the heap's top that glibc keeps rather than returns (the largest
value mallopt takes, an int)."""
_kept = False
ACCELERATOR_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm6-plugin", "jax-rocm7-plugin", "libtpu")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return libc


def available() -> bool:
    """Whether this process runs on glibc, the only C library whose malloc this module sets."""
    return _glibc() is not None


def keep_freed_memory() -> bool:
    """Have malloc keep freed memory for the next call; returns whether anything was set
    (False off glibc). Call it before JAX's first computation: XLA's worker threads then
    allocate from the main heap, the only one that grows past 64 MiB without a mapping per
    block. Called later, a thread that has allocated already keeps its own heap, where a block
    above 64 MiB still gets a mapping of its own."""
    libc = _glibc()
    if libc is None:
        return False
    global _kept
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_UP_TO)):
        if libc.mallopt(param, value) != 1:
            raise RuntimeError(f"glibc's mallopt({param}, {value}) failed")
    _kept = True
    return True


def kept() -> bool:
    """Whether `keep_freed_memory` has set this process's malloc."""
    return _kept


def before_cpu_backend() -> bool:
    """Whether JAX has not started its backend yet and will run on the CPU: when keeping
    freed memory pays (on an accelerator the temporaries live on the device, and one arena
    for every thread would be a cost), and before it is too late to matter."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions() if d.metadata["Name"]}
    return not installed & set(ACCELERATOR_PLUGINS)


def without_malloc_settings(env: dict[str, str]) -> dict[str, str]:
    """`env` without the variables that set glibc's malloc (for a child process whose own
    setting is to count)."""
    return {k: v for k, v in env.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode, or None where it has none: with "always", a
    fresh mapping faults in 2 MiB at a time rather than a page at a time."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()
