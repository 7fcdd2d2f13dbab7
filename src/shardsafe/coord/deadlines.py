"""How long each kind of cross-rank wait may take: the ``timeout=`` of every save, load and barrier."""

from __future__ import annotations

from dataclasses import dataclass

from shardsafe import knobs
from shardsafe.errors import InvalidArgumentError


@dataclass(frozen=True, kw_only=True)
class Deadlines:
    """Seconds each kind of wait may take."""

    arrive: float
    """Waiting for every rank to reach an operation or barrier (catches the ``if rank == 0:`` guard)."""
    io: float
    """Waiting for the slowest rank's data writes or reads, and for the commit."""

    def __post_init__(self) -> None:
        for name in ("arrive", "io"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidArgumentError(f"Deadlines.{name}={value!r} must be a positive number of seconds")

    @staticmethod
    def resolve(timeout: float | Deadlines | None) -> Deadlines:
        """``timeout=`` argument, else ``SHARDSAFE_TIMEOUT`` / ``SHARDSAFE_IO_TIMEOUT``, else defaults."""
        if isinstance(timeout, Deadlines):
            return timeout
        if timeout is None:
            return Deadlines(arrive=knobs.arrive_timeout(), io=knobs.io_timeout())
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout={timeout!r} must be a positive number of seconds, or None")
        return Deadlines(arrive=float(timeout), io=float(timeout))
