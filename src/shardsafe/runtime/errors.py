r"""The runtime's errors (both :class:`~shardsafe.errors.CheckpointError`\ s, so ``except CheckpointError``
catches them, each in one remedy group of :mod:`shardsafe.errors`) and the carrier of a worker's
traceback. They are the only public errors defined outside :mod:`shardsafe.errors`: they belong to the
runtime, which ``import shardsafe`` does not load and whose names stay off the top level; import them
from :mod:`shardsafe.runtime`."""

from __future__ import annotations

from shardsafe.errors import RetryableError, UsageError


class LaunchError(UsageError, RuntimeError):
    """The runtime was used in a way that cannot work (e.g. ``launch()`` twice, ``setup()`` before
    ``launch()``, a world size that disagrees with torchrun's). Raised at once, never after a hang."""


class WorkerError(RetryableError, RuntimeError):
    """A worker process failed and its own exception could not be carried over (it died without
    reporting, e.g. ``os._exit``, SIGKILL or a crash, or its exception could not be unpickled)."""

    def __init__(self, message: str, *, rank: int, exitcode: int | None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as ``__cause__`` of the exception the
    parent re-raises, so the worker's stack shows above the parent's. Never raised: a carrier of text,
    hence no :class:`~shardsafe.errors.CheckpointError` and no remedy group."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(rank, text)
        self.rank = rank
        self.text = text

    def __str__(self) -> str:
        return f"\n\nraised on rank {self.rank}:\n{self.text.rstrip()}"
