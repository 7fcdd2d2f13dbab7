"""Failures that cross ranks and keep their kind.

A rank that fails sends a :class:`Failure` (its rank, the phase, the class it raised, the message and
the fields that class carries) in place of its message in the next agreement; a leader whose decision
is a refusal sends one as the result. Every rank then raises :func:`error_for` of the same record:

- the rank that failed raises its own error (a foreign one wrapped into an :class:`UnforeseenError`, or
  a :class:`CheckpointTimeoutError` for a builtin ``TimeoutError``, naming the operation, the rank and
  the phase, chained to the original);
- a failure *decided for everyone* (a refused target, a missing base, a damaged checkpoint, a listing
  that failed on the leader, ranks out of step) raises that class on every rank, with the same
  message: as it is where it is about the ranks themselves (out of step, dead, timed out), else as a
  :class:`RemoteRankError` naming the deciding rank that is also an instance of that class;
- the other ranks raise :class:`RemoteRankError` naming the rank, the phase and the original class,
  which is also an instance of that class where it is a shardsafe error (``except
  CheckpointNotFoundError`` works on every rank), and of the class the failing rank wrapped a foreign
  one into where it is not (so every rank's error is in the same remedy group)."""

from __future__ import annotations

import builtins
import functools
from dataclasses import dataclass, field
from typing import Any

from shardsafe import errors
from shardsafe.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    CoordinationError,
    InternalError,
    MissingKeysError,
    RankDeadError,
    RankTimeoutError,
    RemoteRankError,
    UnforeseenError,
)

_PUBLIC: dict[str, type[CheckpointError]] = {
    name: cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, CheckpointError)
}


