"""How the step reaches across islands: one small interface, two backends.

The step never names a collective. It asks its `Islands` backend to run the step body over
every island (`program`, inside the backend's `context`), to map a function over the
islands the body sees (`map`), to sum over all K islands (`sum`), to hand every island
every island's value (`gather`, for compressed payloads), to make replicated values usable
beside island values (`local`, `broadcast`), and for the global indices of the islands the
body sees (`ids`, `own_rows`).

- `ShardMapIslands` ("shard_map", the default) runs the body once per device slice of the
  diloco axis under `jax.shard_map`, manual over "diloco" only: a slice sees its K/D
  islands, and what crosses islands is exactly the `lax.psum` and `lax.all_gather` below.
- `DrjaxIslands` ("drjax") is MaxText's formulation: the body is a `drjax.program` under
  plain jit with the mesh set by `jax.set_mesh`, sees all K islands as global arrays laid
  out over "diloco", maps with `drjax.map_fn` and sums with `drjax.reduce_sum`; GSPMD
  chooses the collectives. `gather` pins its result replicated, so that compressed
  payloads, not the floats decoded from them, are what crosses islands.

A backend is one final subclass and one `register_backend` call.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from diloco_eqx import mesh as mesh_lib
from diloco_eqx._registry import Registry

PyTree = Any
ACROSS = "across_islands"
"""The named scope of every operation that crosses islands (what `analysis.critical_path`
follows; under plain jit there is no collective primitive to find)."""


def _drjax():
    """drjax, imported when a drjax step is built (the shard_map backend runs without it)."""
    import drjax

    return drjax


def sum_leading(x: Array) -> Array:
    """Sum over the leading axis as a chain of adds: XLA fuses the adds with whatever computes
    x (pseudo-gradients, a mask), where a reduce over the axis would first write x out."""
    total = x[0]
    for k in range(1, x.shape[0]):
        total = total + x[k]
    return total


@dataclasses.dataclass(frozen=True)
class Islands(abc.ABC):
    """The island operations of a step for K = `num_islands` islands on `mesh`."""

    mesh: Mesh | None
    num_islands: int

    local_branches: ClassVar[bool] = True
    """Whether an event (`step.when`) may branch on values of the islands the body sees
    without a collective (with shard_map each device slice decides for its own islands;
    under plain jit a predicate is global, so branching on an island's value gathers it
    from all)."""

    @property
    @abc.abstractmethod
    def local_count(self) -> int:
        """How many islands the body sees (the leading axis of its island leaves)."""

    @abc.abstractmethod
    def program(self, fn: Callable, in_specs: PyTree, out_specs: PyTree) -> Callable:
        """`fn` run over every island; the specs say which arguments and results have a
        leading island axis (`mesh.ISLANDS`) and which are replicated (`mesh.REPLICATED`)."""

    def context(self) -> contextlib.AbstractContextManager:
        """What must be entered around a jitted call of a `program` (tracing included)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def map(self, fn: Callable, *trees: PyTree) -> PyTree:
        """`fn` on each island the body sees (the leading axis of every array leaf)."""

    @abc.abstractmethod
    def sum(self, tree: PyTree) -> PyTree:
        """Sum over all K islands of every leaf; the result is replicated."""

    @abc.abstractmethod
    def gather(self, tree: PyTree, then: Callable | None = None) -> PyTree:
        """Every island's leaves, (K, ...) in island order, wherever the body runs, and
        `then` applied to that whole set there (decoding, say): leaves move as they are, so
        a compressed payload crosses compressed."""

    @abc.abstractmethod
    def ids(self) -> Int[Array, " k"]:
        """Global indices (0..K-1) of the islands the body sees, in its order."""

    @abc.abstractmethod
    def own_rows(self, gathered: PyTree) -> PyTree:
        """The rows of a gathered (K, ...) value that belong to the islands the body sees."""

    def local(self, tree: PyTree) -> PyTree:
        """Replicated values made usable beside island values (in a branch that writes
        them into islands)."""
        return tree

    def broadcast(self, tree: PyTree) -> PyTree:
        """A replicated value copied to each island the body sees: (local_count, ...)."""
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.local_count, *jnp.shape(x))), self.local(tree))

    def mean(self, tree: PyTree) -> PyTree:
        """Mean over all K islands of every leaf."""
        return jax.tree.map(lambda x: x / self.num_islands, self.sum(tree))


