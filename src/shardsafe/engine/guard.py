"""The last line of every public entry point: whatever escapes it reaches the caller as a
:class:`CheckpointError` naming the operation and path, with the original exception chained as its
cause (:func:`entry_point`, the decorator every public function and manager method wears;
:func:`mapped_errors` for a block inside one). Validation raises :class:`CorruptCheckpointError` itself
and the protocol raises its own errors; this catches what nobody foresaw, so that callers (and the
CLI) need only ``except CheckpointError``."""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from shardsafe.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    MissingPackageError,
    StorageError,
    UnforeseenError,
)

_DAMAGE = (EOFError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
"""Escaping a read of a committed checkpoint, these mean one of its files is missing or cut short."""


@contextmanager
def mapped_errors(operation: str, path: str, *, reads: bool = True) -> Iterator[None]:
    """(any rank) Re-raise anything but a :class:`CheckpointError` (and ``BaseException``\\ s such as
    ``KeyboardInterrupt``) as one (:func:`mapped`), ``raise ... from`` the original."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:
        raise mapped(operation, path, err, reads=reads) from err


def mapped(operation: str, path: str, err: Exception, *, reads: bool) -> CheckpointError:
    """The :class:`CheckpointError` an unforeseen ``err`` becomes: with ``reads`` (a read of a committed
    checkpoint), a missing or truncated file is damage (:class:`CorruptCheckpointError`); a builtin
    ``ValueError`` or ``TypeError`` stays one (as the misuse errors are), so ``except ValueError`` keeps
    working for a caller that passed a bad argument no check foresaw; a builtin ``TimeoutError`` a
    :class:`CheckpointTimeoutError`; anything else an :class:`UnforeseenError`."""
    if reads and isinstance(err, _DAMAGE):
        return CorruptCheckpointError(
            f"{operation} of {path!r}: a file of the checkpoint is missing or truncated ({type(err).__name__}: "
            f"{err}). Load an older checkpoint."
        )
    if isinstance(err, OSError) and not isinstance(err, TimeoutError) and err.errno is not None:
        return _storage_error(operation, path, err)
    if isinstance(err, TimeoutError):  # every timeout that reaches a caller is a CheckpointTimeoutError
        return CheckpointTimeoutError(
            f"{operation} of {path!r}: a deadline passed ({type(err).__name__}: {err}). The storage or another "
            "rank did not answer in time. Retry, or raise timeout= if it is merely slow."
        )
    if isinstance(err, ImportError):  # a package missing here is never damage, whatever else is said
        return MissingPackageError(
            f"{operation} of {path!r} needs the module {err.name or str(err)[:100]!r}, which this Python cannot "
            f"import ({type(err).__name__}: {err}). Install the package that provides it and try again."
        )
    kind = (
        InvalidArgumentError
        if isinstance(err, ValueError)
        else InvalidTypeError
        if isinstance(err, TypeError)
        else UnforeseenError
    )
    return kind(
        f"{operation} of {path!r} failed unexpectedly: {type(err).__name__}: {err}. The checkpoint may be damaged "
        "or hostile, or the state may not match it; the cause is chained. If neither, please report it."
    )


_STORAGE_KINDS: dict[type[OSError], type[StorageError]] = {}
_ADVICE = {
    errno.ENOSPC: "free space there or write elsewhere",
    errno.EDQUOT: "free space within the quota or write elsewhere",
    errno.EACCES: "check the permissions of the path",
    errno.EPERM: "check the permissions of the path",
    errno.EROFS: "the file system is mounted read-only: write elsewhere",
}


def _storage_error(operation: str, path: str, err: OSError) -> StorageError:
    """A :class:`StorageError` that is also an instance of ``err``'s own class (a disk full stays an
    ``OSError`` with ``errno.ENOSPC``, a permission error a ``PermissionError``)."""
    base = type(err)
    kind = _STORAGE_KINDS.get(base)
    if kind is None:
        kind = StorageError if base is OSError else type("StorageError", (StorageError, base), {})
        kind.__module__ = StorageError.__module__
        _STORAGE_KINDS[base] = kind
    advice = _ADVICE.get(err.errno or 0, "check the storage at that path")
    where = f" ({err.filename})" if err.filename else ""
    return kind(err.errno, f"{operation} of {path!r}: {err.strerror or err}{where}: {advice}")


F = TypeVar("F", bound=Callable[..., Any])


def entry_point(operation: str, *, reads: bool) -> Callable[[F], F]:
    """The one wrapper of every public entry point (the checkpoint API, export and import, the manager's
    methods): nothing but a :class:`CheckpointError` leaves it (misuse raises the ``ValueError`` and
    ``TypeError`` subclasses of :mod:`shardsafe.errors`, which are ``CheckpointError``\\ s too), nor a
    ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``). ``reads``: a read of a
    committed checkpoint, where a missing or truncated file means damage (:func:`mapped_errors`). The
    path named in messages is the call's first argument, or the manager's root."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except CheckpointError:
                raise
            except Exception as err:
                raise mapped(operation, _target(args, kwargs), err, reads=reads) from err

        return call  # type: ignore[return-value]

    return wrap


def _target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    first = args[0] if args else next(iter(kwargs.values()), "")
    if isinstance(first, (str, os.PathLike)):
        return os.fspath(first)  # type: ignore[arg-type]
    config = getattr(first, "config", None)  # a manager's method: its root
    return str(getattr(config, "root", ""))
