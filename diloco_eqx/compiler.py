"""The XLA options the compiled training steps are built with.

By default none: XLA picks. On CPU, `cpu_scheduler("memory")` builds the steps made inside
it with XLA:CPU's memory-optimized instruction order instead of its default, concurrency-
optimized one. The order never changes a step's numbers, and it lowers every step's
absolute memory, but it was slower where paired step times told them apart (`tools/benchmark.py --cpu-orders`
measures both, side by side). Under the default order a Streaming step's deferred exchange
(V >= 1) once ran between the forward and backward passes and made the step's block of
temporaries up to a stash larger than it holds; on CPU the exchange now waits for the inner
step instead (`step.exchange_waits_by_default`). A whole run takes XLA's own flag:
XLA_FLAGS=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from jax.sharding import Mesh

CPU_SCHEDULERS = {"memory": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                  "concurrency": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}
"""XLA:CPU's instruction orders by name ("concurrency" is XLA's default)."""

_cpu_scheduler: contextvars.ContextVar[str | None] = contextvars.ContextVar("cpu_scheduler", default=None)


@contextlib.contextmanager
def cpu_scheduler(name: str) -> Iterator[None]:
    """Steps built inside are compiled, on CPU, with XLA:CPU's `name` instruction order."""
    if name not in CPU_SCHEDULERS:
        raise ValueError(f"cpu_scheduler: name must be one of {sorted(CPU_SCHEDULERS)}; got {name!r}")
    token = _cpu_scheduler.set(name)
    try:
        yield
    finally:
        _cpu_scheduler.reset(token)


def platform(mesh: Mesh | None) -> str:
    """The platform ("cpu", "gpu", "tpu") a step placed on `mesh` runs on (None: the default
    device's)."""
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def step_options(mesh: Mesh | None) -> dict[str, str]:
    """Compiler options for a step placed on `mesh` (None: the default device)."""
    name = _cpu_scheduler.get()
    if name is None or platform(mesh) != "cpu":
        return {}
    return {"xla_cpu_scheduler_type": CPU_SCHEDULERS[name]}
