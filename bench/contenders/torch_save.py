"""``torch.save`` as users write it, made durable with an fsync; ``torch.load`` back.

Replicated: rank 0 saves the module's and the optimizer's ``state_dict()`` to one file, fsyncs it, and
every rank waits for it (a barrier); on load every rank reads the whole file and calls
``load_state_dict``. Sharded: every rank saves its own local shards to its own file (the usual
hand-rolled sharded checkpoint; it cannot be loaded by another world size) and copies them back on load.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from bench.contenders import Contender
from bench.measure import Ctx


def _save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class TorchSave(Contender):
    name = "torch"

    def rep(self, ctx: Ctx) -> None:
        st = self.state
        path = ctx.path("save")
        if st.kind == "replicated":

            def save() -> None:
                if ctx.rank == 0:
                    _save({"model": st.module.state_dict(), "optim": st.optimizer.state_dict()}, path)
                ctx.barrier()

            def load() -> None:
                sd = torch.load(path, map_location="cpu", weights_only=True)
                st.module.load_state_dict(sd["model"])
                st.optimizer.load_state_dict(sd["optim"])

        else:
            mine = os.path.join(path, f"rank-{ctx.rank}.pt")

            def save() -> None:
                os.makedirs(path, exist_ok=True)
                _save(st.local_tensors(), mine)

            def load() -> None:
                saved = torch.load(mine, map_location="cpu", weights_only=True)
                with torch.no_grad():
                    for name, t in st.local_tensors().items():
                        t.copy_(saved[name])

        ctx.measure("save", save, files=path)
        st.scramble()
        ctx.measure("load", load, load=True)
        st.check("torch.load")
        ctx.remove(path)
