"""The typed messages of the protocol engine: the base every message that crosses ranks derives from
(:class:`Message`), and the envelopes the engine itself sends (:class:`Arrival`, :class:`Envelope`,
:class:`Outcome`, :class:`Timeout`, :class:`Empty`, :class:`Decision`).

A message is a frozen dataclass deriving from :class:`Message`, with ``TYPES`` naming the type of each
field: a JSON type (or a tuple of them), another :class:`Message` class (a nested record), or
:func:`list_of` / :func:`dict_of` / :func:`optional` one. ``to_json()`` gives a JSON-able value and
``from_json()`` checks every field, nested ones included: a message of another shape (another
shardsafe version on some rank, a bug) raises :class:`~shardsafe.errors.InternalError` naming the
field, never a ``KeyError`` three calls later.

The messages of the save and the load are the engine's (``engine/messages.py``), those of resume and
the local tier the manager's (``manager/messages.py``): each layer declares its own rounds and message
types (:mod:`shardsafe.coord.rounds`); this package knows none of them."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from shardsafe.coord.failures import Failure
from shardsafe.errors import InternalError

B = TypeVar("B", bound="Message")


@dataclass(frozen=True)
class _ListOf:
    item: type[Message]


@dataclass(frozen=True)
class _DictOf:
    item: type[Message]


@dataclass(frozen=True)
class _Optional:
    item: type[Message]


def list_of(item: type[Message]) -> Any:
    """The ``TYPES`` entry of a field holding a list of ``item`` records."""
    return _ListOf(item)


def dict_of(item: type[Message]) -> Any:
    """The ``TYPES`` entry of a field holding a dict of str to ``item`` records."""
    return _DictOf(item)


def optional(item: type[Message]) -> Any:
    """The ``TYPES`` entry of a field holding an ``item`` record or ``None``."""
    return _Optional(item)


def _bad(cls: type, name: str, value: Any, want: Any) -> InternalError:
    return InternalError(
        f"a {cls.__name__} message from another rank has {name}={value!r:.80} (expected {want}); are all "
        "ranks running the same shardsafe version?"
    )


def _decode(cls: type, name: str, value: Any, want: Any) -> Any:
    if isinstance(want, _ListOf):
        if not isinstance(value, list):
            raise _bad(cls, name, value, "a list")
        return [want.item.from_json(v) for v in value]
    if isinstance(want, _DictOf):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _bad(cls, name, value, "an object")
        return {k: want.item.from_json(v) for k, v in value.items()}
    if isinstance(want, _Optional):
        return None if value is None else want.item.from_json(value)
    if isinstance(want, type) and issubclass(want, Message):
        return want.from_json(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise _bad(cls, name, value, want)
    return value


def _check(cls: type, doc: Any, types: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as the keyword arguments of ``cls``, each of the type in ``types``; raises
    :class:`InternalError` naming the first field that is not."""
    if not isinstance(doc, dict):
        raise InternalError(f"a {cls.__name__} message from another rank is not an object: {doc!r:.200}")
    out = {}
    for name, want in types.items():
        if name not in doc:
            raise InternalError(f"a {cls.__name__} message from another rank lacks {name!r}: {doc!r:.200}")
        out[name] = _decode(cls, name, doc[name], want)
    return out


def _encode(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_json()
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


class Message:
    """A typed message: a frozen dataclass whose fields have the types in ``TYPES`` (module docstring)."""

    TYPES: ClassVar[dict[str, Any]] = {}

    def to_json(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[B], doc: Any) -> B:
        return cls(**_check(cls, doc, cls.TYPES))

    def to_text(self) -> str:
        return json.dumps(self.to_json(), allow_nan=True, separators=(",", ":"))

    @classmethod
    def from_text(cls: type[B], text: str) -> B:
        try:
            doc = json.loads(text)
        except ValueError as err:
            raise InternalError(f"a {cls.__name__} read from the store is not JSON ({err}): {text[:200]!r}") from None
        return cls.from_json(doc)


@dataclass(frozen=True)
class Empty(Message):
    """The message of a round in which a rank has nothing to say but that it is there, and the decision
    of a round whose outcome is only that every rank got there."""


@dataclass(frozen=True)
class Decision(Message):
    """A value rank 0 chooses alone for every rank (:class:`~shardsafe.coord.broadcast.Broadcast`)."""

    value: str
    TYPES: ClassVar[dict[str, Any]] = {"value": str}


# ---------------------------------------------------------------------------------- envelopes


@dataclass(frozen=True)
class Arrival(Message):
    """Who calls what, from where: sent in the first agreement of every operation, compared by the
    leader (ranks doing different things are out of step)."""

    op: str
    target: str
    site: str
    host: str
    pid: int
    oldest_open: int = 0
    """The oldest operation of the channel the rank still has open (its keys must stay)."""
    TYPES: ClassVar[dict[str, Any]] = {
        "op": str,
        "target": str,
        "site": str,
        "host": str,
        "pid": int,
        "oldest_open": int,
    }


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
