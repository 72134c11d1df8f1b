"""Fragmentation: which parameters belong to each fragment, and reading/writing one.

Fragment 0 is every floating-point leaf outside the scanned layer stack; fragments 1..P-1
are groups of indices along axis 0 of every leaf of the stack. With one fragment (vanilla
DiLoCo) fragment 0 is the whole model.

`take(tree, f)` returns a tree shaped like `tree` in which leaves outside f are None and
layer leaves are cut down to f's layers; `put(tree, f, part)` writes such a tree back.
Contiguous groups are read with a slice and written with a dynamic-update-slice; any other
group (the interleaved order, a user's irregular order) is read and written one layer at a
time, so a fragment's update is an in-place write of its own layers.

Elementwise work on a fragment (the mean over islands, the outer update, the blend back into
each island) goes block by block of consecutive layers: `update(tree, f, fn, *parts)` writes
fn of each block where it lies, and `take(..., blocks=True)` hands the blocks over as
`Blocks`, which `join` makes one array. Gathering a strided fragment into one array first
costs a copy of it per use, since XLA:CPU does not fuse a concatenation into an op that reads
it at more than one index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.orders import layer_groups

PyTree = Any


def default_layers(model):
    """Where the stacked decoder layers live by default: `model.layers`."""
    return model.layers


class Blocks(eqx.Module):
    """A fragment's layer leaf as its blocks of consecutive layers (`take(blocks=True)`):
    arithmetic on each block reads the stack where it lies, whereas one array of the
    fragment's layers is copied out before any op that reads it more than once (a sum over
    islands, say). `Fragmentation.join` makes it one array."""

    parts: tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class _Layers:
    """How to read and write one group of layer indices along axis 0."""

    indices: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        idx = self.indices
        return idx == tuple(range(idx[0], idx[0] + len(idx)))

    def read(self, x: jax.Array, at=None) -> jax.Array:
        """The group's layers of x; with `at` (a traced zero), read from offsets shifted by it."""
        idx = self.indices
        if at is not None:
            if self.contiguous:
                return lax.dynamic_slice_in_dim(x, idx[0] + at, len(idx), axis=0)
            return jnp.concatenate([lax.dynamic_slice_in_dim(x, i + at, 1, axis=0) for i in idx], axis=0)
        if self.contiguous:
            return lax.slice_in_dim(x, idx[0], idx[0] + len(idx), axis=0)
        # one slice per layer, like the writes: XLA then updates the stack in place where a
        # fragment is read and written in one fusion (a strided read through a reshape, or
        # a gather, makes it copy the whole stack first)
        return jnp.concatenate([lax.slice_in_dim(x, i, i + 1, axis=0) for i in idx], axis=0)

    def blocks(self, x: jax.Array) -> Blocks | jax.Array:
        """The group's layers of x as its blocks of consecutive layers, each a slice (one
        block: the slice itself)."""
        parts = tuple(lax.slice_in_dim(x, first, first + n, axis=0) for first, _, n in self.runs)
        return parts[0] if len(parts) == 1 else Blocks(parts)

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """The group as maximal blocks of consecutive layers: (first layer, its position in
        the group, length) each."""
        runs, idx = [], self.indices
        for j, layer in enumerate(idx):
            if j and layer == idx[j - 1] + 1:
                first, at, n = runs[-1]
                runs[-1] = (first, at, n + 1)
            else:
                runs.append((layer, j, 1))
        return tuple(runs)

    def update(self, x: jax.Array, fn: Callable, *parts: jax.Array | Blocks) -> jax.Array:
        """x with the group's layers replaced by fn(those layers, *parts' matching rows), block
        by block of consecutive layers: each block is read and written in place by one fusion,
        where reading the whole group first would copy it out. A part given as `Blocks`
        gives its blocks as they are."""
        for i, (first, at, n) in enumerate(self.runs):
            rows = [p.parts[i] if isinstance(p, Blocks) else lax.slice_in_dim(p, at, at + n, axis=0)
                    for p in parts]
            new = fn(lax.slice_in_dim(x, first, first + n, axis=0), *rows)
            x = lax.dynamic_update_slice_in_dim(x, new.astype(x.dtype), first, axis=0)
        return x

    def write(self, x: jax.Array, v: jax.Array) -> jax.Array:
        """x with the group's layers replaced by v's rows, one in-place update per block (a
        strided update through a reshape, or a scatter, makes XLA copy the whole stack)."""
        return self.update(x, lambda _, rows: rows, v)


