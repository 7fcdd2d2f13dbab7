"""Preemption: a signal asks for one last checkpoint, and every rank must save it at the same step.

- :class:`SignalFlag` installs handlers that only set a flag (no I/O, no locks: a handler may run
  between any two bytecodes of the training loop) and puts the previous handlers back on
  :meth:`~SignalFlag.restore`.
- :class:`~shardsafe.coord.steps.StopAgreement` (in :mod:`shardsafe.coord`, the only place that
  touches the store) settles the step through the rendezvous store. The first rank to notice its
  flag proposes ``its step + 1`` with ``compare_set`` (first writer wins, so every proposal resolves
  to the same value); every rank checks the key (one cheap ``store.check``) at each ``maybe_save``
  and saves at the first step at or after the agreed one.

Why ``+ 1`` is enough: a rank notices its flag in ``maybe_save(s)``, after the collectives of step
``s``; no other rank can finish step ``s + 1`` (whose collectives need this rank) before the proposal
is in the store. Ranks that do not run in lockstep (no collective per step) could pass the step
before seeing it; the save's rendezvous then fails with a :class:`~shardsafe.RankDesyncError` or
:class:`~shardsafe.RankTimeoutError` naming the ranks, never a hang.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from shardsafe.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalFlag:
    """(each rank, main thread) Handlers for ``signals`` that record the first signal received."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, _Handler] = {}
        if signals and threading.current_thread() is not threading.main_thread():
            names = ", ".join(signal.Signals(s).name for s in signals)
            raise InvalidArgumentError(
                f"CheckpointManager(save_on_signals=({names})) must be created in the main thread (Python "
                "delivers signals only there); create it there, or pass save_on_signals=() and call "
                "save() yourself on preemption"
            )
        try:
            for sig in map(signal.Signals, signals):
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        except BaseException:
            self.restore()
            raise

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def restore(self) -> None:
        """Put back the handlers that were there before, unless someone replaced ours since (theirs
        then stays). Safe to call twice."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            else:
                logger.debug("shardsafe: handler for %s was replaced by someone else; leaving theirs", sig.name)
        self._previous.clear()
