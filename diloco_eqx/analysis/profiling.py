"""Measuring compiled steps: compilation counts, memory of the executable, and FLOPs."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.monitoring

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


def flops(compiled: jax.stages.Compiled) -> float:
    """XLA's count of floating-point operations of one call (per device)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0]
    return float(cost.get("flops", 0.0))
