"""The progress of a save, load, verify or export: the :class:`Progress` record handed to ``progress=``,
its plain description (:class:`~shardsafe.progress.tracker.Tracker` does the counting, sharing and
reporting; :func:`~shardsafe.engine.plan.file_bytes` and :func:`~shardsafe.engine.read.load_bytes` give an
operation's totals).

Bytes counted: a save counts the bytes of this rank's data file as they are handed to storage (the
safetensors header, then every window of data); its total is the file's size, so the final
``total_bytes`` of a save is the size of all its data files. A load counts the verified bytes it
delivers into the state; its total is what this rank's reads need (a tensor replicated on N ranks
counts N times: every rank reads it). A verify counts the bytes it checks (data file headers and the
chunks the manifest lists in them); an export the bytes it writes (``torch`` format: reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardsafe.display import binary_size
from shardsafe.errors import InvalidTypeError


@dataclass(frozen=True, kw_only=True)
class Progress:
    """Where a save or load stands, all ranks together, as rank 0 sees it (other ranks' counts are at
    most ``SHARDSAFE_PROGRESS_INTERVAL`` seconds old). Passed to ``progress=`` of
    :func:`shardsafe.save`, :func:`shardsafe.async_save` and :func:`shardsafe.load`, and of the
    one-process :func:`shardsafe.verify` and exports (``ranks == 1``)."""

    op: str
    """``"save"``, ``"load"``, ``"verify"`` or ``"export"``."""
    path: str
    """The checkpoint saved or loaded."""
    phase: str
    """Rank 0's phase (e.g. ``plan``, ``write``, ``commit``, ``read``, ``restore``); ``done`` in the
    final record of an operation that succeeded."""
    done_bytes: int
    """Bytes written (save, export) or read and verified (load, verify) so far, by all ranks together.
    Never decreases."""
    total_bytes: int
    """Bytes the operation moves, all ranks together; final once ``ranks_reporting == ranks`` (a rank
    posts its total as soon as it has planned)."""
    seconds: float
    """Seconds since the operation started on rank 0."""
    ranks: int
    """Ranks taking part."""
    ranks_reporting: int
    """Ranks whose counts rank 0 has seen."""
    slowest_rank: int
    """The rank with the smallest done fraction (a rank not heard from yet counts as 0)."""
    slowest_fraction: float
    """That rank's done fraction, 0.0 to 1.0."""
    finished: bool = False
    """True in the last record of the operation (exactly one, after it committed, loaded or failed)."""
    error: str | None = None
    """In a final record of an operation that failed: the error, one line."""

    @property
    def fraction(self) -> float:
        """``done_bytes / total_bytes`` (1.0 when there is nothing to move)."""
        return 1.0 if self.total_bytes == 0 else min(1.0, self.done_bytes / self.total_bytes)

    @property
    def bytes_per_second(self) -> float:
        """Average throughput since the operation started."""
        return self.done_bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Estimated seconds left at the average throughput; ``None`` before any byte moved."""
        if self.finished:
            return 0.0
        rate = self.bytes_per_second
        return None if rate <= 0 else max(0, self.total_bytes - self.done_bytes) / rate


ProgressCallback = Callable[[Progress], object]


def check_callback(progress: object) -> ProgressCallback | None:
    """(every rank, before anything else) ``progress=`` as given, or ``TypeError`` if not callable."""
    if progress is not None and not callable(progress):
        raise InvalidTypeError(f"progress={progress!r} must be a callable taking a shardsafe.Progress record, or None")
    return progress  # type: ignore[return-value]


def describe(p: Progress) -> str:
    """One plain line with a record's figures (the INFO line, and the progress bar off a terminal)."""
    head = f"{p.op} of {p.path}: phase {p.phase}, {binary_size(p.done_bytes)} of {binary_size(p.total_bytes)}"
    line = f"{head} ({100 * p.fraction:.0f}%) in {p.seconds:.1f}s at {binary_size(p.bytes_per_second)}/s"
    if p.finished:
        return line + (f"; FAILED: {p.error}" if p.error else "; finished")
    eta = p.eta_seconds
    line += ", time left unknown" if eta is None else f", about {eta:.0f}s left"
    if p.ranks > 1:
        line += f"; slowest rank {p.slowest_rank} at {100 * p.slowest_fraction:.0f}%"
        if p.ranks_reporting < p.ranks:
            line += f" ({p.ranks - p.ranks_reporting} rank(s) not heard from yet)"
    return line
