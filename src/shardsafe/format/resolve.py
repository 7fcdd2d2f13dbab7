"""The chunks of a checkpoint's tensors, as readers need them: a listed tensor's chunks as the
manifest gives them, a ruled one's (format v3) from its sharding rule and the indexes of the data
files that hold them, each index read once, and only for the files a reader meets
(:class:`ChunkSource`). A load planning rank asks for the chunks that meet its destination boxes
(:meth:`ChunkSource.chunks` with a region); a whole-checkpoint reader (verify, export) for every chunk
of a file (:meth:`ChunkSource.in_file`) or of the checkpoint (:func:`expand`).

Every chunk resolved from a rule is checked as a listed one is when the manifest is read: its file is
a data file of this save that the manifest lists, whose ruled region and index (checked against the
manifest, :mod:`shardsafe.format.index`) hold exactly the chunks the rules place there, so each one's
byte range lies inside the file and has its checksums; otherwise a :class:`CorruptCheckpointError`
names the tensor and the file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.index import SHARDS_KEY, FileIndex, blocks
from shardsafe.format.model import Chunk, Manifest, TensorEntry
from shardsafe.format.names import DATA_FILE, data_file
from shardsafe.format.sharding import Region, Sharding, all_boxes, boxes, overlapping


def chunk_key(name: str, offsets: tuple[int, ...]) -> str:
    """A chunk's key in its data file's header (docs/format.md, section 2): the tensor's name, with
    ``@<offsets>`` unless the chunk starts at the tensor's origin."""
    return name if not any(offsets) else f"{name}@{','.join(map(str, offsets))}"


def meets(chunk: Chunk, region: Region) -> bool:
    """Whether ``chunk`` shares an element with ``region`` (a 0-d chunk meets a 0-d region)."""
    lo, size = region
    if not size:
        return True
    return all(
        max(co, ro) < min(co + cs, ro + rs) for co, cs, ro, rs in zip(chunk.offsets, chunk.sizes, lo, size, strict=True)
    )


