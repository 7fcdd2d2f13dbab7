"""Lightning Fabric's ``fabric.save`` / ``fabric.load`` on CPU.

Replicated state uses Fabric's DDP strategy: rank 0 serialises the whole checkpoint into memory
(``torch.save`` into a BytesIO) and writes it out; Fabric does not fsync, so rank 0 fsyncs the file
inside the timed region to make it as durable as the others. Sharded state uses Fabric's
``ModelParallelStrategy`` (FSDP2; the module is already sharded, so its parallelize function is the
identity), which saves through DCP plus a ``meta.pt``.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy

from bench.contenders import Contender
from bench.measure import Ctx
from bench.state import BenchState


def _fsync_tree(path: str) -> None:
    paths = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _identity(module: Any, mesh: Any) -> Any:
    return module


class LightningFabric(Contender):
    name = "fabric"

    def __init__(self, state: BenchState) -> None:
        super().__init__(state)
        world = int(os.environ["WORLD_SIZE"])
        if state.kind == "replicated":
            self.fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
            self.fabric.launch()
            self.model = self.fabric.setup_module(state.module)
        else:
            strategy = ModelParallelStrategy(_identity, data_parallel_size=world, tensor_parallel_size=1)
            self.fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
            self.fabric.launch()
            self.model = self.fabric.setup_module(state.module)
        self.optimizer = self.fabric.setup_optimizers(state.optimizer)

    def _objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def rep(self, ctx: Ctx) -> None:
        st, path = self.state, ctx.path("save")

        def save() -> None:
            self.fabric.save(path, self._objects())
            if ctx.rank == 0:
                _fsync_tree(path)
            ctx.barrier()

        ctx.measure("save", save, files=path)
        st.scramble()
        ctx.measure("load", lambda: self.fabric.load(path, self._objects()), load=True)
        st.check("fabric.load")
        ctx.remove(path)
