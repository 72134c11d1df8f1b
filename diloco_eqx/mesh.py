"""The mesh: where islands live, and the island operations the step uses.

The mesh has a `diloco` axis of size D and, inside each island, optional `data` and `fsdp`
axes (`make_mesh(diloco=D, data=n, fsdp=m)`); `diloco` is outermost, so each island is a
contiguous block of devices (on several hosts: islands across hosts, the inner axes within
one). Each device slice of the diloco axis holds K/D islands and maps over them
(`map_islands`). The step is manual over `diloco` only (`shard_islands`): what crosses
islands goes through `sum_over_islands` (a local sum over a slice's islands, then
`lax.psum` over the axis) or `gather_islands` (an all-gather of packed payloads), while
inside an island the `data` and `fsdp` axes are left to GSPMD. An island's leaves are laid
out by `leaf_spec` (each leaf's largest axis divisible by the fsdp size is split over `fsdp`);
the outer model and its optimizer state, one copy per island, by `outer_leaf_spec` (split
over all of an island's data × fsdp devices), so each island sends each fragment across
islands once, in n·m pieces, not once per data replica. A `param_specs` hook replaces both.
With `mesh=None` every island lives on one device and no collective exists.
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
    over all its devices): its largest axis that data·fsdp divides split over ("data",
    "fsdp"); else as `leaf_spec`."""
    shape = tuple(np.shape(leaf))
    n = data * fsdp
    axes = [i for i, k in enumerate(shape) if n > 1 and k % n == 0]
    if data == 1 or not axes:
        return leaf_spec(leaf, fsdp)
    best = max(axes, key=lambda i: (shape[i], -i))
    return P(*[(DATA, FSDP) if i == best else None for i in range(best + 1)])


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
            return NamedSharding(mesh, _canonical(param_specs(x), mesh))
        inner = param_specs(jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype))
        return NamedSharding(mesh, _canonical(P(AXIS, *inner), mesh))

    return jax.tree.map(one, tree)


def _canonical(spec: P, mesh: Mesh) -> P:
    """`spec` without axes of size 1 (splitting over them is no split; XLA drops them too,
    and an unchanged spec keeps a step's outputs laid out exactly like its inputs)."""
    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        names = tuple(n for n in names if n is not None and mesh.shape[n] > 1)
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


def shard_islands(
    fn: Callable, mesh: Mesh | None, in_specs: PyTree, out_specs: PyTree
) -> Callable:
    """Run `fn` once per device slice of the diloco axis (or as-is without a mesh): manual
    over "diloco" only, so the island axes inside are left to GSPMD. With one slice, `fn`
    runs as-is (all islands on it) and GSPMD lays out the rest."""
    if not _crosses(mesh):
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={AXIS})


def map_islands(fn: Callable, *trees: PyTree) -> PyTree:
    """`fn` on each of this device's islands (the leading axis of every array leaf of
    arrays-only trees)."""
    return jax.vmap(fn)(*trees)


def mean_over_islands(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Mean over the leading island axis of every leaf, across all K islands."""

    def mean(x):
        local = jnp.mean(x, axis=0)
        return lax.pmean(local, AXIS) if _crosses(mesh) else local

    return jax.tree.map(mean, tree)


def sum_over_islands(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Sum over the leading island axis of every leaf, across all K islands."""

    def total(x):
        local = jnp.sum(x, axis=0)
        return lax.psum(local, AXIS) if _crosses(mesh) else local

    return jax.tree.map(total, tree)


def _crosses(mesh: Mesh | None) -> bool:
    """Whether islands sit on more than one device slice. With one slice every cross-island
    operation is local and the step is not manual over "diloco" at all (XLA's partitioner
    rejects a collective over a size-1 manual axis whose operand other axes split)."""
    return mesh is not None and mesh.shape[AXIS] > 1


def island_ids(num_replicas: int, mesh: Mesh | None) -> jax.Array:
    """Global indices (0..K-1) of the islands on this device slice, in local order."""
    per_slice = num_replicas // axis_size(mesh)
    first = lax.axis_index(AXIS) * per_slice if _crosses(mesh) else 0
    return first + jnp.arange(per_slice, dtype=jnp.int32)


def gather_islands(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Every island's leaves on every device: (K/D, ...) per slice -> (K, ...), in island
    order. An all-gather moves the leaves as they are, so compressed payloads stay compressed."""
    if not _crosses(mesh):
        return tree
    return jax.tree.map(lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True, to="invarying"), tree)


def island_local(tree: PyTree, mesh: Mesh | None) -> PyTree:
    """Replicated values (the outer model) as per-island ones, for writing into islands:
    shard_map's type check requires both branches of a `lax.cond` to agree."""
    if not _crosses(mesh):
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


def place_sharded(tree: PyTree, shardings_tree: PyTree) -> PyTree:
    """`tree`'s array leaves put on their shardings (None: left where they are)."""
    if shardings_tree is None:
        return tree
    return jax.tree.map(jax.device_put, tree, shardings_tree)


def pin(tree: PyTree, layout: PyTree) -> PyTree:
    """`tree` constrained to `layout` (NamedShardings of the global arrays, None: no mesh),
    from inside the step's body, so GSPMD never picks another layout for a value that
    crosses a `lax.cond` (it would reshard it on every step). Inside the shard_map over
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