class ChunkSource:
    """Chunks of ``manifest``'s tensors on demand; ``read_index(file)`` reads and checks a data file's
    ruled region and index (:func:`~shardsafe.format.index.read_index`), called at most once per
    file. ``where`` (the manifest's path) prefixes errors. One thread at a time."""

    def __init__(self, manifest: Manifest, read_index: Callable[[str], FileIndex], where: str) -> None:
        self.manifest = manifest
        self._read = read_index
        self.where = where
        self.indexes: dict[str, FileIndex] = {}
        self._placed: dict[str, dict[tuple[str, tuple[int, ...]], Chunk]] = {}
        self._found: dict[tuple[str, Region | None], list[Chunk]] = {}  # a load asks twice (sizes, then reads)

    def index(self, file: str) -> FileIndex:
        """The ruled region and index of ``file`` (read once)."""
        found = self.indexes.get(file)
        if found is None:
            found = self.indexes[file] = self._read(file)
        return found

    def chunks(self, name: str, region: Region | None = None) -> list[Chunk]:
        """The chunks of tensor ``name`` that meet ``region`` (all of them when ``None``)."""
        entry = self.manifest.tensors[name]
        rule = entry.sharding
        if rule is None:
            return list(entry.chunks) if region is None else [c for c in entry.chunks if meets(c, region)]
        known = self._found.get((name, region))
        if known is not None:
            return list(known)
        mesh = self.manifest.meshes[rule.mesh]
        found = all_boxes(entry.shape, rule, mesh) if region is None else overlapping(entry.shape, rule, mesh, region)
        out = self._found[(name, region)] = [self._resolve(name, mesh.ranks[i], box) for i, box in found]
        return list(out)

    def files_of(self, name: str, region: Region | None = None) -> list[str]:
        """The data files holding the chunks of ``name`` that meet ``region`` (ruled: without reading them)."""
        entry = self.manifest.tensors[name]
        rule = entry.sharding
        if rule is None:
            return sorted({c.file for c in self.chunks(name, region)})
        mesh = self.manifest.meshes[rule.mesh]
        found = all_boxes(entry.shape, rule, mesh) if region is None else overlapping(entry.shape, rule, mesh, region)
        return sorted({self._file(name, mesh.ranks[i], box) for i, box in found})

    def in_file(self, file: str) -> list[tuple[str, Chunk]]:
        """(tensor name, chunk) of every ruled chunk the rules place in ``file``, in the file's order
        (listed chunks are the manifest's own); reads its index if any rule places chunks there."""
        m = DATA_FILE.match(file)
        if m is None or m["sid"] != self.manifest.save_id or file not in self.manifest.files:
            return []
        rank = int(m["rank"])
        rules = [t.sharding for t in self.manifest.tensors.values() if t.sharding is not None]
        placed = any(self.manifest.meshes[r.mesh].positions(rank) for r in rules)
        if not placed and self.manifest.files[file].index_checksum is None:
            return []
        return [(key[0], c) for key, c in self._place(file, rank).items()]  # an index none fills is refused there

    def _file(self, name: str, rank: int, box: Region) -> str:
        file = data_file(rank, self.manifest.save_id)
        if file not in self.manifest.files:
            raise CorruptCheckpointError(
                f"{self.where}: tensor {name!r}: its sharding places the chunk at {list(box[0])} in {file}, which "
                "the manifest does not list"
            )
        return file

    def _resolve(self, name: str, rank: int, box: Region) -> Chunk:
        file = self._file(name, rank, box)
        found = self._place(file, rank).get((name, box[0]))
        if found is None or found.sizes != box[1]:  # both come from the rules: only a bug gets here
            raise CorruptCheckpointError(f"{self.where}: tensor {name!r}: no chunk at {list(box[0])} in {file}")
        return found

    def _place(self, file: str, rank: int) -> dict[tuple[str, tuple[int, ...]], Chunk]:
        """Every ruled chunk of ``file`` (written by ``rank``), in the file's order (docs/format.md,
        section 2): the ruled tensors in manifest order, each one's boxes at the rank's coordinate in
        order; each chunk's bytes follow the one before it in the ``/shards`` region, its block
        checksums the one before it's in the index. The region and the index must hold exactly these
        chunks (a rule cannot make a reader go past what the file holds: the walk stops there)."""
        placed = self._placed.get(file)
        if placed is not None:
            return placed
        idx = self.index(file)
        block = self.manifest.block_bytes
        pos, stop = idx.shards
        k = 0
        placed = {}
        memo: dict[tuple[tuple[int, ...], Sharding, int], list[Region]] = {}
        for name, entry in self.manifest.tensors.items():
            rule = entry.sharding
            if rule is None:
                continue
            mesh = self.manifest.meshes[rule.mesh]
            for i in mesh.positions(rank):
                found = memo.get((entry.shape, rule, i))
                if found is None:
                    found = memo[(entry.shape, rule, i)] = boxes(entry.shape, rule, mesh, mesh.coordinate(i))
                for offsets, sizes in found:
                    n = math.prod(sizes) * entry.dtype.itemsize
                    count = blocks(n, block)
                    if pos + n > stop or k + count > len(idx.sums):
                        raise CorruptCheckpointError(
                            f"{self.where}: the sharding rules place more in {file} than its {SHARDS_KEY!r} region "
                            f"({stop - idx.shards[0]} bytes) and index ({len(idx.sums)} checksums) hold (at tensor "
                            f"{name!r}, chunk {list(offsets)})"
                        )
                    key = chunk_key(name, offsets)
                    placed[(name, offsets)] = Chunk(
                        offsets, sizes, file, key, pos, pos + n, tuple(idx.sums[k : k + count]), None, None
                    )
                    pos += n
                    k += count
        if pos != stop or k != len(idx.sums):
            raise CorruptCheckpointError(
                f"{self.where}: {file} holds {stop - idx.shards[0]} bytes of ruled chunks and {len(idx.sums)} "
                f"checksums, its sharding rules place {pos - idx.shards[0]} bytes and {k} checksums there"
            )
        self._placed[file] = placed
        return placed


def expand(source: ChunkSource) -> Manifest:
    """The manifest with every ruled tensor's chunks listed (reading every index it needs): for
    readers of the whole checkpoint (export, conversion) that work from listed chunks."""
    m = source.manifest
    tensors = {
        name: t if t.sharding is None else TensorEntry(t.dtype, t.shape, tuple(source.chunks(name)))
        for name, t in m.tensors.items()
    }
    return dataclasses.replace(m, tensors=tensors)