@dataclasses.dataclass(frozen=True)
class ShardMapIslands(Islands):
    """Manual over "diloco": each device slice holds K/D islands and maps over them; the
    cross-island collectives are written out. With one slice (or no mesh) the body runs
    as-is and nothing crosses a device boundary."""

    @property
    def local_count(self) -> int:
        return self.num_islands // mesh_lib.axis_size(self.mesh)

    @property
    def crosses(self) -> bool:
        """Whether islands sit on more than one device slice. With one slice the body is not
        manual over "diloco" at all (XLA's partitioner rejects a collective over a size-1
        manual axis whose operand other axes split)."""
        return self.mesh is not None and self.mesh.shape[mesh_lib.AXIS] > 1

    def program(self, fn, in_specs, out_specs):
        if not self.crosses:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names={mesh_lib.AXIS})

    def map(self, fn, *trees):
        return jax.vmap(fn)(*trees)

    def sum(self, tree):
        def total(x):
            local = sum_leading(x)
            if not self.crosses:
                return local
            with jax.named_scope(ACROSS):
                return lax.psum(local, mesh_lib.AXIS)

        return jax.tree.map(total, tree)

    def gather(self, tree, then=None):
        if self.crosses:
            with jax.named_scope(ACROSS):
                tree = jax.tree.map(lambda x: lax.all_gather(x, mesh_lib.AXIS, axis=0, tiled=True, to="invarying"),
                                    tree)
        return tree if then is None else then(tree)

    def ids(self):
        first = lax.axis_index(mesh_lib.AXIS) * self.local_count if self.crosses else 0
        return first + jnp.arange(self.local_count, dtype=jnp.int32)

    def own_rows(self, gathered):
        if not self.crosses:
            return gathered
        first = lax.axis_index(mesh_lib.AXIS) * self.local_count
        return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, first, self.local_count), gathered)

    def local(self, tree):
        # shard_map's type check requires the branches of an event and its loop carry to agree
        # on which values vary over "diloco"
        if not self.crosses:
            return tree
        return jax.tree.map(lambda x: lax.pcast(x, mesh_lib.AXIS, to="varying"), tree)


class _QuietNoMesh(logging.Filter):
    """drjax logs a warning on every trace when no mesh is set (mesh=None, one device),
    where a plain vmap is exactly right."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No mesh" not in record.getMessage()


@dataclasses.dataclass(frozen=True)
class DrjaxIslands(Islands):
    """MaxText's formulation: plain jit over global (K, ...) island arrays laid out over
    "diloco", with drjax's map and reduce; GSPMD inserts the collectives."""

    QUIET: ClassVar[logging.Filter] = _QuietNoMesh()
    local_branches: ClassVar[bool] = False

    @property
    def local_count(self) -> int:
        return self.num_islands

    def program(self, fn, in_specs, out_specs):
        return _drjax().program(placements={mesh_lib.AXIS: self.num_islands})(fn)

    def context(self):
        if self.mesh is None:
            return _filtered(logging.getLogger("absl"), self.QUIET)
        return jax.set_mesh(self.mesh)

    def map(self, fn, *trees):
        return _drjax().map_fn(fn, trees)

    def sum(self, tree):
        with jax.named_scope(ACROSS):
            return _drjax().reduce_sum(tree)

    def gather(self, tree, then=None):
        if self.mesh is None:
            return tree if then is None else then(tree)

        def whole(x):  # every island's rows on every device; the rest as GSPMD likes
            spec = P(None, *[P.UNCONSTRAINED] * (x.ndim - 1))
            return lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        with jax.named_scope(ACROSS):
            tree = jax.tree.map(whole, tree)
        if then is None:
            return tree
        # the result stays whole too: else GSPMD may split `then` over the islands and sum
        # its partial results across them (decoded floats crossing instead of the payload)
        return jax.tree.map(whole, then(tree))

    def ids(self):
        return jnp.arange(self.num_islands, dtype=jnp.int32)

    def own_rows(self, gathered):
        return gathered

    def broadcast(self, tree):
        return _drjax().broadcast(tree)


@contextlib.contextmanager
def _filtered(logger: logging.Logger, quiet: logging.Filter):
    logger.addFilter(quiet)
    try:
        with warnings.catch_warnings():  # drjax also looks for a mesh through jax's deprecated API
            warnings.filterwarnings("ignore", "jax.interpreters.pxla.thread_resources", DeprecationWarning)
            yield
    finally:
        logger.removeFilter(quiet)


BACKENDS: Registry[type[Islands]] = Registry(
    "backend", "a final Islands subclass", lambda c: isinstance(c, type) and issubclass(c, Islands))
BACKENDS.register("shard_map", ShardMapIslands)
BACKENDS.register("drjax", DrjaxIslands)


def register_backend(name: str, backend: type[Islands], *, overwrite: bool = False) -> None:
    """Make `backend` selectable as `DiLoCo(..., backend=name)` / `--backend name`."""
    BACKENDS.register(name, backend, overwrite=overwrite)


registered_backends = BACKENDS.names


def make_islands(backend: str, mesh: Mesh | None, num_islands: int) -> Islands:
    """The backend registered as `backend`, for K islands on `mesh`; ValueError naming the
    knob otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {registered_backends()}; got {backend!r}")
    return BACKENDS[backend](mesh, num_islands)