@dataclasses.dataclass(frozen=True)
class Fragmentation:
    """The P fragments of a model's floating-point parameters."""

    num_fragments: int
    groups: tuple[tuple[int, ...], ...]
    """Layer indices of fragments 1..P-1 (entry i-1 is fragment i)."""
    num_layers: int
    layer_mask: PyTree
    """Params-shaped tree of bools: True for leaves of the layer stack."""

    @classmethod
    def from_model(
        cls,
        model: eqx.Module,
        cfg: DiLoCoConfig,
        layers: Callable[[Any], Any] = default_layers,
    ) -> Fragmentation:
        """Fragments of `model` for `cfg`; `layers` points at the stacked layer module.

        Vanilla DiLoCo has one fragment, the whole model, and works on any Equinox model
        (`layers` is not read). Streaming DiLoCo needs a stacked layer module: one Module
        whose every floating-point leaf has the layer index as axis 0.
        """
        params = eqx.filter(model, eqx.is_inexact_array)
        if not cfg.streaming:
            return cls(1, (), 0, jax.tree.map(lambda _: False, params))
        stack = _layer_stack(model, layers)
        marker = object()
        marked = eqx.tree_at(layers, params, replace_fn=lambda sub: jax.tree.map(lambda _: marker, sub))
        mask = jax.tree.map(lambda x: x is marker, marked)
        groups = layer_groups(cfg.fragment_order, _depth(stack), cfg.num_fragments)
        return cls(cfg.num_fragments, groups, _depth(stack), mask)

    def layer_indices(self, f: int) -> tuple[int, ...]:
        """Layer indices of fragment f >= 1."""
        if not 1 <= f < self.num_fragments:
            raise ValueError(
                f"fragment must be in 1..{self.num_fragments - 1} to own layers; got {f}"
            )
        return self.groups[f - 1]

    def _take_leaf(self, f: int, at=None, blocks: bool = False) -> Callable[[Any, bool], Any]:
        def whole(x):  # through `at` too, when given
            return x if at is None or x is None else jnp.where(at == 0, x, jnp.zeros((), x.dtype))

        if self.num_fragments == 1:
            return lambda x, is_layer: whole(x)
        if f == 0:
            return lambda x, is_layer: None if is_layer else whole(x)
        layers = _Layers(self.groups[f - 1])
        if blocks and at is None:
            return lambda x, is_layer: layers.blocks(x) if is_layer else None
        return lambda x, is_layer: layers.read(x, at) if is_layer else None

    def _put_leaf(self, f: int) -> Callable[[Any, Any, bool], Any]:
        layers = _Layers(self.groups[f - 1]) if f else None

        def put(x, p, is_layer):
            if p is None:
                return x
            return layers.write(x, p) if is_layer and self.num_fragments > 1 else p

        return put

    def take(self, tree: PyTree, f: int, at=None, blocks: bool = False) -> PyTree:
        """Fragment f of a params-shaped tree (leaves outside f become None). `at`, a zero
        that XLA cannot tell is zero (`step.when(..., zero=True)` gives one to a loop body),
        makes the read depend on it, so that XLA keeps it, and what is computed from it,
        inside the loop, and copies only the fragment. With `blocks` (and no `at`), a layer
        leaf whose layers are not consecutive comes as `Blocks` (for elementwise work; see
        `join`)."""
        return jax.tree.map(self._take_leaf(f, at, blocks), tree, self.layer_mask, is_leaf=_is_none)

    @staticmethod
    def join(part: PyTree, axis: int = 0) -> PyTree:
        """`part` with each `Blocks` leaf made one array (its blocks joined along `axis`, the
        layer axis: 1 behind an island axis)."""
        def one(x):
            return jnp.concatenate(x.parts, axis=axis) if isinstance(x, Blocks) else x

        return jax.tree.map(one, part, is_leaf=lambda x: isinstance(x, Blocks))

    def put(self, tree: PyTree, f: int, part: PyTree) -> PyTree:
        """`tree` with fragment f replaced by `part` (shaped like `take(tree, f)`)."""
        return jax.tree.map(self._put_leaf(f), tree, part, self.layer_mask, is_leaf=_is_none)

    def update(self, tree: PyTree, f: int, fn: Callable, *parts: PyTree) -> PyTree:
        """`put(tree, f, fn(take(tree, f), *parts))` for an elementwise `fn` of arrays (each
        part shaped like `take(tree, f)`, with or without `blocks`), computed where each layer
        lives: a fragment of layers that are not consecutive is never copied out of the stack
        and back."""
        def one(x, is_layer, *ps):
            if ps[0] is None:
                return x
            if is_layer and self.num_fragments > 1:
                return _Layers(self.groups[f - 1]).update(x, fn, *ps)
            return fn(x, *ps).astype(x.dtype)

        return jax.tree.map(one, tree, self.layer_mask, *parts, is_leaf=_is_none)

    def param_counts(self, params: PyTree) -> list[int]:
        """Number of scalars in each fragment of `params` (no K axis)."""
        return [
            sum(x.size for x in jax.tree.leaves(self.take(params, f)))
            for f in range(self.num_fragments)
        ]


def _is_none(x) -> bool:
    return x is None


HOW_TO_STACK = (
    "build the layers as one stacked Module, e.g. `eqx.filter_vmap(make_layer)"
    "(jax.random.split(key, num_layers))`, and run them with `jax.lax.scan`; if the stack is "
    "not in `model.layers`, pass layers=lambda m: m.<field> to DiLoCo "
    "and Fragmentation.from_model"
)


def _layer_stack(model: eqx.Module, layers: Callable[[Any], Any]) -> list[jax.Array]:
    """The floating-point leaves of the layer stack, checked to be a real stack."""
    try:
        stack = layers(model)
    except Exception as e:  # noqa: BLE001 - re-raised with the knob named
        raise ValueError(
            "streaming=True: `layers` must point at the model's stacked layer module "
            f"(default: model.layers); it failed with {e!r}; {HOW_TO_STACK}"
        ) from e
    if isinstance(stack, (list, tuple)):
        raise ValueError(
            f"streaming=True needs a stacked layer module, but `layers` points at a Python "
            f"{type(stack).__name__} of {len(stack)} layers; {HOW_TO_STACK}"
        )
    leaves = [x for x in jax.tree.leaves(stack) if eqx.is_inexact_array(x)]
    if not leaves:
        raise ValueError(
            "streaming=True needs a stacked layer module with at least one floating-point "
            f"leaf; `layers` points at {type(stack).__name__} with none; {HOW_TO_STACK}"
        )
    sizes = sorted({x.shape[0] if x.ndim else 0 for x in leaves})
    if len(sizes) > 1 or sizes == [0]:
        raise ValueError(
            "every leaf of the layer stack must have the layer index as axis 0, with one "
            f"size for all leaves; found leading sizes {sizes} (0: a scalar leaf). Is it a "
            f"stack? {HOW_TO_STACK}"
        )
    return leaves


def _depth(stack: list[jax.Array]) -> int:
    return stack[0].shape[0]
