"""What a torch release inside shardsafe's declared range cannot do, checked before the Runtime starts
anything, so that a user gets one clear error rather than a crash inside torch on every rank.

- FSDP2 (``fully_shard``) on CPU with torch 2.6: its first forward calls ``record_event()`` on a
  ``torch.cpu.Stream``, which has only ``wait_stream`` there (``AttributeError: 'Stream' object has no
  attribute 'record_event'`` on every rank). Adding the missing no-op methods is not enough: the first
  backward through nested ``fully_shard`` blocks then fails in autograd (a saved parameter "modified by an
  inplace operation"). Later releases run it; torch's CPU stream stand-in having ``record_event`` is
  the test.
"""

from __future__ import annotations

import torch


def fsdp_on_cpu_problem() -> str | None:
    """Why this torch cannot run FSDP2 on CPU, or ``None`` when it can."""
    if hasattr(torch.cpu.Stream, "record_event"):
        return None
    return (
        f"torch {torch.__version__}'s FSDP2 (fully_shard) does not run on CPU: its first forward fails on every rank "
        "with AttributeError: 'Stream' object has no attribute 'record_event'"
    )
