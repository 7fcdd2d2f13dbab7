"""torch.distributed.checkpoint (DCP) as its tutorials and torchtitan use it.

State dicts come from ``get_state_dict`` (fully qualified names, sharded DTensors for FSDP2) and go back
with ``set_state_dict``; saves use the default ``FileSystemWriter`` (which fsyncs its files) and planner.
``async_save`` runs in thread mode with the default stager, which copies the state into fresh memory
before returning. DCP can load into another world size, so it takes part in the resharded loads.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from bench.contenders import Contender
from bench.measure import Ctx


class Dcp(Contender):
    name = "dcp"

    def _state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.state.model, self.state.optimizer)
        return {"model": msd, "optim": osd}

    def _save(self, path: str) -> None:
        dcp_save(self._state_dict(), checkpoint_id=path, no_dist=not dist.is_initialized())

    def _load(self, path: str) -> None:
        sd = self._state_dict()
        with warnings.catch_warnings():
            # In one process DCP warns that it assumes a single-process load, which is what is meant.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(sd, checkpoint_id=path, no_dist=not dist.is_initialized())
        set_state_dict(
            self.state.model, self.state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )

    def rep(self, ctx: Ctx) -> None:
        st, path, apath = self.state, ctx.path("save"), ctx.path("async")
        ctx.measure("save", lambda: self._save(path), files=path)
        st.scramble()
        ctx.measure("load", lambda: self._load(path), load=True)
        st.check("dcp.load")
        ctx.remove(path)

        def begin() -> Any:
            return dcp_async_save(self._state_dict(), checkpoint_id=apath)

        ctx.measure_async("async_save", begin, lambda fut: fut.result(), files=apath)
        ctx.remove(apath)

    def save_source(self, path: str) -> None:
        self._save(path)

    def load_resharded(self, path: str) -> None:
        self._load(path)
