"""The carrier of a worker's traceback. The runtime's errors (:class:`~shardsafe.errors.LaunchError`,
:class:`~shardsafe.errors.WorkerError`) live in :mod:`shardsafe.errors` with every other error."""

from __future__ import annotations


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as ``__cause__`` of the exception the
    parent re-raises, so the worker's stack shows above the parent's."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(rank, text)
        self.rank = rank
        self.text = text

    def __str__(self) -> str:
        return f"\n\nraised on rank {self.rank}:\n{self.text.rstrip()}"
