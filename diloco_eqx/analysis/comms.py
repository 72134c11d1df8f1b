"""What crosses the diloco axis: cross-device collectives read from compiled HLO.

`collectives(hlo_text)` lists every collective of a compiled program with its bytes and
the computation it sits in; `unconditional_computations(hlo_text)` is the set of
computations that run on every call (reachable from ENTRY without entering a
`conditional` branch or the body of a schedule event's loop). A collective outside that
set only runs when its branch is taken.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from diloco_eqx.schedule import EVENT_SCOPE, RECHECK_SCOPE

COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

CONTROL_DTYPES = ("s32", "pred")
"""dtypes the step uses only for control values (island counts and masks), never payloads."""

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_CALLEE = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]<=")
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_FRAGMENT = re.compile(r"/fragment_(\d+)/")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One cross-device collective instruction of a compiled program."""

    kind: str
    name: str
    computation: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """(dtype, dims) of each array the collective produces."""
    op_name: str
    """JAX's name stack for the op (named scopes such as "diloco_sync" show up here)."""
    group_size: int = 1
    """Participants in each replica group (the diloco axis size D for the step's collectives)."""
    groups: tuple[tuple[int, ...], ...] | None = None
    """Its replica groups as device ids, in whichever notation XLA printed them (for a
    collective-permute: its (source, target) pairs)."""

    def axes(self, mesh) -> frozenset[str]:
        """The mesh axes along which the devices of one of its groups differ (e.g.
        {"diloco"}: it crosses islands; {"data"}: it stays inside an island)."""
        if not self.groups:  # no groups printed: one group of every device
            return frozenset(name for name in mesh.axis_names if mesh.shape[name] > 1)
        # SPMD programs number devices by their position in the mesh, row-major
        found = set()
        for group in self.groups:
            coords = [np.unravel_index(i, mesh.devices.shape) for i in group]
            found |= {name for a, name in enumerate(mesh.axis_names) if len({c[a] for c in coords}) > 1}
        return frozenset(found)

    @property
    def fragment(self) -> int | None:
        """The fragment whose sync issued it (the step's "fragment_f" scope), else None."""
        m = _FRAGMENT.search(self.op_name + "/")
        return int(m.group(1)) if m else None

    @property
    def rechecked(self) -> bool:
        """Whether it belongs to a sync done again because its first pass was not trusted
        (see `step.exchange_fragment`): it runs only on such syncs."""
        return f"/{RECHECK_SCOPE}/" in self.op_name

    @property
    def payload_bytes(self) -> int:
        """Bytes each participant contributes: the whole operand of an all-reduce, its
        1/n share of an all-gather's result (control values excluded)."""
        return self._per_participant(self._bytes(lambda dt: dt not in CONTROL_DTYPES))

    @property
    def control_bytes(self) -> int:
        """The same for control values (int32 counts, bool masks) riding along a sync."""
        return self._per_participant(self._bytes(lambda dt: dt in CONTROL_DTYPES))

    def _per_participant(self, nbytes: int) -> int:
        if self.kind == "all-gather":
            return nbytes // self.group_size
        if self.kind == "reduce-scatter":
            return nbytes * self.group_size
        return nbytes

    @property
    def wire_bytes(self) -> float:
        """Bytes each participant sends with the bandwidth-optimal ring algorithm:
        all-reduce 2(n−1)/n·payload, all-gather (n−1)·payload, reduce-scatter (n−1)/n·payload."""
        n = self.group_size
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * self.payload_bytes
        if self.kind == "all-gather":
            return (n - 1) * self.payload_bytes
        if self.kind == "reduce-scatter":
            return (n - 1) / n * self.payload_bytes
        return float(self.payload_bytes)

    @property
    def bytes(self) -> int:
        """Bytes of everything the collective produces."""
        return self._bytes(lambda dt: True)

    def _bytes(self, keep) -> int:
        return _nbytes(self.shapes, keep)


