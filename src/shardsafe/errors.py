"""The exceptions shardsafe raises, all of them defined here. Every error shardsafe raises on purpose
derives from :class:`CheckpointError` (an ``Exception``), and each also derives from the builtin it
refines, so ``except FileNotFoundError`` or ``except ValueError`` keeps working.

The set is closed and grouped by what the caller can do (the remedy): every class below is a subclass
of exactly one of :class:`UsageError` (fix the call, the state or the environment; nothing changed),
:class:`UnusableCheckpointError` (this checkpoint cannot be read as it is: use another one),
:class:`RetryableError` (retry or restart; the previous checkpoint is intact) and
:class:`InternalError` (a bug: report it). Two bases cut across the groups: :class:`CoordinationError`
(the cross-rank protocol's errors, whatever their remedy) and :class:`RemoteRankError` (another rank
failed: it is also an instance of the class that rank raised, hence of that class's group).

The bottom layer: this module imports nothing of shardsafe, and any module may import it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class CheckpointError(Exception):
    """Base class of every error shardsafe raises on purpose."""


# ------------------------------------------------------------------------------- the remedy groups


class UsageError(CheckpointError):
    """Fix the call, the state passed or the environment, then call again: nothing was changed (a save
    committed nothing, the previous checkpoint is intact)."""


class UnusableCheckpointError(CheckpointError):
    """The checkpoint (or the file being imported) cannot be read as it is: it is not there, damaged,
    hostile, or in a form shardsafe does not read. Use another checkpoint (an older one, or re-export it)."""


class RetryableError(CheckpointError):
    """The operation failed for a cause outside the call (storage, network, another rank, a deadline, a
    tensor changed under a background save): retry it, or restart the job, once the cause named is gone.
    A failed save committed nothing and the previous checkpoint at the path is intact."""


class InternalError(CheckpointError, RuntimeError):
    """An invariant of shardsafe itself was broken: a bug. Please report it with the message."""


# ------------------------------------------------------------------------------- the classes


class CheckpointExistsError(UsageError, FileExistsError):
    """The target already holds a committed checkpoint and ``overwrite=False``."""


class CheckpointNotFoundError(UnusableCheckpointError, FileNotFoundError):
    """No committed checkpoint at the path (nothing there, or only an uncommitted save)."""


class CorruptCheckpointError(UnusableCheckpointError):
    """A checkpoint's bytes or manifest fail validation: checksum mismatch, truncation, hostile names."""


