"""The one wait loop of shardsafe. Every cross-rank wait (a barrier's decision, a broadcast value, a
posted record, acknowledgements, the manager's per-step decisions) polls the store through
:func:`wait_until`: a deadline, a check run on every round (a failed heartbeat, another rank's abort
record, a rank whose heartbeat stopped: each raises), one stall report after
``SHARDSAFE_STALL_FRACTION`` of the deadline, and a pause that doubles from
``SHARDSAFE_FIRST_POLL_SECONDS`` up to ``SHARDSAFE_POLL_SECONDS``."""

from __future__ import annotations

import time
from collections.abc import Callable

from shardsafe import knobs


def wait_until(
    ready: Callable[[], bool],
    *,
    timeout: float,
    watch: Callable[[], bool] | None = None,
    stalled: Callable[[float], None] | None = None,
) -> bool:
    """(the waiting rank) Poll ``ready`` until it holds (``True``) or ``timeout`` seconds pass
    (``False``). Each round that is not ready first runs ``watch``, which raises to end the wait
    (heartbeats, abort records, dead ranks) or returns ``True`` when what was awaited is there after
    all; after ``stall_fraction * timeout`` seconds ``stalled(elapsed)`` runs once (the WARNING that
    says where each rank is)."""
    started = time.monotonic()
    warned = False
    delay = knobs.first_poll_seconds()
    while not ready():
        if watch is not None and watch():
            return True
        elapsed = time.monotonic() - started
        if elapsed > timeout:
            return False
        if stalled is not None and not warned and elapsed > knobs.stall_fraction() * timeout:
            warned = True
            stalled(elapsed)
        time.sleep(delay)
        delay = min(delay * 2, knobs.poll_seconds())
    return True
