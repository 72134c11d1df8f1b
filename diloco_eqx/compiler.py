"""How the training steps are compiled: `StepFunction`, the jit they are built with."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import equinox as eqx
import jax


class StepFunction:
    """`fn(first, *rest)` compiled with `jax.jit` once per structure of its arguments: array
    leaves are traced, other leaves are static, and with `donate` the arrays of `rest` (the
    state) are donated. A call returns once the step is queued, so the host can fetch the
    next batch and queue the next step while this one runs (on XLA:GPU a step with
    schedule-event loops returns after the last loop predicate it reads on the host).
    Equinox's `filter_jit` instead waits for every call to finish, to raise its runtime
    errors at the call: the host sits idle during each step and its own work lands between
    steps."""

    def __init__(self, fn, *, donate: bool = False):
        self._fn, self._donate = fn, donate
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
        return jax.jit(flat, donate_argnums=(1,) if self._donate else ())

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
