"""The exceptions shardsafe raises, all of them defined here. Every error shardsafe raises on purpose
derives from :class:`CheckpointError` (an ``Exception``), and each also derives from the builtin it
refines, so ``except FileNotFoundError`` or ``except ValueError`` keeps working.

The bottom layer: this module imports nothing of shardsafe, and any module may import it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class CheckpointError(Exception):
    """Base class of every error shardsafe raises on purpose."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The target already holds a committed checkpoint and ``overwrite=False``."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the path (nothing there, or only an uncommitted save)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes or manifest fail validation: checksum mismatch, truncation, hostile names."""


class MissingKeysError(CheckpointError, KeyError):
    """Keys requested from a checkpoint are not in it (``strict=True``)."""

    def __init__(self, message: str, missing: Sequence[str], available: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.missing = list(missing)
        self.available = list(available)

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return self.message


class UnsafeValueError(CheckpointError, TypeError):
    """A value cannot be stored without pickle (or a loader met a pickled value it did not opt in to)."""


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument, a configuration field or a ``SHARDSAFE_`` environment variable has a value that
    cannot work; the message names it and says what to give instead. Raised before anything changes."""


class InvalidTypeError(CheckpointError, TypeError):
    """An argument or a configuration field has the wrong type; the message names it and the type
    expected. Raised before anything changes."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A deadline passed: every timeout shardsafe raises is one of these (also a builtin
    ``TimeoutError``, hence an ``OSError``). Raised as it is for storage that did not answer in time (a
    hung disk, a black-holed object store); its subclasses name what else was waited for."""


class OperationTimeoutError(CheckpointTimeoutError):
    """:meth:`SaveHandle.wait` ran out of its ``timeout`` while the save is still running (call it
    again). Waits on other ranks raise :class:`RankTimeoutError`."""


class StateMismatchError(CheckpointError, ValueError):
    """The state passed to ``load`` does not match the checkpoint: a tensor's shape or dtype, or the
    structure of an entry (a module's parameters, an optimizer's groups). Raised before anything changes."""


class TornSnapshotError(CheckpointError):
    """An asynchronous save with ``staging="background"`` found a tensor changed after the call and before
    its copy (its version counter or its first bytes moved, or its memory was freed or replaced), or an
    optimizer that stepped past the save's deadline before its tensors were copied: the save fails on
    every rank rather than write a checkpoint that mixes values from before and after the change. Names
    the tensor or optimizer, the rank and the fix; nothing is committed and the previous checkpoint at
    the path stays loadable."""


class InternalError(CheckpointError, RuntimeError):
    """An invariant of shardsafe itself was broken: a bug. Please report it with the message."""


class ClosedError(CheckpointError, RuntimeError):
    """An object was used after it was closed (e.g. a closed :class:`CheckpointManager`)."""


class RemoteIOError(CheckpointError, OSError):
    """A storage request still failed after retrying until its deadline."""


class StorageError(CheckpointError, OSError):
    """The storage refused an operation (disk full, permission denied, read-only file system, a path
    that is a file): the ``errno`` and ``filename`` of the original ``OSError`` are kept, and the error
    raised is also an instance of that ``OSError``'s own class (``except PermissionError`` keeps
    working). The original is chained as the cause."""


class CoordinationError(CheckpointError):
    """Ranks could not agree: base class of the errors of the cross-rank protocol."""


class RankTimeoutError(CoordinationError, CheckpointTimeoutError):
    """A deadline passed while waiting for other ranks; names the ranks that never arrived."""

    def __init__(self, message: str, missing_ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = sorted(missing_ranks)


class RemoteRankError(CoordinationError):
    """Another rank failed; carries its rank, the phase, its original message (``cause``) and the name of
    the class it raised (``kind``). Where that class is a shardsafe error, the instance raised on the
    other ranks is also an instance of it (``except CheckpointNotFoundError`` works on every rank)."""

    def __init__(self, message: str, rank: int, phase: str, cause: str, kind: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.phase = phase
        self.cause = cause
        self.kind = kind


class RankDesyncError(CoordinationError):
    """Ranks reached the same rendezvous doing different things (other operation, path or call site)."""


class RankDeadError(CoordinationError):
    """A rank stopped responding (its heartbeat stopped), or the rendezvous store became unreachable,
    which means the process hosting it (rank 0 or the launcher) has died: ``store_lost`` says which."""

    def __init__(self, message: str, *, store_lost: bool = False) -> None:
        super().__init__(message)
        self.store_lost = store_lost


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ClosedError",
    "CoordinationError",
    "CorruptCheckpointError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "MissingKeysError",
    "OperationTimeoutError",
    "RankDeadError",
    "RankDesyncError",
    "RankTimeoutError",
    "RemoteIOError",
    "RemoteRankError",
    "StateMismatchError",
    "StorageError",
    "TornSnapshotError",
    "UnsafeValueError",
]
