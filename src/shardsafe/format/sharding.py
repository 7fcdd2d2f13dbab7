"""Regular shardings as rules (format v3, docs/format.md section 3b): a tensor split over a mesh of
writing ranks the way DTensor placements split it, described once instead of one chunk per rank.

A :class:`Mesh` is a grid of writing ranks (``shape``, ``ranks`` in row-major order); a
:class:`Sharding` says, for each mesh dimension, which tensor dimension it splits and with what split
factor (1: ``Shard(d)``, torch.chunk pieces; ``f > 1``: ``_StridedShard(d, split_factor=f)``).
Mesh dimensions over which the data is replicated are not part of the mesh: the ranks listed are
the writers (coordinate 0 on the replicated dimensions).

The boxes of one coordinate follow from the rule alone (:func:`boxes`), and the boxes that meet a
region are found without visiting every coordinate (:func:`overlapping`): by arithmetic on the
pieces' sizes, level by level. Everything here is bounded by the rule itself: a coordinate makes at
most :data:`BOX_BUDGET` boxes, a rule that could make more is refused when the manifest is read
(:func:`box_bound`), and the number of coordinates is the length of a list the manifest holds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_MESH_DIMS = 16
"""Most dimensions of a writers' mesh."""
BOX_BUDGET = 2**16
"""Most boxes one coordinate of a rule may make (each ``_StridedShard`` factor multiplies the runs of
one tensor dimension); a rule that could make more is refused."""