class MissingKeysError(UsageError, KeyError):
    """Keys requested from a checkpoint are not in it (``strict=True``)."""

    def __init__(self, message: str, missing: Sequence[str], available: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.missing = list(missing)
        self.available = list(available)

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return self.message


class UnsafeValueError(UsageError, TypeError):
    """A value cannot be stored without pickle (or a loader met a pickled value it did not opt in to)."""


class InvalidArgumentError(UsageError, ValueError):
    """An argument, a configuration field or a ``SHARDSAFE_`` environment variable has a value that
    cannot work; the message names it and says what to give instead. Raised before anything changes."""


class InvalidTypeError(UsageError, TypeError):
    """An argument or a configuration field has the wrong type; the message names it and the type
    expected. Raised before anything changes."""


class CheckpointTimeoutError(RetryableError, TimeoutError):
    """A deadline passed: every timeout shardsafe raises is one of these (also a builtin
    ``TimeoutError``, hence an ``OSError``). Raised as it is for storage that did not answer in time (a
    hung disk, a black-holed object store); its subclasses name what else was waited for."""


class OperationTimeoutError(CheckpointTimeoutError):
    """:meth:`SaveHandle.wait` ran out of its ``timeout`` while the save is still running (call it
    again). Waits on other ranks raise :class:`RankTimeoutError`."""


class StateMismatchError(UsageError, ValueError):
    """The state passed to ``load`` does not match the checkpoint: a tensor's shape or dtype, or the
    structure of an entry (a module's parameters, an optimizer's groups). Raised before anything changes."""


class TornSnapshotError(RetryableError):
    """An asynchronous save with ``staging="background"`` found a tensor changed after the call and before
    its copy (its version counter or its first bytes moved, or its memory was freed or replaced), or an
    optimizer that stepped past the save's deadline before its tensors were copied: the save fails on
    every rank rather than write a checkpoint that mixes values from before and after the change. Names
    the tensor or optimizer, the rank and the fix; nothing is committed and the previous checkpoint at
    the path stays loadable."""


class ClosedError(UsageError, RuntimeError):
    """An object was used after it was closed (e.g. a closed :class:`CheckpointManager`)."""


class RemoteIOError(RetryableError, OSError):
    """A storage request still failed after retrying until its deadline."""


class StorageError(RetryableError, OSError):
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


class RankDesyncError(CoordinationError, UsageError):
    """Ranks reached the same rendezvous doing different things (other operation, path or call site)."""


class RankDeadError(CoordinationError, RetryableError):
    """A rank stopped responding (its heartbeat stopped), or the rendezvous store became unreachable,
    which means the process hosting it (rank 0 or the launcher) has died: ``store_lost`` says which."""

    def __init__(self, message: str, *, store_lost: bool = False) -> None:
        super().__init__(message)
        self.store_lost = store_lost


class InvalidCallError(UsageError):
    """A call made where it cannot work: an import inside a distributed job, a Lightning strategy with no
    model, ``load_raw`` of a checkpoint of several modules, an FSDP1 save inside forward or backward. The
    message says where to make it instead."""


class InconsistentRanksError(UsageError):
    """The ranks passed different states to the same save (other keys, shapes, dtypes or settings, or
    replicated tensors whose values differ): every rank must save the same structure. Nothing is committed."""


class UnsafePathError(UsageError):
    """A path shardsafe would read, write or delete through is a symbolic link, a FIFO, a device or
    otherwise not the regular file or folder expected: refused, nothing was read or changed. Move it away."""


class MissingPackageError(UsageError):
    """The operation needs a Python module this environment cannot import (numpy, or a package a
    pickled value names): install the package the message names and call again."""


class InsufficientMemoryError(UsageError):
    """The operation needs more memory than this process has available (the message says how much):
    load into tensors that already exist (filled in place), or run on a machine with more memory."""


class BaseRefusedError(UsageError, ValueError):
    """``base=`` names no usable base for this save, or the base changed while the save used it (raised on
    every rank from rank 0's check): give another base, or none."""


class UnsupportedCheckpointError(UnusableCheckpointError):
    """A file in a form shardsafe does not read (the tar format of torch < 0.4, a DCP item stored
    transformed, sparse or device tensors, values nested too deep or holding themselves): convert it with
    the tool that wrote it (the message says how), then import again."""


class UnforeseenError(RetryableError):
    """A failure shardsafe did not foresee, raised with the original exception chained as its cause and
    the operation, path, rank and phase in the message: nothing was committed. Fix the cause and retry; if
    the cause is shardsafe's own, please report it."""


class CommitFailedError(RetryableError):
    """Rank 0 could not publish a save's manifest: nothing was committed, or (where the message says so) the
    publish may still complete if the storage recovers. The previous checkpoint is unchanged: check the
    storage, then save again."""


class LocalTierError(RetryableError):
    """The local tier (node-local copies and their replication between nodes) failed: a transfer between
    ranks, a copy that did not verify, or its run record. The durable checkpoint is intact: restart, or
    save again."""


REMEDY_GROUPS: tuple[type[CheckpointError], ...] = (UsageError, UnusableCheckpointError, RetryableError, InternalError)
"""The closed set of remedies: every error class shardsafe raises is a subclass of exactly one of these
(:class:`CheckpointError`, :class:`CoordinationError` and :class:`RemoteRankError` cut across them).
The runtime's :class:`~shardsafe.runtime.LaunchError` (a :class:`UsageError`) and
:class:`~shardsafe.runtime.WorkerError` (a :class:`RetryableError`) are defined in
:mod:`shardsafe.runtime.errors`: the runtime is a subpackage ``import shardsafe`` does not load, and its
names stay off the top level."""


__all__ = [
    "BaseRefusedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ClosedError",
    "CommitFailedError",
    "CoordinationError",
    "CorruptCheckpointError",
    "InconsistentRanksError",
    "InsufficientMemoryError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidCallError",
    "InvalidTypeError",
    "LocalTierError",
    "MissingKeysError",
    "MissingPackageError",
    "OperationTimeoutError",
    "RankDeadError",
    "RankDesyncError",
    "RankTimeoutError",
    "RemoteIOError",
    "RemoteRankError",
    "RetryableError",
    "StateMismatchError",
    "StorageError",
    "TornSnapshotError",
    "UnforeseenError",
    "UnsafePathError",
    "UnsafeValueError",
    "UnsupportedCheckpointError",
    "UnusableCheckpointError",
    "UsageError",
]
