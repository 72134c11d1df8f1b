"""The `diloco` mesh axis: where islands live, and the island operations the step uses.

K islands are laid out along a 1-D mesh axis named "diloco" of size D; each device slice
holds K/D islands and maps over them (`map_islands`). What crosses islands goes through
`sum_over_islands` (a local sum over a slice's islands, then `lax.psum` over the axis) or
`gather_islands` (an all-gather of packed payloads, decoded and averaged in float32 on every
slice). With `mesh=None` every island lives on one device and no collective exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "diloco"
ISLANDS = P(AXIS)
"""Partition spec of a leaf with a leading island axis."""
REPLICATED = P()

PyTree = Any


def make_mesh(num_devices: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named "diloco" over the first `num_devices` devices (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    if num_devices is not None:
        if not 1 <= num_devices <= len(devices):
            raise ValueError(
                f"num_devices must be in 1..{len(devices)} (devices visible to JAX); got "
                f"{num_devices}. On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                "before importing jax to simulate N devices"
            )
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (AXIS,))


def axis_size(mesh: Mesh | None) -> int:
    """D: device slices along the diloco axis (1 without a mesh)."""
    if mesh is None:
        return 1
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must have an axis named {AXIS!r}; got axes {mesh.axis_names}")
    return mesh.shape[AXIS]


def check_divides(num_replicas: int, mesh: Mesh | None) -> int:
    """K/D, the islands per device slice; ValueError unless D divides K."""
    d = axis_size(mesh)
    if num_replicas % d:
        raise ValueError(
            f"num_replicas (K)={num_replicas} must be divisible by the diloco mesh axis size "
            f"{d}; use a mesh whose diloco axis size divides K (one of "
            f"{[n for n in range(1, num_replicas + 1) if num_replicas % n == 0]})"
        )
    return num_replicas // d


def shard_islands(
    fn: Callable, mesh: Mesh | None, in_specs: PyTree, out_specs: PyTree
) -> Callable:
    """Run `fn` once per device slice of the diloco axis (or as-is without a mesh)."""
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def map_islands(fn: Callable, *trees: PyTree) -> PyTree:
    """`fn` on each of this device's islands (the leading axis of every array leaf of
    arrays-only trees)."""
    return jax.vmap(fn)(*trees)


def mean_over_islands(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Mean over the leading island axis of every leaf, across all K islands."""

    def mean(x):
        local = jnp.mean(x, axis=0)
        return local if mesh is None else lax.pmean(local, AXIS)

    return jax.tree.map(mean, tree)


def sum_over_islands(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Sum over the leading island axis of every leaf, across all K islands."""

    def total(x):
        local = jnp.sum(x, axis=0)
        return local if mesh is None else lax.psum(local, AXIS)

    return jax.tree.map(total, tree)


def island_ids(num_replicas: int, mesh: Mesh | None) -> jax.Array:
    """Global indices (0..K-1) of the islands on this device slice, in local order."""
    per_slice = num_replicas // axis_size(mesh)
    first = 0 if mesh is None else lax.axis_index(AXIS) * per_slice
    return first + jnp.arange(per_slice, dtype=jnp.int32)


def gather_islands(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Every island's leaves on every device: (K/D, ...) per slice -> (K, ...), in island
    order. An all-gather moves the leaves as they are, so compressed payloads stay compressed."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True, to="invarying"), tree)


def island_local(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Replicated values (the outer model) as per-island ones, for writing into islands:
    shard_map's type check requires both branches of a `lax.cond` to agree."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: lax.pcast(x, AXIS, to="varying"), tree)


def to_host(tree: PyTree) -> PyTree:
    """NumPy copies of a tree of arrays, also when they span several processes: a replicated
    array is read from a local shard, a sharded one is all-gathered (every process must call
    this at the same point)."""
    from jax.experimental import multihost_utils

    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)


def place(tree: PyTree, mesh: Mesh | None, spec: P) -> PyTree:
    """Lay the array leaves of `tree` out on `mesh` with partition spec `spec`."""
    if mesh is None or spec is None:
        return tree
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if eqx.is_array(x) else x, tree)
