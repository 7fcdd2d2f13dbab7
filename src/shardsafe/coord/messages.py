"""Every message that crosses ranks, typed: what each rank sends in an agreement, and what the leader
decides. Each is a frozen dataclass with ``to_json()`` (a JSON-able value) and a validating
``from_json()``: a message of another shape (another shardsafe version on some rank, a bug) raises
:class:`~shardsafe.errors.InternalError` naming the field, never a ``KeyError`` three calls later.

Envelopes (:class:`Envelope`, :class:`Outcome`) carry a body of one of the classes below, or a
:class:`~shardsafe.coord.failures.Failure`. Which body goes with which agreement is written where the
agreement is made (docs/architecture.md lists them in protocol order)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol, TypeVar

from shardsafe.coord.failures import Failure
from shardsafe.errors import InternalError

B = TypeVar("B", bound="Body")


class Body(Protocol):
    """A message body: a dataclass whose fields are JSON values of the declared types."""

    def to_json(self) -> dict[str, Any]: ...


def _check(cls: type, doc: Any, types: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as the keyword arguments of ``cls``, each of the type in ``types`` (a type or a tuple of
    types); raises :class:`InternalError` naming the first field that is not."""
    if not isinstance(doc, dict):
        raise InternalError(f"a {cls.__name__} message from another rank is not an object: {doc!r:.200}")
    out = {}
    for name, want in types.items():
        if name not in doc:
            raise InternalError(f"a {cls.__name__} message from another rank lacks {name!r}: {doc!r:.200}")
        value = doc[name]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise InternalError(
                f"a {cls.__name__} message from another rank has {name}={value!r:.80} (expected {want}); are all "
                "ranks running the same shardsafe version?"
            )
        out[name] = value
    return out


class _Simple:
    """to_json/from_json for a dataclass whose fields are JSON values of the types in ``TYPES``."""

    TYPES: ClassVar[dict[str, Any]] = {}

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[B], doc: Any) -> B:
        return cls(**_check(cls, doc, cls.TYPES))  # type: ignore[attr-defined, call-arg]

    def to_text(self) -> str:
        return json.dumps(self.to_json(), allow_nan=True, separators=(",", ":"))

    @classmethod
    def from_text(cls: type[B], text: str) -> B:
        try:
            doc = json.loads(text)
        except ValueError as err:
            raise InternalError(f"a {cls.__name__} read from the store is not JSON ({err}): {text[:200]!r}") from None
        return cls.from_json(doc)  # type: ignore[attr-defined, no-any-return]


# ---------------------------------------------------------------------------------- envelopes


@dataclass(frozen=True)
class Arrival(_Simple):
    """Who calls what, from where: sent in the first agreement of every operation, compared by the
    leader (ranks doing different things are out of step)."""

    op: str
    target: str
    site: str
    host: str
    pid: int
    TYPES: ClassVar[dict[str, Any]] = {"op": str, "target": str, "site": str, "host": str, "pid": int}


@dataclass(frozen=True)
class Envelope:
    """What one rank sends in one agreement: its body, or its failure; with its arrival in the first."""

    rank: int
    body: dict[str, Any] | None = None
    failure: Failure | None = None
    arrival: Arrival | None = None

    def to_text(self) -> str:
        doc: dict[str, Any] = {"r": self.rank}
        if self.body is not None:
            doc["b"] = self.body
        if self.failure is not None:
            doc["f"] = self.failure.to_json()
        if self.arrival is not None:
            doc["a"] = self.arrival.to_json()
        return json.dumps(doc, allow_nan=True, separators=(",", ":"))

    @staticmethod
    def from_text(text: str) -> Envelope:
        try:
            doc = json.loads(text)
        except ValueError as err:
            raise InternalError(f"a message from another rank is not JSON ({err}): {text[:200]!r}") from None
        rank = _check(Envelope, doc, {"r": int})["r"]
        body = doc.get("b")
        if body is not None and not isinstance(body, dict):
            raise InternalError(f"a message from rank {rank} has a body of type {type(body).__name__}")
        failure = Failure.from_json(doc["f"]) if "f" in doc else None
        arrival = Arrival.from_json(doc["a"]) if "a" in doc else None
        return Envelope(rank, body, failure, arrival)


@dataclass(frozen=True)
class Timeout:
    """The outcome of an agreement some rank gave up waiting for."""

    by: int
    phase: str
    arrived: list[int]
    missing: list[int]
    budget: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "phase": self.phase,
            "arrived": self.arrived,
            "missing": self.missing,
            "budget": self.budget,
            "seconds": self.seconds,
        }

    @staticmethod
    def from_json(doc: Any) -> Timeout:
        d = _check(
            Timeout,
            doc,
            {"by": int, "phase": str, "arrived": list, "missing": list, "budget": str, "seconds": (int, float)},
        )
        return Timeout(**d)


