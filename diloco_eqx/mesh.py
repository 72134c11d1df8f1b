"""The mesh: where islands live and how every leaf is laid out on it.

The mesh has a `diloco` axis of size D and, inside each island, optional `data` and `fsdp`
axes (`make_mesh(diloco=D, data=n, fsdp=m)`); `diloco` is outermost, so each island is a
contiguous block of devices (on several hosts: islands across hosts, the inner axes within
one). Each device slice of the diloco axis holds K/D islands. How the step reaches across
islands is `islands.py`'s business; inside an island the `data` and `fsdp` axes are left to
GSPMD, held to the layouts below by `pin`. An island's leaves are laid out by `leaf_spec`
(each leaf's largest axis divisible by the fsdp size is split over `fsdp`); the outer model
and its optimizer state, one copy per island, by `outer_leaf_spec` (further split over the
island's data devices), so each island sends each fragment across islands once, in
n·m pieces, not once per data replica. A `param_specs` hook replaces both.
With `mesh=None` every island lives on one device and no collective exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "diloco"
DATA = "data"
FSDP = "fsdp"
ISLANDS = P(AXIS)
"""Partition spec (over the manual diloco axis) of a leaf with a leading island axis."""
REPLICATED = P()

PyTree = Any
ParamSpecs = Callable[[Any], P]
"""A `param_specs` hook: an array leaf without its island axis -> its PartitionSpec inside an
island (over "data"/"fsdp"), for the islands' leaves and the outer ones alike; by default
`leaf_spec` for the islands and `outer_leaf_spec` for the outer model and state."""


def make_mesh(num_devices: int | None = None, devices: Sequence[jax.Device] | None = None, *,
              diloco: int | None = None, data: int = 1, fsdp: int = 1) -> Mesh:
    """`make_mesh(D)`: a 1-D "diloco" axis over the first D devices (default: all).
    `make_mesh(diloco=D, data=n, fsdp=m)`: a ("diloco", "data", "fsdp") mesh of D islands of
    n·m devices each, islands outermost (D defaults to what the devices allow)."""
    devices = list(jax.devices() if devices is None else devices)
    if diloco is None and data == 1 and fsdp == 1:
        d = len(devices) if num_devices is None else num_devices
        return Mesh(np.array(_first(devices, d, "num_devices")), (AXIS,))
    for name, size in (("data", data), ("fsdp", fsdp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh: {name} must be an integer >= 1; got {size!r}")
    per = data * fsdp
    d = diloco if diloco is not None else (num_devices or len(devices)) // per
    picked = _first(devices, d * per, f"diloco × data × fsdp = {d} × {data} × {fsdp}")
    return Mesh(np.array(picked).reshape(d, data, fsdp), (AXIS, DATA, FSDP))


def _first(devices: list, n: int, what: str) -> list:
    if not isinstance(n, int) or not 1 <= n <= len(devices):
        raise ValueError(
            f"{what} must be in 1..{len(devices)} (devices visible to JAX); got {n}. On CPU, "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts to "
            "simulate N devices"
        )
    return devices[:n]


def axis_size(mesh: Mesh | None, name: str = AXIS) -> int:
    """Devices along one mesh axis (D for "diloco"; 1 without a mesh or without the axis)."""
    if mesh is None:
        return 1
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must have an axis named {AXIS!r}; got axes {mesh.axis_names}")
    return mesh.shape.get(name, 1)


def island_size(mesh: Mesh | None) -> int:
    """Devices per island (data × fsdp)."""
    return axis_size(mesh, DATA) * axis_size(mesh, FSDP)


def leaf_spec(leaf, fsdp: int) -> P:
    """The default layout of a leaf inside an island: its largest axis whose size fsdp
    divides is split over "fsdp" (ties: the earliest); replicated if none is or fsdp = 1."""
    shape = tuple(np.shape(leaf))
    axes = [i for i, n in enumerate(shape) if fsdp > 1 and n % fsdp == 0]
    if not axes:
        return P()
    best = max(axes, key=lambda i: (shape[i], -i))
    return P(*[FSDP if i == best else None for i in range(best + 1)])


def default_param_specs(mesh: Mesh | None) -> ParamSpecs:
    fsdp = axis_size(mesh, FSDP)
    return lambda leaf: leaf_spec(leaf, fsdp)


def outer_leaf_spec(leaf, data: int, fsdp: int) -> P:
    """The default layout of an outer leaf (one copy per island, so each island may split it
    over all its devices): the island layout (`leaf_spec`) split further over "data" — the
    fsdp-split axis over ("fsdp", "data") where its size allows, or with fsdp = 1 the largest
    axis that data divides. Fsdp-major, so each device's outer piece lies inside its own
    island shard: moving between the two layouts is a local slice or an all-gather over
    "data", never a permutation."""
    shape = tuple(np.shape(leaf))
    island = leaf_spec(leaf, fsdp)
    if data == 1:
        return island
    if fsdp > 1:
        if not island or shape[len(island) - 1] % (fsdp * data):
            return island
        return P(*island[:-1], (FSDP, DATA))
    axes = [i for i, k in enumerate(shape) if k % data == 0]
    if not axes:
        return island
    best = max(axes, key=lambda i: (shape[i], -i))
    return P(*[DATA if i == best else None for i in range(best + 1)])


def default_outer_specs(mesh: Mesh | None) -> ParamSpecs:
    data, fsdp = axis_size(mesh, DATA), axis_size(mesh, FSDP)
    return lambda leaf: outer_leaf_spec(leaf, data, fsdp)


def shardings(tree: PyTree, mesh: Mesh | None, on_islands: bool, param_specs: ParamSpecs) -> PyTree:
    """NamedShardings of a tree's array leaves: `param_specs` of each leaf (without its
    leading island axis when `on_islands`), behind "diloco" for island leaves."""
    if mesh is None or tree is None:
        return None

    def one(x):
        if not on_islands:
            return NamedSharding(mesh, canonical(param_specs(x), mesh))
        inner = param_specs(jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype))
        return NamedSharding(mesh, canonical(P(AXIS, *inner), mesh))

    return jax.tree.map(one, tree)


def canonical(spec: P, mesh: Mesh) -> P:
    """`spec` without axes of size 1 or absent from `mesh` (splitting over them is no split;
    XLA drops them too, and an unchanged spec keeps a step's outputs laid out exactly like its
    inputs)."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        names = tuple(n for n in names if n is not None and mesh.shape.get(n, 1) > 1)
        return None if not names else names[0] if len(names) == 1 else names

    entries = [keep(e) for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Island-major batches (K, B_island, ...): islands over "diloco", rows over "data"."""
    return NamedSharding(mesh, P(AXIS, DATA) if DATA in mesh.axis_names else ISLANDS)


def check_batch(batch: PyTree, num_replicas: int) -> int:
    """GBS of a batch; ValueError unless every leaf has the same GBS, divisible by K."""
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every batch leaf needs the same leading global-batch axis; got sizes {sizes}"
        )
    gbs = sizes.pop()
    if gbs % num_replicas:
        raise ValueError(
            f"global batch size (GBS)={gbs} must be divisible by num_replicas (K)="
            f"{num_replicas}: each island takes GBS/K rows"
        )
    return gbs


def place_island_batches(batch: PyTree, num_replicas: int, mesh: Mesh | None) -> PyTree:
    """A flat (GBS, ...) batch as island-major (K, GBS/K, ...) arrays on the mesh: island k
    takes rows [k·GBS/K, (k+1)·GBS/K), spread over its "data" devices. The reshape happens
    on the host, before placement: reshaping a sharded batch inside the step would let the
    state's layout drift (and the step compile twice). ValueError unless K divides GBS."""
    check_batch(batch, num_replicas)
    batches = jax.tree.map(lambda x: np.asarray(x).reshape(num_replicas, -1, *np.shape(x)[1:]), batch)
    return batches if mesh is None else jax.device_put(batches, batch_sharding(mesh))


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


def place_sharded(tree: PyTree, shardings_tree: PyTree) -> PyTree:
    """`tree`'s array leaves put on their shardings (None: left where they are)."""
    if shardings_tree is None:
        return tree
    return jax.tree.map(jax.device_put, tree, shardings_tree)


def pin(tree: PyTree, layout: PyTree) -> PyTree:
    """`tree` constrained to `layout` (NamedShardings of the global arrays, None: no mesh),
    from inside the step's body, so GSPMD never picks another layout for a value that
    crosses a schedule event's loop (it would reshard it on every step). Inside the shard_map over
    "diloco" a leaf is one slice's share, so its "diloco" entry is dropped."""
    if layout is None:
        return tree
    inside = jax.sharding.get_abstract_mesh()
    if inside.empty or AXIS not in inside.manual_axes:
        return jax.tree.map(lax.with_sharding_constraint, tree, layout)

    def local(x, sharding):
        spec = P(*[None if e == AXIS else e for e in sharding.spec])
        return lax.with_sharding_constraint(x, NamedSharding(inside, spec))

    return jax.tree.map(local, tree, layout)


def place(tree: PyTree, mesh: Mesh | None, spec: P) -> PyTree:
    """Lay the array leaves of `tree` out on `mesh` with partition spec `spec`."""
    if mesh is None or spec is None:
        return tree
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if eqx.is_array(x) else x, tree)
