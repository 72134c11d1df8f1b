"""The deferred exchange's stash: per island, one buffer that holds any one fragment.

With V >= 1 the sync at step t keeps each island's pseudo-gradient of fragment f(t) and step
t+1 exchanges it, so exactly one fragment is in flight at a time. The stash is therefore
sized to the largest fragment, not to the model: fragment f's leaves are flattened into the
front of one row of `size` values per device (the largest fragment's).

On an island mesh every device keeps only its own pieces. A leaf is laid out like the outer
model (split over the island's "fsdp" and "data" devices), and it is flattened device-major:
each split axis is cut into (devices, rest) and the device parts are moved to the front in
("fsdp", "data") order. Packing and unpacking are then reshapes and transposes of each
device's own block, never communication. A leaf not split over one of those axes keeps its
whole piece on each of that axis's devices.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from diloco_eqx import mesh as mesh_lib
from diloco_eqx.fragments import Blocks, Fragmentation
from diloco_eqx.sync import wide

PyTree = Any
GRID = (mesh_lib.FSDP, mesh_lib.DATA)
"""The mesh axes of a stash row's leading dimensions, in order."""


@dataclasses.dataclass(frozen=True)
class Stash:
    """How fragments are packed into an island's (fsdp, data, size) buffer."""

    mesh: Mesh | None
    specs: mesh_lib.ParamSpecs
    size: int
    dtype: Any

    @classmethod
    def for_fragments(cls, fragments: list[PyTree], mesh: Mesh | None, specs: mesh_lib.ParamSpecs) -> Stash:
        """The stash for fragment trees `fragments` (arrays or shape structs, no island axis)
        laid out by `specs` inside an island: its row fits the largest fragment on any device."""
        leaves = [x for f in fragments for x in jax.tree.leaves(f)]
        dtype = jnp.result_type(*[x.dtype for x in leaves]) if leaves else jnp.float32
        stash = cls(mesh, specs, 0, dtype)
        size = max((sum(stash._piece_size(x) for x in jax.tree.leaves(f)) for f in fragments), default=0)
        return dataclasses.replace(stash, size=max(size, 1))

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(mesh_lib.axis_size(self.mesh, a) if self.mesh is not None else 1 for a in GRID)

    def zeros(self, num_islands: int) -> Float[Array, "k fsdp data size"]:
        return jnp.zeros((num_islands, *self.grid, self.size), self.dtype)

    def pack(self, tree: PyTree, row: Float[Array, "fsdp data size"] | None = None) -> Float[Array, "fsdp data size"]:
        """One island's fragment tree (leaves outside the fragment None) as a stash row: its
        values at the front, then what `row` held past them (never read), or zeros.

        A fragment that fills the row is written as one concatenation: XLA:CPU runs that on
        every core, an in-place update of part of a buffer on one thread. A smaller one is
        written over the front of `row` in place: rebuilding the whole row would first copy
        its tail out of the buffer the result is written into."""
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Blocks))
        pieces = [p.astype(self.dtype) for x in leaves for p in self._pieces(x)]
        used = sum(p.shape[-1] for p in pieces)
        if row is not None and 0 < used < self.size:
            return jax.lax.dynamic_update_slice_in_dim(row, jnp.concatenate(pieces, axis=-1), 0, axis=-1)
        tail = self.zeros(1)[0, ..., used:] if row is None else row[..., used:]
        return jnp.concatenate([*pieces, tail], axis=-1)

    def unpack(self, row: Float[Array, "fsdp data size"], like: PyTree) -> PyTree:
        """The fragment tree shaped (and typed) like `like` from a row `pack` wrote."""
        leaves, treedef = jax.tree.flatten(like)
        out, offset = [], 0
        for x in leaves:
            n = self._piece_size(x)
            out.append(self._from_grid(row[..., offset:offset + n], x).astype(x.dtype))
            offset += n
        return jax.tree.unflatten(treedef, out)

    # ---------------------------------------------------------------- device-major order

    def _pieces(self, x) -> list[Array]:
        """Leaf x as the (fsdp, data, n) pieces its values take in a row, in order. A leaf of
        `Blocks` is packed block by block, each read where it lies, when no device splits its
        layer axis (each device's values are then its blocks' values one after another)."""
        if not isinstance(x, Blocks):
            return [self._to_grid(x)]
        first = x.parts[0]
        joined = jax.ShapeDtypeStruct((sum(len(p) for p in x.parts), *first.shape[1:]), first.dtype)
        axes = self._axes(joined)
        if axes[0]:
            return [self._to_grid(Fragmentation.join(x))]
        return [self._to_grid(p, axes) for p in x.parts]

    def _axes(self, x) -> list[tuple[str, ...]]:
        """The mesh axes (of GRID) that split each dimension of leaf x."""
        if self.mesh is None:
            return [()] * np.ndim(x)
        spec = mesh_lib.canonical(self.specs(jax.ShapeDtypeStruct(np.shape(x), x.dtype)), self.mesh)
        entries = [*spec, *[None] * (np.ndim(x) - len(spec))]
        return [tuple(e) if isinstance(e, tuple) else (() if e is None else (e,)) for e in entries]

    def _piece_size(self, x) -> int:
        """Values of leaf x one device keeps."""
        split = math.prod(mesh_lib.axis_size(self.mesh, a) for names in self._axes(x) for a in names)
        return math.prod(np.shape(x)) // split

    def _split_shape(self, x, axes=None) -> tuple[list[int], list[str | None]]:
        """x's shape with every split dimension cut into (one dim per mesh axis, rest), and
        which mesh axis each resulting dimension is (None: within one device); `axes`: the
        splits, when not x's own (a block of a leaf is split as the leaf)."""
        shape, names = [], []
        for n, axes in zip(np.shape(x), self._axes(x) if axes is None else axes):
            sizes = [mesh_lib.axis_size(self.mesh, a) for a in axes]
            shape += [*sizes, n // math.prod(sizes)]
            names += [*axes, None]
        return shape, names

    def _to_grid(self, x: Array, axes=None) -> Array:
        shape, names = self._split_shape(x, axes)
        y = x.reshape(shape)
        front = [names.index(a) for a in GRID if a in names]
        y = jnp.moveaxis(y, front, list(range(len(front))))
        have = [a for a in GRID if a in names]
        y = y.reshape(*[self.grid[GRID.index(a)] for a in have], -1)
        for i, a in enumerate(GRID):  # an axis the leaf is not split over: a copy per device
            if a not in have:
                y = jnp.broadcast_to(jnp.expand_dims(y, i), (*y.shape[:i], self.grid[i], *y.shape[i:]))
        return y

    def _from_grid(self, piece: Array, like) -> Array:
        shape, names = self._split_shape(like)
        have = [a for a in GRID if a in names]
        index = tuple(slice(None) if a in have else 0 for a in GRID)
        y = piece[index]  # (grid of the leaf's own axes, flat)
        front = [names.index(a) for a in have]
        rest = [s for i, s in enumerate(shape) if i not in front]
        y = y.reshape(*[shape[i] for i in front], *rest)
        y = jnp.moveaxis(y, list(range(len(front))), front)
        return y.reshape(np.shape(like))


def row_spec(leaf) -> P:
    """The layout of a stash buffer inside an island (a `param_specs` hook for it)."""
    return P(*GRID)


def deltas_like(params: PyTree) -> PyTree:
    """Shapes and dtypes of one island's pseudo-gradient of the whole model (what a sync
    computes from outer `params`: at least float32)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), wide(x.dtype)), params)


def for_model(params: PyTree, fragments: Fragmentation, mesh: Mesh | None,
              param_specs: mesh_lib.ParamSpecs | None = None) -> Stash:
    """The stash of a run whose outer (or initial) model has floating-point `params`."""
    like = deltas_like(params)
    parts = [jax.eval_shape(partial(fragments.take, f=f), like) for f in range(fragments.num_fragments)]
    return Stash.for_fragments(parts, mesh, param_specs or mesh_lib.default_outer_specs(mesh))
