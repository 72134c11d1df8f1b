"""Measuring compiled steps: compilation counts, memory of the executable, what is live at
its peak, and FLOPs."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import tempfile

import jax
import jax.monitoring
from jax.experimental.compilation_cache import compilation_cache

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class CompileCount:
    count: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def count_compilations():
    """Count XLA backend compilations (of anything) inside the block, and their time."""
    counter = CompileCount()

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            counter.count += 1
            counter.seconds += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Bytes per device of the executable's arguments, outputs, temporaries and aliases
    (outputs written into donated arguments); `resident` = arguments + temporaries."""
    m = compiled.memory_analysis()
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
    }
    out["resident_bytes"] = out["argument_bytes"] + out["temp_bytes"]
    return out


def live_peak(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, int | None]:
    """`lowered` compiled, and the peak of XLA's live-range analysis of it: the largest total
    size of the buffers live at one point of the program's order, arguments included (read
    from the dump XLA writes when asked; None where it writes none).

    It counts every buffer the analysis names, so a donated argument and the output written
    into it count twice: compare it between programs, not with `memory`. Where two programs'
    peaks differ by what one holds more but their allocations differ by more, the rest is
    layout: the executable holds its temporaries in one block, each at one offset for its
    whole life."""
    with tempfile.TemporaryDirectory() as out:
        enabled = jax.config.jax_enable_compilation_cache  # an executable from the cache writes no dump
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX decides whether to use the cache once, at first use
        try:
            compiled = lowered.compile({"xla_dump_to": out, "xla_dump_hlo_as_text": True})
        finally:
            jax.config.update("jax_enable_compilation_cache", enabled)
            compilation_cache.reset_cache()
        ranges = glob.glob(os.path.join(out, "*after_optimizations-live-range.txt"))
        peaks = []
        for path in ranges:
            with open(path) as f:
                _, found, after = f.read().partition("(peak):")
            sizes = re.findall(r"cumulative: (\d+) bytes", after)
            if found and sizes:
                peaks.append(int(sizes[-1]))
    return compiled, max(peaks, default=None)


def flops(compiled: jax.stages.Compiled) -> float:
    """XLA's count of floating-point operations of one call (per device)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0]
    return float(cost.get("flops", 0.0))
