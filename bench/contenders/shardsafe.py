"""shardsafe: every rank calls ``save``/``load``/``async_save`` with the wrapped model and the optimizer."""

from __future__ import annotations

import shardsafe
from bench.contenders import Contender
from bench.measure import Ctx

_API = shardsafe.save  # shardsafe imports its API on first use: now, before anything is measured


class Shardsafe(Contender):
    name = "shardsafe"

    def _objects(self) -> dict[str, object]:
        return {"model": self.state.model, "optim": self.state.optimizer}

    def rep(self, ctx: Ctx) -> None:
        st, path, apath = self.state, ctx.path("save"), ctx.path("async")
        ctx.measure("save", lambda: shardsafe.save(path, self._objects()), files=path)
        st.scramble()
        ctx.measure("load", lambda: shardsafe.load(path, self._objects()), load=True)
        st.check("shardsafe.load")
        ctx.remove(path)
        ctx.measure_async(
            "async_save", lambda: shardsafe.async_save(apath, self._objects()), lambda h: h.wait(), files=apath
        )
        ctx.remove(apath)

    def save_source(self, path: str) -> None:
        shardsafe.save(path, self._objects())

    def load_resharded(self, path: str) -> None:
        shardsafe.load(path, self._objects())
