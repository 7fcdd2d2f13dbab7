"""A pytest plugin (``-p swap_accelerate``, with ``tests/peers`` on ``sys.path``): before any test module is
imported, ``accelerate.Accelerator`` and ``accelerate.accelerator.Accelerator`` become
:class:`shardsafe.accelerate.Accelerator`, so a peer's tests that import either run against shardsafe's.
Not collected by the suite: ``tests/peers/accelerate_swap.py`` loads it."""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    import accelerate
    import accelerate.accelerator

    from shardsafe.accelerate import Accelerator

    accelerate.Accelerator = Accelerator  # type: ignore[misc]
    accelerate.accelerator.Accelerator = Accelerator  # type: ignore[misc]
    config.stash_swapped = True