def _kind(name: str) -> type[CheckpointError] | None:
    """The shardsafe error class called ``name``: one of :mod:`shardsafe.errors`, or another subclass of
    :class:`CheckpointError` defined by shardsafe (``BaseRefusedError``)."""
    if name in _PUBLIC:
        return _PUBLIC[name]
    todo: list[type[CheckpointError]] = [CheckpointError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name and cls.__module__.startswith("shardsafe"):
            return cls
        todo.extend(cls.__subclasses__())
    return None


@dataclass(frozen=True)
class Failure:
    """One failure, as it travels between ranks."""

    rank: int
    phase: str
    kind: str
    """The name of the class raised (``OSError``, ``CheckpointNotFoundError``...)."""
    message: str
    decided: bool = False
    """The outcome for everyone (every rank raises ``kind``), not one rank's own failure."""
    fields: dict[str, Any] = field(default_factory=dict)
    """What the class carries beyond its message: ``missing``/``available`` (MissingKeysError),
    ``missing_ranks`` (RankTimeoutError), ``store_lost`` (RankDeadError)."""

    @staticmethod
    def of(err: BaseException, *, rank: int, phase: str, decided: bool = False) -> Failure:
        """The record of ``err``, raised on ``rank`` in ``phase``."""
        fields: dict[str, Any] = {}
        if isinstance(err, MissingKeysError):
            fields = {"missing": list(err.missing), "available": list(err.available)}
        elif isinstance(err, RankTimeoutError):
            fields = {"missing_ranks": list(err.missing_ranks)}
        elif isinstance(err, RankDeadError):
            fields = {"store_lost": err.store_lost}
        if isinstance(err, RemoteRankError):  # passed on: keep the original rank, phase and kind
            return Failure(err.rank, err.phase, err.kind or "RemoteRankError", err.cause, decided, fields)
        message = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
        return Failure(rank, phase, _kind_name(err), message, decided, fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "phase": self.phase,
            "kind": self.kind,
            "message": self.message,
            "decided": self.decided,
            "fields": self.fields,
        }

    @staticmethod
    def from_json(doc: Any) -> Failure:
        try:
            rank, phase, kind, message = doc["rank"], doc["phase"], doc["kind"], doc["message"]
            decided, fields = doc.get("decided", False), doc.get("fields", {})
        except (KeyError, TypeError) as err:
            raise InternalError(f"a failure record from another rank is malformed ({err}): {doc!r:.300}") from None
        ok = (
            type(rank) is int
            and all(isinstance(x, str) for x in (phase, kind, message))
            and isinstance(decided, bool)
            and isinstance(fields, dict)
        )
        if not ok:
            raise InternalError(f"a failure record from another rank is malformed: {doc!r:.300}")
        return Failure(rank, phase, kind, message, decided, fields)


def _kind_name(err: BaseException) -> str:
    """The class to name: a shardsafe class as it is; the remote mixins by the class they stand for."""
    if isinstance(err, RemoteRankError) and err.kind:
        return err.kind
    return type(err).__name__


@functools.cache
def _remote_class(kind: str) -> type[RemoteRankError]:
    """:class:`RemoteRankError` that is also an instance of the shardsafe class ``kind``, or, for a
    foreign class, of the class :func:`wrap` turns it into on the rank that raised it."""
    base = _kind(kind)
    if base is None:
        foreign = getattr(builtins, kind, None)
        timeout = isinstance(foreign, type) and issubclass(foreign, TimeoutError)
        base = CheckpointTimeoutError if timeout else UnforeseenError
    if issubclass(RemoteRankError, base) or issubclass(base, CoordinationError):
        return RemoteRankError
    # Named like its first base (tracebacks and logs say RemoteRankError); ``kind`` says which class it stands for.
    return type(
        "RemoteRankError",
        (RemoteRankError, base),
        {"__module__": "shardsafe.errors", "__qualname__": f"RemoteRankError[{kind}]"},
    )


def _instance(cls: type[CheckpointError], message: str, fields: dict[str, Any]) -> CheckpointError:
    """An instance of ``cls`` with ``message`` and the fields its constructor takes."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    if isinstance(err, MissingKeysError):
        err.message = message
        err.missing = list(fields.get("missing", []))
        err.available = list(fields.get("available", []))
    if isinstance(err, RankTimeoutError):
        err.missing_ranks = sorted(fields.get("missing_ranks", []))
    if isinstance(err, RankDeadError):
        err.store_lost = bool(fields.get("store_lost", False))
    return err


def error_for(record: Failure, *, rank: int, op: str, target: str, own: BaseException | None = None) -> BaseException:
    """What ``rank`` raises for ``record`` (see the module docstring). ``own``: this rank's own error,
    when the record is its own failure."""
    if own is not None and record.rank == rank and not record.decided:
        return wrap(own, op=op, target=target, rank=rank, phase=record.phase)
    cls = _kind(record.kind)
    if record.decided and cls is not None:
        if own is not None and type(own) is cls:
            return own
        if issubclass(cls, CoordinationError) or record.rank == rank:  # about the ranks themselves: as it is
            return _instance(cls, record.message, record.fields)
        # decided by that rank for all: its kind, as the remote error of that rank
    if record.rank == rank and cls is not None:  # declared dead or timed out by another rank, about this one
        return _instance(cls, record.message, record.fields)
    if record.kind == "RankDeadError":
        return RankDeadError(record.message, store_lost=bool(record.fields.get("store_lost", False)))
    if record.kind == "RankTimeoutError":
        return RankTimeoutError(record.message, missing_ranks=record.fields.get("missing_ranks", []))
    cause = record.message.rstrip(".")
    remote = _remote_class(record.kind)
    err: RemoteRankError = remote.__new__(remote)
    message = (
        f"{op} of {target!r} failed on rank {record.rank} in phase {record.phase!r}: {cause}. Nothing was "
        f"committed by this {op}; fix the cause on rank {record.rank} and retry."
        if op in ("save", "async_save")
        else f"{op} of {target!r} failed on rank {record.rank} in phase {record.phase!r}: {cause}."
    )
    Exception.__init__(err, message)
    err.rank, err.phase, err.cause, err.kind = record.rank, record.phase, record.message, record.kind
    if isinstance(err, RankTimeoutError):
        err.missing_ranks = sorted(record.fields.get("missing_ranks", []))
    if isinstance(err, MissingKeysError):
        err.message = message
        err.missing = list(record.fields.get("missing", []))
        err.available = list(record.fields.get("available", []))
    return err


def wrap(err: BaseException, *, op: str, target: str, rank: int, phase: str) -> BaseException:
    """``err`` as this rank raises it: a shardsafe error or a ``BaseException`` that is not an
    ``Exception`` (``KeyboardInterrupt``) as it is, anything else as a :class:`CheckpointError` naming
    the operation, rank and phase (the caller chains the original)."""
    if isinstance(err, CheckpointError) or not isinstance(err, Exception):
        return err
    tail = (
        "Nothing was committed; the previous checkpoint (if any) is untouched. Fix the cause and save again."
        if op in ("save", "async_save")
        else "Fix the cause and retry."
    )
    wrapped = (CheckpointTimeoutError if isinstance(err, TimeoutError) else UnforeseenError)(
        f"{op} of {target!r} failed on rank {rank} in phase {phase!r}: {type(err).__name__}: {err}. {tail}"
    )
    wrapped.__cause__ = err
    return wrapped
