"""The last line of the read side: whatever escapes a public entry point (``load``, ``verify``,
``inspect``, ``ls``, the manager's resume) reaches the caller as a :class:`CheckpointError` naming the
operation and path, with the original exception chained as its cause. Validation raises
:class:`CorruptCheckpointError` itself; this catches what nobody foresaw, so that callers (and the
CLI) need only ``except CheckpointError``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shardsafe.errors import CheckpointError, CorruptCheckpointError

_DAMAGE = (EOFError, FileNotFoundError, IsADirectoryError, NotADirectoryError)
"""Escaping a read of a committed checkpoint, these mean one of its files is missing or cut short."""


@contextmanager
def mapped_errors(operation: str, path: str) -> Iterator[None]:
    """(any rank) Re-raise anything but a :class:`CheckpointError` (and ``BaseException``\\ s such as
    ``KeyboardInterrupt``) as one, ``raise ... from`` the original."""
    try:
        yield
    except CheckpointError:
        raise
    except _DAMAGE as err:
        raise CorruptCheckpointError(
            f"{operation} of {path!r}: a file of the checkpoint is missing or truncated ({type(err).__name__}: {err}). "
            "Load an older checkpoint."
        ) from err
    except Exception as err:
        raise CheckpointError(
            f"{operation} of {path!r} failed unexpectedly: {type(err).__name__}: {err}. The checkpoint may be "
            "damaged or hostile, or the state may not match it; the cause is chained."
        ) from err
