"""Who writes which bytes. The plan is a pure function of the state's metadata (names, shapes, dtypes,
placements) and the world size, so every rank computes the same assignment without exchanging data.

- Sharded tensors (DTensor with a Shard placement, FSDP1 flat shards): each owner writes its own boxes.
- Replicated tensors (plain tensors, DDP parameters, fully replicated DTensors): written once. A large
  one is split into row ranges so several ranks share it; pieces go to the rank with the fewest
  assigned bytes so far, largest first (ties: lowest rank), which balances the bytes written.

A :class:`SavePlan` is this rank's part: the chunks it writes, in file order, and the save's
:class:`Rules`: the sharded tensors the manifest describes by a rule (format v3) instead of listing
their chunks, which every rank works out alike from the placements, so that no rank reports, and rank
0 never handles, one record per chunk of them (docs/format.md, section 3b).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardsafe import knobs
from shardsafe.errors import InternalError
from shardsafe.format.index import index_bytes
from shardsafe.format.resolve import chunk_key
from shardsafe.format.sharding import Mesh, Sharding, boxes
from shardsafe.state.flatten import FlatState, TensorItem


@dataclass
class PendingChunk:
    """A chunk this rank writes: its manifest tensor name, box, and the tensor holding the bytes."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor  # contiguous CPU tensor of exactly ``sizes``

    @property
    def key(self) -> str:
        return chunk_key(self.name, self.offsets)

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.data.dtype.itemsize


