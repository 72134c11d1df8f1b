"""How the training steps are compiled: the jit they are built with, and its XLA options.

`StepFunction` jits a step over its arguments' array leaves and returns once the step is
queued (see its docstring). XLA options: by default none, XLA picks. On CPU,
`cpu_scheduler("memory")` builds the steps made inside it with XLA:CPU's memory-optimized
instruction order instead of its default, concurrency-optimized one. The order never
changes a step's numbers, and it lowers every step's absolute memory, but it was slower
where paired step times told them apart (`tools/benchmark.py --cpu-orders` measures both,
side by side). Under the default order a Streaming step's deferred exchange (V >= 1) once
ran between the forward and backward passes and made the step's block of temporaries up to
a stash larger than it holds; on CPU (and wherever there is no mesh) the exchange now waits
for the inner step instead (`step.exchange_waits_by_default`). A whole run takes XLA's own flag:
XLA_FLAGS=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import equinox as eqx
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


class StepFunction:
    """`fn(first, *rest)` compiled with `jax.jit` once per structure of its arguments: array
    leaves are traced, other leaves are static, and with `donate` the arrays of `rest` (the
    state) are donated. A call returns once the step is queued, so the host can fetch the
    next batch and queue the next step while this one runs (on XLA:GPU a step with
    schedule-event loops returns after the last loop predicate it reads on the host).
    Equinox's `filter_jit` instead waits for every call to finish, to raise its runtime
    errors at the call: the host sits idle during each step and its own work lands between
    steps."""

    def __init__(self, fn, *, donate: bool = False, mesh: Mesh | None = None):
        self._fn, self._donate, self._options = fn, donate, step_options(mesh)
        self._built: dict = {}

    def _find(self, args: tuple):
        first, first_def = jax.tree.flatten(args[0])
        rest, rest_def = jax.tree.flatten(args[1:])
        first_statics, rest_statics = _statics(first), _statics(rest)
        key = (first_def, first_statics, _types(first_statics), rest_def, rest_statics, _types(rest_statics))
        if key not in self._built:
            self._built[key] = self._build(first_def, first_statics, rest_def, rest_statics)
        return self._built[key], [x for x in first if eqx.is_array(x)], [x for x in rest if eqx.is_array(x)]

    def _build(self, first_def, first_statics, rest_def, rest_statics):
        """`fn` jitted on flat lists of array leaves; its output's structure travels in the
        output itself, as a static node, so each of jax's traces keeps its own."""
        def flat(first: list, rest: list):
            args = (jax.tree.unflatten(first_def, _fill(first_statics, first)),
                    *jax.tree.unflatten(rest_def, _fill(rest_statics, rest)))
            leaves, treedef = jax.tree.flatten(self._fn(*args))
            return [x for x in leaves if eqx.is_array(x)], _Structure(treedef, _statics(leaves))

        flat.__name__ = flat.__qualname__ = getattr(self._fn, "__name__", None) or getattr(
            getattr(self._fn, "func", None), "__name__", "step")
        return jax.jit(flat, donate_argnums=(1,) if self._donate else (),
                       compiler_options=self._options or None)

    def __call__(self, *args):
        jitted, first, rest = self._find(args)
        with warnings.catch_warnings():  # jax says which donated buffers it could not reuse
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            arrays, structure = jitted(first, rest)
        return jax.tree.unflatten(structure.treedef, _fill(structure.statics, arrays))

    def lower(self, *args) -> jax.stages.Lowered:
        jitted, first, rest = self._find(args)
        return jitted.lower(first, rest)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Structure:
    """A step output's tree structure and non-array leaves: a pytree node without leaves."""

    treedef: Any
    statics: tuple


def _types(statics: tuple) -> tuple:
    """Their types: 2, 2.0 and True are equal keys, not equal programs."""
    return tuple(type(s) for s in statics)


def _statics(leaves: list) -> tuple:
    """The leaves that are not arrays, by position (None marks an array's place)."""
    return tuple(None if eqx.is_array(x) else x for x in leaves)


def _fill(statics: tuple, arrays: list) -> list:
    it = iter(arrays)
    return [next(it) if s is None else s for s in statics]
