"""A pytest plugin (``-p swap_transformers``, with ``tests/peers`` on ``sys.path``): before any test module is
imported, ``transformers.Trainer`` and ``transformers.trainer.Trainer`` become
:class:`shardsafe.transformers.Trainer`, so a peer's tests that import either run against shardsafe's. Not
collected by the suite: ``tests/peers/transformers_swap.py`` loads it."""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    import transformers
    import transformers.trainer

    from shardsafe.transformers import Trainer

    transformers.Trainer = Trainer  # type: ignore[misc]
    transformers.trainer.Trainer = Trainer  # type: ignore[misc]
