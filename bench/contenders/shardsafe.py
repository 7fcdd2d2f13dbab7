"""shardsafe: every rank calls ``save``/``load``/``async_save`` with the wrapped model and the optimizer.

:class:`ShardsafeBaseline` runs the same operations through shardsafe as it was at an earlier revision
(``bench/run.py --baseline REV``; see :mod:`bench.baseline`), so that a change is measured against
what came before in the same run.
"""

from __future__ import annotations

from types import ModuleType

import shardsafe
from bench.contenders import Contender
from bench.measure import Ctx
from bench.state import BenchState

_API = shardsafe.save  # shardsafe imports its API on first use: now, before anything is measured


class Shardsafe(Contender):
    name = "shardsafe"

    def __init__(self, state: BenchState, lib: ModuleType = shardsafe) -> None:
        super().__init__(state)
        self.lib = lib

    def _objects(self) -> dict[str, object]:
        return {"model": self.state.model, "optim": self.state.optimizer}

    def rep(self, ctx: Ctx) -> None:
        lib, st, path, apath = self.lib, self.state, ctx.path("save"), ctx.path("async")
        ctx.measure("save", lambda: lib.save(path, self._objects()), files=path)
        st.scramble()
        ctx.measure("load", lambda: lib.load(path, self._objects()), load=True)
        st.check(f"{self.name}.load")
        ctx.remove(path)
        ctx.measure_async("async_save", lambda: lib.async_save(apath, self._objects()), lambda h: h.wait(), files=apath)
        ctx.remove(apath)

    def save_source(self, path: str) -> None:
        self.lib.save(path, self._objects())

    def load_resharded(self, path: str) -> None:
        self.lib.load(path, self._objects())


class ShardsafeBaseline(Shardsafe):
    """shardsafe at the baseline revision, imported as ``shardsafe_base``."""

    name = "baseline"

    def __init__(self, state: BenchState) -> None:
        from bench.baseline import import_baseline

        lib = import_baseline()
        _ = lib.save  # its API imported now, before anything is measured
        super().__init__(state, lib)