Runs = list[tuple[int, int]]
"""An ordered sequence of global indices along one dimension, as ``[start, stop)`` runs."""
Region = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a box of the global tensor."""


@dataclass(frozen=True)
class Mesh:
    """The ranks whose data files hold the chunks of a rule: ``ranks[i]`` writes coordinate ``i``
    (row-major over ``shape``)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    _where: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def coordinate(self, index: int) -> tuple[int, ...]:
        """The coordinate of the ``index``-th entry of :attr:`ranks`."""
        out = []
        for n in reversed(self.shape):
            index, c = divmod(index, n)
            out.append(c)
        return tuple(reversed(out))

    def index(self, coord: Sequence[int]) -> int:
        i = 0
        for c, n in zip(coord, self.shape, strict=True):
            i = i * n + c
        return i

    def positions(self, rank: int) -> list[int]:
        """The coordinates (as indices into :attr:`ranks`) that ``rank`` writes (one, in a mesh a
        writer builds)."""
        if not self._where:
            for i, r in enumerate(self.ranks):
                self._where.setdefault(r, []).append(i)
        return self._where.get(rank, [])

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Sharding:
    """A rule: the mesh (an index into the manifest's ``meshes``) and, per mesh dimension, the tensor
    dimension it splits and the split factor."""

    mesh: int
    dims: tuple[tuple[int, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "dims": [list(d) for d in self.dims]}


def box_bound(dims: Sequence[tuple[int, int]]) -> int:
    """The most boxes one coordinate of a rule with ``dims`` can make: the runs of a tensor dimension
    multiply by at most the split factor at each strided split, and a box is one run per dimension."""
    per_dim: dict[int, int] = {}
    for d, f in dims:
        per_dim[d] = per_dim.get(d, 1) * f
    return math.prod(per_dim.values())


# ---------------------------------------------------------------------------------- runs


def _length(seq: Runs) -> int:
    return sum(b - a for a, b in seq)


def _take(seq: Runs, lo: int, hi: int) -> Runs:
    """The elements at positions ``[lo, hi)`` of ``seq``."""
    out: Runs = []
    pos = 0
    for a, b in seq:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += n
        if pos >= hi:
            break
    return out


def _chunk(seq: Runs, n: int, j: int) -> Runs:
    """Piece ``j`` of ``seq`` cut in ``n`` as ``torch.chunk`` cuts (pieces of ``ceil(len / n)``; the
    last ones may be short or empty)."""
    total = _length(seq)
    q = -(-total // n) if total else 0
    return _take(seq, j * q, min((j + 1) * q, total)) if q else []


def _merge(seq: Runs) -> Runs:
    out: Runs = []
    for a, b in seq:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def part(seq: Runs, n: int, f: int, j: int) -> Runs:
    """Piece ``j`` of ``n`` of ``seq`` under split factor ``f`` (docs/format.md, section 3b)."""
    if f == 1:
        return _merge(_chunk(seq, n, j))
    return _merge([r for g in range(f) for r in _chunk(_chunk(seq, f, g), n, j)])


def coordinate_runs(shape: Sequence[int], rule: Sharding, mesh: Mesh, coord: Sequence[int]) -> list[Runs]:
    """The global indices, along each tensor dimension, that coordinate ``coord`` holds."""
    runs: list[Runs] = [[(0, n)] if n else [] for n in shape]
    for (d, f), n, c in zip(rule.dims, mesh.shape, coord, strict=True):
        runs[d] = part(runs[d], n, f, c)
    return runs


def boxes(shape: Sequence[int], rule: Sharding, mesh: Mesh, coord: Sequence[int]) -> list[Region]:
    """The non-empty boxes coordinate ``coord`` holds, in row-major order of their runs (the order a
    DTensor's local shard holds them)."""
    runs = coordinate_runs(shape, rule, mesh, coord)
    if not shape:
        return [((), ())]
    if any(not r for r in runs):
        return []
    return [(tuple(a for a, _ in combo), tuple(b - a for a, b in combo)) for combo in itertools.product(*runs)]


def all_boxes(shape: Sequence[int], rule: Sharding, mesh: Mesh) -> Iterator[tuple[int, Region]]:
    """(index into ``mesh.ranks``, box) of every box the rule stores: those that meet the whole tensor
    (:func:`overlapping`, which visits no coordinate without elements, however large the mesh)."""
    if not shape:
        yield 0, ((), ())
        return
    if any(n == 0 for n in shape):
        return
    yield from overlapping(shape, rule, mesh, ((0,) * len(shape), tuple(shape)))


def count_boxes(shape: Sequence[int], rule: Sharding, mesh: Mesh) -> int:
    """How many boxes the rule stores: from the pieces' sizes alone where each dimension is split at
    most once with factor 1 (FSDP2, HSDP, TP); else by :func:`all_boxes`."""
    if not shape:
        return 1
    if any(n == 0 for n in shape):
        return 0
    counts = []
    for t, n_t in enumerate(shape):
        levels = [(n, f) for (d, f), n in zip(rule.dims, mesh.shape, strict=True) if d == t]
        if len(levels) > 1 or any(f != 1 for _, f in levels):
            return sum(1 for _ in all_boxes(shape, rule, mesh))
        if levels:
            n = levels[0][0]
            q = -(-n_t // n)
            counts.append(-(-n_t // q) if q else 0)
    return math.prod(counts)


def overlapping(shape: Sequence[int], rule: Sharding, mesh: Mesh, region: Region) -> list[tuple[int, Region]]:
    """(index into ``mesh.ranks``, box) of every stored box that meets ``region``, found dimension by
    dimension: at each split level only the pieces that meet the region are followed, their numbers
    worked out from the pieces' length (no visit of every coordinate)."""
    lo, size = region
    if not shape:  # a 0-d tensor: one box, at the mesh's only coordinate
        whole: Region = ((), ())
        return [(0, whole)]
    if any(s <= 0 for s in size):
        return []
    levels: list[list[tuple[int, int, int]]] = [[] for _ in shape]  # per tensor dim: (mesh dim, n, f)
    for i, ((d, f), n) in enumerate(zip(rule.dims, mesh.shape, strict=True)):
        levels[d].append((i, n, f))
    if all(len(lv) <= 1 and all(f == 1 for _, _, f in lv) for lv in levels):
        return _plain_overlapping(shape, mesh, levels, lo, size)
    per_dim: list[list[tuple[dict[int, int], Runs]]] = []
    for t, n_t in enumerate(shape):
        a, b = lo[t], lo[t] + size[t]
        found: list[tuple[dict[int, int], Runs]] = [({}, [(0, n_t)])]
        for i, n, f in levels[t]:
            nxt: list[tuple[dict[int, int], Runs]] = []
            for where, seq in found:
                for j in _candidates(seq, n, f, a, b):
                    sub = part(seq, n, f, j)
                    kept = [(x, y) for x, y in sub if x < b and y > a]
                    if kept:
                        nxt.append(({**where, i: j}, sub))
            found = nxt
        per_dim.append([(w, [(x, y) for x, y in s if x < b and y > a]) for w, s in found])
    out: list[tuple[int, Region]] = []
    for combo in itertools.product(*per_dim):
        coord = [0] * len(mesh.shape)
        for where, _ in combo:
            for i, j in where.items():
                coord[i] = j
        index = mesh.index(coord)
        for box in itertools.product(*(runs for _, runs in combo)):
            out.append((index, (tuple(x for x, _ in box), tuple(y - x for x, y in box))))
    return out


def _plain_overlapping(
    shape: Sequence[int], mesh: Mesh, levels: list[list[tuple[int, int, int]]], lo: Sequence[int], size: Sequence[int]
) -> list[tuple[int, Region]]:
    """:func:`overlapping` where each tensor dimension is split at most once, with factor 1 (FSDP2,
    HSDP, tensor parallelism without FSDP over it): the pieces met are a range of numbers per
    dimension, each piece one run."""
    per_dim: list[list[tuple[int, int, int, int]]] = []  # per tensor dim: (mesh dim, piece, start, stop)
    for t, n_t in enumerate(shape):
        a, b = lo[t], lo[t] + size[t]
        if not levels[t]:
            per_dim.append([(-1, 0, 0, n_t)])
            continue
        ((i, n, _),) = levels[t]
        q = -(-n_t // n)
        if not q:
            return []
        per_dim.append([(i, j, j * q, min((j + 1) * q, n_t)) for j in range(a // q, min((b - 1) // q, n - 1) + 1)])
    out: list[tuple[int, Region]] = []
    for combo in itertools.product(*per_dim):
        coord = [0] * len(mesh.shape)
        for i, j, _, _ in combo:
            if i >= 0:
                coord[i] = j
        if all(x < y for _, _, x, y in combo):
            out.append((mesh.index(coord), (tuple(x for _, _, x, _ in combo), tuple(y - x for _, _, x, y in combo))))
    return out


def _candidates(seq: Runs, n: int, f: int, a: int, b: int) -> list[int]:
    """The piece numbers ``j`` (of ``n``, split factor ``f``) whose elements may meet ``[a, b)``."""
    found: set[int] = set()
    groups = [seq] if f == 1 else [_chunk(seq, f, g) for g in range(f)]
    for group in groups:
        total = _length(group)
        if not total:
            continue
        q = -(-total // n)
        pos = 0
        for x, y in group:
            s, e = max(x, a), min(y, b)
            if s < e:
                first, last = (pos + s - x) // q, (pos + e - x - 1) // q
                found.update(range(first, min(last, n - 1) + 1))
            pos += y - x
    return sorted(found)