def _row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    step = -(-rows // parts)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def plan_writes(items: Sequence[TensorItem], rank: int, world_size: int) -> list[PendingChunk]:
    """(every rank, locally) The chunks this rank writes, as views of its tensors (no copy yet)."""
    mine: list[PendingChunk] = []
    pieces: list[tuple[int, str, TensorItem, int, int]] = []  # (nbytes, name, item, row_lo, row_hi)
    split = knobs.split_replicated_bytes()
    for item in items:
        if not item.replicated:
            for offsets, data in item.boxes() if item.owner else []:
                if data.numel() > 0:
                    mine.append(PendingChunk(item.name, offsets, tuple(data.shape), data))
            continue
        rows = item.shape[0] if item.shape else 1
        parts = min(world_size, rows, max(1, item.nbytes // split)) if item.shape else 1
        row_bytes = item.nbytes // rows if rows else 0
        for lo, hi in _row_ranges(rows, parts) if parts > 1 else [(0, rows)]:
            pieces.append(((hi - lo) * row_bytes, item.name, item, lo, hi))
    load = [(0, r) for r in range(world_size)]  # (bytes assigned, rank): the least loaded, lowest rank first
    for nbytes, _, item, lo, hi in sorted(pieces, key=lambda p: (-p[0], p[1], p[3])):
        assigned, writer = heapq.heappop(load)
        heapq.heappush(load, (assigned + nbytes, writer))
        if writer != rank:
            continue
        if not item.shape:
            mine.append(PendingChunk(item.name, (), (), item.local))
        elif (lo, hi) == (0, item.shape[0]):
            mine.append(PendingChunk(item.name, (0,) * len(item.shape), item.shape, item.local))
        else:
            box = (hi - lo, *item.shape[1:])
            offsets = (lo,) + (0,) * (len(item.shape) - 1)
            mine.append(PendingChunk(item.name, offsets, box, item.local[lo:hi]))
    # An empty chunk arises only from an empty replicated tensor (sharded boxes without elements are
    # skipped above, row ranges of a non-empty tensor are never empty): kept, so the manifest records it.
    return mine


def own_chunks(flat: FlatState) -> list[PendingChunk]:
    """(every rank) The chunks of this rank's per-rank tensors: each written whole, by this rank."""
    return [PendingChunk(i.name, (0,) * len(i.shape), i.shape, i.local) for i in flat.per_rank]


def file_bytes(chunks: Sequence[PendingChunk], block: int, ruled: int = 0) -> tuple[int, int]:
    """(a writing rank) The size of the data file ``chunks`` make (the last ``ruled`` of them described by
    a rule, format v3, with checksum blocks of ``block`` bytes), and how much of it is not the chunks'
    bytes: header and index (0, 0: no file)."""
    if not chunks:
        return 0, 0
    from shardsafe.format.datafile import build_header

    other = len(build_header(chunks, ruled, block))
    if ruled:
        other += index_bytes([c.nbytes for c in chunks[len(chunks) - ruled :]], block)
    return other + sum(c.nbytes for c in chunks), other


@dataclass(frozen=True)
class Rules:
    """The tensors of a save described by a sharding rule (format v3) and the writers' meshes the
    rules refer to; the same on every rank, from the placements alone (:func:`rules_of`)."""

    tensors: dict[str, Sharding] = field(default_factory=dict)
    meshes: list[Mesh] = field(default_factory=list)

    def digest(self) -> str:
        """What every rank must agree on (a part of the save's structure fingerprint)."""
        h = hashlib.sha256()
        for m in self.meshes:
            h.update(f"{m.shape}{m.ranks};".encode())
        for name, rule in self.tensors.items():
            h.update(f"{name}|{rule.mesh}|{rule.dims};".encode())
        return h.hexdigest()[:16]


def rules_of(items: Sequence[TensorItem], world_size: int) -> Rules:
    """(every rank, locally) The rules of the sharded tensors among ``items`` whose layout is one
    (:class:`~shardsafe.state.layout.Rule`) with writers inside the saving world; meshes in order of
    first use."""
    meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    known: dict[int, tuple[tuple[int, ...], tuple[int, ...], int]] = {}  # id of a rank tuple -> (it, shape, mesh)
    tensors: dict[str, Sharding] = {}
    for item in items:
        rule = item.rule
        if rule is None or item.replicated:
            continue
        seen = known.get(id(rule.ranks))  # tensors on one mesh share its rank tuple: no rehash of it per tensor
        if seen is not None and seen[0] is rule.ranks and seen[1] == rule.mesh_shape:
            index = seen[2]
        else:
            key = (rule.mesh_shape, rule.ranks)
            found = meshes.get(key)
            if found is None:
                if any(not 0 <= r < world_size for r in rule.ranks):
                    continue  # writers outside the saving group: listed chunk by chunk
                found = meshes[key] = len(meshes)
            index = found
            known[id(rule.ranks)] = (rule.ranks, rule.mesh_shape, index)
        tensors[item.name] = Sharding(index, rule.dims)
    return Rules(tensors, [Mesh(shape, ranks) for shape, ranks in meshes])


@dataclass
class SavePlan:
    """(every rank) This rank's part of a save: the ``chunks`` it writes, in file order (those listed in
    the manifest, then the last ``ruled``, those a rule describes, in the order the rules give them,
    docs/format.md section 2), and the save's ``rules``. Its write report lists only the first ones
    (:meth:`listed`)."""

    rank: int
    chunks: list[PendingChunk]
    rules: Rules
    ruled: int = 0

    def listed(self, name: str) -> bool:
        """Whether chunks of tensor ``name`` are listed in the manifest (not described by a rule)."""
        return name not in self.rules.tensors


def plan_save(flat: FlatState, rank: int, world_size: int, *, ruled: bool = True) -> SavePlan:
    """(every rank, locally) What this rank writes (:func:`plan_writes`, :func:`own_chunks`) and, with
    ``ruled`` (not for an incremental save, whose chunks may each refer elsewhere), the rules; each
    rule checked against the boxes this rank holds (a rule that disagrees with the DTensor's own
    layout would make a manifest that places chunks where they are not: refused, naming the tensor)."""
    chunks = plan_writes(flat.items, rank, world_size) + own_chunks(flat)
    rules = rules_of(flat.items, world_size) if ruled else Rules()
    if not rules.tensors:
        return SavePlan(rank, chunks, rules)
    mine = {(c.name, c.offsets): c for c in chunks if c.name in rules.tensors}
    ordered: list[PendingChunk] = []  # the ruled chunks in file order: tensors in state order, boxes in rule order
    memo: dict[tuple[tuple[int, ...], Sharding], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for item in flat.items:
        rule = rules.tensors.get(item.name)
        if rule is None:
            continue
        mesh = rules.meshes[rule.mesh]
        held = sorted((o, tuple(d.shape)) for o, d in item.boxes() if item.owner and d.numel() > 0)
        want = memo.get((item.shape, rule))  # tensors of one shape and rule (every layer's) share their boxes
        if want is None:
            want = memo[(item.shape, rule)] = [
                b for i in mesh.positions(rank) for b in boxes(item.shape, rule, mesh, mesh.coordinate(i))
            ]
        if held != sorted(want):
            raise InternalError(
                f"shardsafe: rank {rank}: the sharding rule of tensor {item.name!r} places boxes {want[:4]} on this "
                f"rank, which holds {held[:4]} to write; this is a bug in shardsafe's reading of DTensor placements "
                "(please report it with the tensor's placements and mesh)"
            )
        ordered += [mine[(item.name, offsets)] for offsets, _ in want]
    listed = [c for c in chunks if c.name not in rules.tensors]
    return SavePlan(rank, listed + ordered, rules, len(ordered))