def _shapes(hlo_type: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dtype, dims) of every array in an HLO type such as `(f32[4,3]{1,0}, bf16[8])`."""
    return tuple((dt, tuple(int(d) for d in dims.split(",") if d))
                 for dt, dims in _ARRAY.findall(hlo_type) if dt in DTYPE_BYTES)


def _nbytes(shapes, keep=lambda dtype: True) -> int:
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shapes if keep(dt))


def _parse(hlo: str):
    """{computation: [instruction lines]} and the name of the ENTRY computation."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    return comps, entry


def collectives(hlo: str) -> list[Collective]:
    """Every cross-device collective in compiled HLO text (async `-start` forms included)."""
    comps, _ = _parse(hlo)
    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            name, out_type, op = m.group(1), m.group(2), m.group(3)
            kind = op.removesuffix("-start")
            if kind not in COLLECTIVE_OPS or op.endswith("-done"):
                continue
            shapes = _shapes(out_type)
            if op.endswith("-start") and len(shapes) > 1:
                shapes = shapes[len(shapes) // 2 :]  # (operands, results) tuple: keep results
            op_name = _OP_NAME.search(line)
            found.append(
                Collective(kind, name, comp, shapes, op_name.group(1) if op_name else "",
                           group_size(line), replica_groups(line))
            )
    return found


def group_size(line: str) -> int:
    """Participants per replica group of one collective, in any of the notations XLA prints:
    explicit groups `{{0,1},{2,3}}`, iota `[2,2]<=[4]`, or (newer XLA) mesh axes
    `mesh['diloco'=2,'data'=2] {'diloco'}` (the product of the selected axes' sizes)."""
    groups = _GROUPS_LIST.search(line)
    if groups:
        return len(groups.group(1).split(","))
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(1))
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        sizes = {name: int(n) for name, n in _MESH_AXIS.findall(mesh.group(1))}
        return math.prod(sizes[a.strip().strip("'")] for a in mesh.group(4).split(",") if a.strip())
    return 1


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS_ALL = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA_FULL = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """The device ids of each replica group, from explicit groups, an iota
    `[G,S]<=[dims]T(perm)` (iota over dims, transposed by perm, cut into G groups of S) or
    mesh axes (`mesh_groups`); a collective-permute's `source_target_pairs` as groups of two."""
    pairs = _PAIRS.search(line)
    if pairs:
        return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)))
    explicit = _GROUPS_ALL.search(line)
    if explicit:
        return tuple(tuple(int(i) for i in g.split(",") if i)
                     for g in re.findall(r"\{([0-9,]*)\}", explicit.group(1)))
    iota = _GROUPS_IOTA_FULL.search(line)
    if iota:
        g, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(g, size))
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        return mesh_groups(*mesh.groups())
    return None


def mesh_groups(axes: str, ids_dims: str | None, ids_perm: str | None, selected: str):
    """Groups of the mesh notation of newer XLA, `mesh['a'=2,'b'=4], device_ids=([2,2,2]T(0,2,1))
    {'a'}`: devices (row-major over the axes, numbered by the optional iota `device_ids`) that
    differ only along the selected axes form one group. The axes are XLA's (a shard_map
    names them after the mesh; GSPMD calls them axis_0, axis_1, ...), so the groups, not the
    names, say which of the user's mesh axes a collective spans."""
    named = _MESH_AXIS.findall(axes)
    names, sizes = [n for n, _ in named], [int(k) for _, k in named]
    ids = np.arange(math.prod(sizes))
    if ids_dims:
        ids = ids.reshape([int(d) for d in ids_dims.split(",")])
        if ids_perm:
            ids = ids.transpose([int(p) for p in ids_perm.split(",")])
    chosen = [names.index(a.strip().strip("'")) for a in selected.split(",") if a.strip()]
    rest = [i for i in range(len(names)) if i not in chosen]
    grid = ids.reshape(sizes).transpose(rest + chosen)
    return tuple(tuple(int(i) for i in row) for row in grid.reshape(-1, math.prod(sizes[i] for i in chosen)))


