"""The rounds of a save and a load, each declared once with what every rank sends and what rank 0
decides (docs/architecture.md lists them in protocol order), and their typed messages
(:class:`~shardsafe.coord.messages.Message`: every field checked when read).

Save: ``arrive`` (:class:`SaveArrival` -> :class:`SaveStart`), ``per_rank`` only when needed
(:class:`PerRankNodes` -> :class:`PerRankPaths`), then the commitment ``written`` (:class:`WriteReport`
-> :class:`Committed`: rank 0 decides the manifest, wins "go", publishes and confirms). Load: ``arrive``,
the go/no-go, and ``loaded``, one outcome on every rank (:class:`Counts` -> nothing, each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardsafe.coord.messages import Empty, Message, optional
from shardsafe.coord.rounds import Commitment, Round

# ---------------------------------------------------------------------------------- save


@dataclass(frozen=True)
class SaveArrival(Message):
    """(every rank, the save's first agreement) What rank 0 needs to start the save: this rank's digest of
    every value and stateful entry (``entries``: key -> [kind, digest]), the digests and structure of
    their nodes when there are few (``nodes``: json(path) -> [digest, signature]; ``None`` when there
    are too many to send: rank 0 then asks for them in a second round, only if some entry differs),
    and the FSDP1 optimizer-state structure this rank holds (``fsdp1``, JSON; "" when none)."""

    entries: dict[str, list[str]]
    nodes: dict[str, list[str]] | None
    fsdp1: str
    TYPES: ClassVar[dict[str, Any]] = {"entries": dict, "nodes": (dict, type(None)), "fsdp1": str}


@dataclass(frozen=True)
class Base(Message):
    """The base of an incremental save, as rank 0 checked it: its ``path``, its ``name`` (what the new
    manifest's references record) and the ``save_id`` of its manifest then."""

    path: str
    name: str
    save_id: str
    TYPES: ClassVar[dict[str, Any]] = {"path": str, "name": str, "save_id": str}


@dataclass(frozen=True)
class SaveStart(Message):
    """(rank 0 decides) The save's id, its pending directory, the checksum block size every writer uses,
    the incremental ``base`` (or ``None``), the per-rank subtrees (``per_rank``: paths, or ``None`` when
    a second round must find them among ``differ``) and every rank's FSDP1 payload (``fsdp1``, in rank
    order)."""

    save_id: str
    pending: str
    block_bytes: int
    base: Base | None
    per_rank: list[list[Any]] | None
    differ: list[str]
    fsdp1: list[str]
    TYPES: ClassVar[dict[str, Any]] = {
        "save_id": str,
        "pending": str,
        "block_bytes": int,
        "base": optional(Base),
        "per_rank": (list, type(None)),
        "differ": list,
        "fsdp1": list,
    }


@dataclass(frozen=True)
class PerRankNodes(Message):
    """(every rank, only when the first agreement could not decide) The digest and structure of every
    node of the entries that differ (``nodes``), and, after an FSDP1 exchange, every entry's digest
    (``entries``, else empty)."""

    entries: dict[str, list[str]]
    nodes: dict[str, list[str]]
    TYPES: ClassVar[dict[str, Any]] = {"entries": dict, "nodes": dict}


@dataclass(frozen=True)
class PerRankPaths(Message):
    """(rank 0 decides) The smallest subtrees that differ between ranks: each is kept per rank."""

    paths: list[list[Any]]
    TYPES: ClassVar[dict[str, Any]] = {"paths": list}


@dataclass(frozen=True)
class WriteReport(Message):
    """(every rank, after its data is durable) What it wrote: ``chunks`` ([tensor name, chunk record]) of
    the tensors the manifest lists chunk by chunk (a ruled tensor's chunks, format v3, follow from its
    rule and this rank's data file: none is reported, so a report is O(this rank's tensors) at most),
    ``files`` (name -> [size, header bytes, header checksum, index checksum]), a ``fingerprint`` of the
    state's structure (sharding rules included), the ``block_bytes`` used, its ``per_rank`` values, its
    final progress ``counts``, its ``side`` files (name -> [size, xxh3-64]: written, on rank 0; given, to
    compare, on the others) and the digests of its copies of the replicated tensors (``replicas``: at
    most 128, engine/replicas.py)."""

    chunks: list[list[Any]]
    files: dict[str, list[Any]]
    fingerprint: str
    block_bytes: int
    per_rank: dict[str, Any]
    counts: list[int] = field(default_factory=list)
    side: dict[str, list[Any]] = field(default_factory=dict)
    replicas: list[str] = field(default_factory=list)
    TYPES: ClassVar[dict[str, Any]] = {
        "chunks": list,
        "files": dict,
        "fingerprint": str,
        "block_bytes": int,
        "per_rank": dict,
        "counts": list,
        "side": dict,
        "replicas": list,
    }


@dataclass(frozen=True)
class Committed(Message):
    """(rank 0, after publishing) The save is committed, with ``save_id`` in its manifest."""

    save_id: str
    TYPES: ClassVar[dict[str, Any]] = {"save_id": str}


# ---------------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Counts(Message):
    """(every rank of a load) Its progress counts so far: bytes done and bytes to move (``[done, total]``)."""

    counts: list[int]
    TYPES: ClassVar[dict[str, Any]] = {"counts": list}


# ---------------------------------------------------------------------------------- the rounds

CHANNEL = "ckpt"
"""Saves and loads share one channel of operations: a save meeting a load is caught as out of step."""

SAVE_ARRIVE = Round("arrive", SaveArrival, SaveStart)
"""(every rank, arrival deadline) The save's rendezvous; rank 0 decides the start, or refuses the target."""

SAVE_PER_RANK = Round("per_rank", PerRankNodes, PerRankPaths)
"""(every rank, only when the first round could not decide) The per-rank subtrees."""

SAVE_WRITTEN = Commitment(
    "written",
    WriteReport,
    Committed,
    deciding="commit",
    settling="decide",
    acting="publish",
    following="decision",
    act="publish",
)
"""(every rank, end deadline) Every rank's write report; rank 0 decides the manifest, wins "go" on the
decision key, publishes it and confirms :class:`Committed`."""

LOAD_ARRIVE = Round("arrive", Counts, Empty)
"""(every rank, arrival deadline) The load's go/no-go: every rank planned and validated, or its failure."""

LOAD_LOADED = Round("loaded", Counts, Empty)
"""(every rank, end deadline) Read and restored, or its failure: one outcome on every rank (rank 0 hands
every rank's final counts to its progress tracker)."""
