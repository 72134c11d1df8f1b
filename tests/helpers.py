"""Small test helpers."""

import contextlib
import dataclasses

import jax.monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass
class Counter:
    count: int = 0


@contextlib.contextmanager
def count_compilations():
    """Count XLA backend compilations (of anything) inside the block."""
    counter = Counter()

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            counter.count += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
