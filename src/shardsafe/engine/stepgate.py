"""The optimizer step gate of background staging (:mod:`shardsafe.engine.snapshot`): one step pre-hook
common to every optimizer of the process (``torch.optim.optimizer.register_optimizer_step_pre_hook``),
so that an optimizer outside the saved state (kept beside it, or saved as ``opt.state_dict()``) is
gated as one inside it: before any ``optimizer.step()``, every background staging still copying is
asked (:meth:`Staging.before_step`) to hold the step until the tensors it writes are copied.

That matters most for the steps that do not move the version counters (``fused=True`` optimizers, a
custom step writing through ``.data``): their writes could not be detected afterwards, so they are
waited for instead.

The hook is installed by the first background save (:func:`arm`) and never removed: removing (or
adding) a hook while another thread's ``step()`` iterates the hooks would raise "OrderedDict mutated
during iteration" in that step. With no staging armed it returns at once (one read of a list).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_lock = threading.Lock()
_installed = False
_armed: tuple[Staging, ...] = ()  # replaced whole, never changed in place: the hook reads it without the lock


class Staging(Protocol):
    """What the gate asks of a staging in flight."""

    def before_step(self, opt: torch.optim.Optimizer) -> None:
        """(the thread calling ``opt.step()``, before the step) Return once the step may change the
        tensors of ``opt`` this staging still has to copy (or once it gave up waiting)."""


def _hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    armed = _armed
    for staging in armed:
        staging.before_step(opt)


def arm(staging: Staging) -> None:
    """(the call of a background save) Ask ``staging`` before every optimizer step until :func:`disarm`;
    installs the hook the first time."""
    global _installed, _armed
    with _lock:
        if not _installed:
            register_optimizer_step_pre_hook(_hook)
            _installed = True
        _armed = (*_armed, staging)


def disarm(staging: Staging) -> None:
    """(any thread) Stop asking ``staging``; a step already asking it finishes its wait."""
    global _armed
    with _lock:
        _armed = tuple(s for s in _armed if s is not staging)


def armed() -> int:
    """How many stagings the gate asks now (tests)."""
    return len(_armed)