@dataclass(frozen=True)
class Outcome:
    """What every rank of an agreement gets: the leader's decision (``body``), a failure (``failure``:
    every rank raises it, see :mod:`~shardsafe.coord.failures`), or a timeout (``timeout``)."""

    body: dict[str, Any] | None = None
    failure: Failure | None = None
    timeout: Timeout | None = None

    def to_text(self) -> str:
        if self.failure is not None:
            doc: dict[str, Any] = {"abort": self.failure.to_json()}
        elif self.timeout is not None:
            doc = {"timeout": self.timeout.to_json()}
        else:
            doc = {"ok": self.body if self.body is not None else {}}
        return json.dumps(doc, allow_nan=True, separators=(",", ":"))

    @staticmethod
    def from_text(text: str) -> Outcome:
        try:
            doc = json.loads(text)
        except ValueError as err:
            raise InternalError(f"an outcome read from the store is not JSON ({err}): {text[:200]!r}") from None
        if isinstance(doc, dict) and isinstance(doc.get("ok"), dict):
            return Outcome(body=doc["ok"])
        if isinstance(doc, dict) and "abort" in doc:
            return Outcome(failure=Failure.from_json(doc["abort"]))
        if isinstance(doc, dict) and "timeout" in doc:
            return Outcome(timeout=Timeout.from_json(doc["timeout"]))
        raise InternalError(f"an outcome read from the store has an unknown form: {text[:200]!r}")


# ---------------------------------------------------------------------------------- save


@dataclass(frozen=True)
class SaveArrival(_Simple):
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
class SaveStart(_Simple):
    """(rank 0 decides) The save's id, its pending directory, the checksum block size every writer uses,
    the incremental base (``base``: {"base", "base_name", "base_sid"} or {}), the per-rank subtrees
    (``per_rank``: paths, or ``None`` when a second round must find them among ``differ``) and every
    rank's FSDP1 payload (``fsdp1``, in rank order)."""

    save_id: str
    pending: str
    block_bytes: int
    base: dict[str, str]
    per_rank: list[list[Any]] | None
    differ: list[str]
    fsdp1: list[str]
    TYPES: ClassVar[dict[str, Any]] = {
        "save_id": str,
        "pending": str,
        "block_bytes": int,
        "base": dict,
        "per_rank": (list, type(None)),
        "differ": list,
        "fsdp1": list,
    }


@dataclass(frozen=True)
class PerRankNodes(_Simple):
    """(every rank, only when the first agreement could not decide) The digest and structure of every
    node of the entries that differ (``nodes``), and, after an FSDP1 exchange, every entry's digest
    (``entries``, else empty)."""

    entries: dict[str, list[str]]
    nodes: dict[str, list[str]]
    TYPES: ClassVar[dict[str, Any]] = {"entries": dict, "nodes": dict}


@dataclass(frozen=True)
class PerRankPaths(_Simple):
    """(rank 0 decides) The smallest subtrees that differ between ranks: each is kept per rank."""

    paths: list[list[Any]]
    TYPES: ClassVar[dict[str, Any]] = {"paths": list}


@dataclass(frozen=True)
class WriteReport(_Simple):
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
class Committed(_Simple):
    """(rank 0, after publishing) The save is committed, with ``save_id`` in its manifest."""

    save_id: str
    TYPES: ClassVar[dict[str, Any]] = {"save_id": str}


# ---------------------------------------------------------------------------------- load


@dataclass(frozen=True)
class Counts(_Simple):
    """(every rank of a load) Its progress counts so far: bytes done and bytes to move (``[done, total]``)."""

    counts: list[int]
    TYPES: ClassVar[dict[str, Any]] = {"counts": list}


# ---------------------------------------------------------------------------------- manager


@dataclass(frozen=True)
class ResumePlan(_Simple):
    """(rank 0 lists the root) The committed checkpoints, newest first ([name, path, step]), and the
    entries skipped with why ([name, path, step, reason])."""

    candidates: list[list[Any]]
    skipped: list[list[Any]]
    TYPES: ClassVar[dict[str, Any]] = {"candidates": list, "skipped": list}


@dataclass(frozen=True)
class Attempt(_Simple):
    """(every rank) How one step of resuming from a candidate went on this rank: ``ok``, else whether
    the checkpoint is ``damaged`` (then an older one is tried) and the ``error``."""

    ok: bool
    damaged: bool
    error: str
    TYPES: ClassVar[dict[str, Any]] = {"ok": bool, "damaged": bool, "error": str}


@dataclass(frozen=True)
class Attempts(_Simple):
    """(rank 0 decides) Every rank's :class:`Attempt`, in rank order."""

    attempts: list[dict[str, Any]]
    TYPES: ClassVar[dict[str, Any]] = {"attempts": list}


@dataclass(frozen=True)
class Decision(_Simple):
    """(rank 0 decides alone) A value rank 0 chooses for every rank (a manager's per-step decision)."""

    value: str
    TYPES: ClassVar[dict[str, Any]] = {"value": str}
