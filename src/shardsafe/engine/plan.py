"""Who writes which bytes. The plan is a pure function of the state's metadata (names, shapes, dtypes,
placements) and the world size, so every rank computes the same assignment without exchanging data.

- Sharded tensors (DTensor with a Shard placement, FSDP1 flat shards): each owner writes its own boxes.
- Replicated tensors (plain tensors, DDP parameters, fully replicated DTensors): written once. A large
  one is split into row ranges so several ranks share it; pieces go to the rank with the fewest
  assigned bytes so far, largest first (ties: lowest rank), which balances the bytes written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardsafe import knobs
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
        return self.name if not any(self.offsets) else f"{self.name}@{','.join(map(str, self.offsets))}"

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
    load = [0] * world_size
    for nbytes, _, item, lo, hi in sorted(pieces, key=lambda p: (-p[0], p[1], p[3])):
        writer = min(range(world_size), key=lambda r: (load[r], r))
        load[writer] += nbytes
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


def file_bytes(chunks: Sequence[PendingChunk]) -> tuple[int, int]:
    """(a writing rank) The size of the data file ``chunks`` make, and of its header (0, 0: no file)."""
    if not chunks:
        return 0, 0
    from shardsafe.format.datafile import build_header

    header = len(build_header(chunks))
    return header + sum(c.nbytes for c in chunks), header