def unconditional_computations(hlo: str) -> set[str]:
    """Computations run on every call: reachable from ENTRY without entering a conditional
    branch or a schedule event's loop body."""
    comps, entry = _parse(hlo)
    seen, todo = {entry}, [entry]
    while todo:
        for line in comps.get(todo.pop(), []):
            taken_only = set(_branches(line))
            for _, callee in _CALLEE.findall(line):
                if callee in comps and callee not in seen and callee not in taken_only:
                    seen.add(callee)
                    todo.append(callee)
    return seen


def _branches(line: str) -> list[str]:
    """The computations an instruction runs only on some calls: a conditional's branches,
    the body of a schedule event's loop."""
    if " conditional(" in line:
        m = _BRANCHES.search(line)
        if m:
            return [c.strip().lstrip("%") for c in m.group(1).split(",")]
        return [c for key, c in _CALLEE.findall(line) if key.endswith("computation")]
    if " while(" in line and f"/{EVENT_SCOPE}/" in "".join(_OP_NAME.findall(line)):
        return [c for key, c in _CALLEE.findall(line) if key == "body"]
    return []


def every_step_copies(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array that the `copy` instructions running on every call
    write (outside fusions, in computations reachable without entering a branch): what XLA
    copies on a step without an event, to compare with plain training's program."""
    return _copies(hlo, unconditional_computations(hlo))


def event_copies(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array copied (as in `every_step_copies`) in the computations
    that run only on some calls: a sync's, an apply's. A copy of a whole stacked layer leaf
    there means XLA found no order for an in-place update of a fragment."""
    return _copies(hlo, branch_computations(hlo))


def _copies(hlo: str, computations: set[str]) -> list[tuple[str, tuple[int, ...]]]:
    comps, _ = _parse(hlo)
    fused = {c for lines in comps.values() for line in lines if " fusion(" in line
             for key, c in _CALLEE.findall(line) if key == "calls"}
    out = []
    for comp in computations - fused:
        for line in comps[comp]:
            m = _INSTRUCTION.match(line)
            if m and m.group(3) == "copy":
                out += _shapes(m.group(2))
    return out


def every_step_copy_bytes(hlo: str) -> int:
    """Bytes of `every_step_copies`."""
    return _nbytes(every_step_copies(hlo))


def branch_computations(hlo: str) -> set[str]:
    """Computations that run only on some calls (a conditional's branches, a schedule event's
    loop body), with everything they call."""
    comps, _ = _parse(hlo)
    roots = {c for lines in comps.values() for line in lines for c in _branches(line)}
    seen, todo = set(roots), list(roots)
    while todo:
        for line in comps.get(todo.pop(), []):
            for _, callee in _CALLEE.findall(line):
                if callee in comps and callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
    return seen


def fragment_payload_bytes(hlo: str, num_fragments: int, mesh=None, across: bool = True) -> list[int]:
    """Bytes per device per sync of each fragment, measured: the payload of every collective
    issued under that fragment's sync scope (conditional branches only), but for a sync's
    second pass, which runs only when the first was not trusted (`rechecked`). With `mesh`, only
    the collectives that cross islands (`across`) or only those inside an island (not
    `across`; e.g. gathering the outer fragment over "data" before writing it into islands)."""
    branch = branch_computations(hlo)
    per = [0] * num_fragments
    for c in collectives(hlo):
        if c.fragment is None or c.rechecked or (mesh is not None and crosses_islands(c, mesh) != across):
            continue
        if c.computation not in branch or not 0 <= c.fragment < num_fragments:
            raise ValueError(f"collective {c.name} of fragment {c.fragment} is not inside a sync branch")
        per[c.fragment] += c.payload_bytes
    return per


def every_step_payload_bytes(hlo: str, mesh=None) -> int:
    """Bytes per device of the collectives that run on every call (DDP's gradient mean);
    with `mesh`, only those that cross islands."""
    always = unconditional_computations(hlo)
    return sum(c.payload_bytes for c in collectives(hlo)
               if c.computation in always and (mesh is None or crosses_islands(c, mesh)))


def cross_island_outside_syncs(hlo: str, mesh) -> list[tuple[Collective, str]]:
    """Collectives that cross islands but belong to no fragment's sync, each with where it
    runs: "every step" (unconditional) or "in a branch" (e.g. an apply). The written-out
    backend has none; under GSPMD this is where its choices show."""
    always = unconditional_computations(hlo)
    return [(c, "every step" if c.computation in always else "in a branch")
            for c in collectives(hlo) if c.fragment is None and crosses_islands(c, mesh)]


def crosses_islands(c: Collective, mesh) -> bool:
    """Whether a collective's groups join devices of different islands."""
    return "diloco" in c.axes(mesh)


# ---------------------------------------------------------------- byte accounting


def sync_bytes(fragment_params: int, bytes_per_param: float = 4) -> float:
    """Bytes one island sends to all-reduce a fragment of `fragment_params` values: 2·|Θ_f|·b
    (a ring all-reduce moves each value out twice: reduce-scatter, then all-gather)."""
    return 2 * fragment_params * bytes_per_param


def codec_sync_bytes(tensor_sizes: Sequence[int], codec) -> int:
    """Bytes one island sends per sync of a fragment whose tensors (the leaves the codec
    encodes one by one) have these sizes, counted from the codec's exact payload in
    sync_bytes' convention of twice the payload: 2·Σ codec.payload_bytes(n). For "topk"
    that is the packed values, their indices and the per-chunk scales; for float32 it
    equals sync_bytes(Σ n, 4). (`bytes_per_param = bits/8`, as a run's log counts fp4,
    leaves out per-tensor scales and cannot describe a sparse codec.)"""
    return 2 * sum(codec.payload_bytes(int(n)) for n in tensor_sizes)


def codec_index_bytes(tensor_sizes: Sequence[int], codec) -> int:
    """The part of `codec_sync_bytes` that is indices (where the sent values go; 0 for a
    dense codec): 2·Σ codec.index_bytes(n)."""
    return 2 * sum(codec.index_bytes(int(n)) for n in tensor_sizes)


def fragment_tensor_sizes(model, cfg) -> list[list[int]]:
    """Per fragment, the sizes of the tensors a sync of it encodes (its part of each float
    leaf of `model`, as `Fragmentation.take` cuts it) — what `codec_sync_bytes` takes."""
    import equinox as eqx
    import jax

    from diloco_eqx.fragments import Fragmentation

    frags = Fragmentation.from_model(model, cfg)
    params = eqx.filter(model, eqx.is_inexact_array)
    return [[int(x.size) for x in jax.tree.leaves(frags.take(params, f))] for f in range(frags.num_fragments)]


def syncs_of(t: int, schedule) -> list[int]:
    """How many times each fragment has been synced after t steps (sync j fires at j·Δh on
    fragment j mod P)."""
    p = schedule.num_fragments
    syncs = max(t, 0) // schedule.steps_between_syncs
    return [syncs // p + (1 if 0 < f <= syncs % p else 0) for f in range(p)]


def bytes_sent(
    t: int, fragment_params: list[int], schedule=None, bytes_per_param: float = 4,
    *, fragment_bytes: Sequence[float] | None = None,
) -> float:
    """Bytes one island has sent after t steps: every step all parameters (DDP, schedule=None),
    or at each sync of fragment f its own 2·|Θ_f|·b (DiLoCo; one fragment when vanilla).
    `fragment_bytes` (bytes of one sync of each fragment, e.g. `codec_sync_bytes` of its
    tensors: what a codec's payload really holds) replaces 2·|Θ_f|·b."""
    if schedule is None:
        return t * sync_bytes(sum(fragment_params), bytes_per_param)
    if fragment_bytes is None:
        fragment_bytes = [sync_bytes(n, bytes_per_param) for n in fragment_params]
    return sum(count * b for count, b in zip(syncs_of(t, schedule), fragment_bytes))
