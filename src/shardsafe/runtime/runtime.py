"""The :class:`Runtime`: launch a world of processes, set up model and optimizers for a strategy, and
talk across ranks, with every wait under a deadline and every rank-dependent misstep reported."""

from __future__ import annotations

import atexit
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from shardsafe.coord import Deadlines, call_site, rendezvous
from shardsafe.errors import InvalidArgumentError
from shardsafe.runtime import launch as _launch
from shardsafe.runtime import strategies
from shardsafe.runtime.config import Plan, RuntimeConfig, resolve
from shardsafe.runtime.env import ClusterEnv, detect
from shardsafe.runtime.errors import LaunchError

if TYPE_CHECKING:  # torch.distributed re-exports these without declaring them for type checkers
    from torch._C._distributed_c10d import Store, TCPStore
else:
    from torch.distributed import Store, TCPStore

logger = logging.getLogger(__name__)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Runtime:
    """Runs a training function on one or more processes and sets model and optimizers up for them.

    ``Runtime(accelerator="auto", devices="auto", strategy="auto", num_nodes=1, timeout=None,
    block_types=None)``; see :class:`~shardsafe.runtime.config.RuntimeConfig` for each argument.
    Typical use::

        def main(rt: Runtime) -> float:
            model, opt = rt.setup(Net(), torch.optim.AdamW(...))
            ...
            rt.save("ckpt/step-100", {"model": model, "optim": opt, "step": 100})

        if __name__ == "__main__":
            Runtime(devices=2, strategy="fsdp").launch(main)

    Under torchrun or srun, ``launch`` starts nothing and joins the world they started.
    """

    def __init__(
        self,
        accelerator: str = "auto",
        devices: int | str = "auto",
        strategy: str = "auto",
        num_nodes: int = 1,
        timeout: float | None = None,
        *,
        block_types: Iterable[type[nn.Module]] | None = None,
    ) -> None:
        config = RuntimeConfig(
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            num_nodes=num_nodes,
            timeout=timeout,
            block_types=tuple(block_types) if block_types is not None else None,
        )
        cluster = detect()
        self._init(config, cluster, resolve(config, cluster))

    def _init(self, config: RuntimeConfig, cluster: ClusterEnv | None, plan: Plan) -> None:
        self.config = config
        self.plan = plan
        self.deadlines = Deadlines.resolve(config.timeout)
        self._cluster = cluster
        self._rank = 0
        self._local_rank = 0
        self._node_rank = 0
        self._joined = False
        self._owned_store: TCPStore | None = None
        self._launched_at: str | None = None
        self._seed: int | None = None

    @classmethod
    def _for_worker(cls, config: RuntimeConfig, plan: Plan, *, rank: int, launched_at: str) -> Runtime:
        """(spawned worker) The runtime handed to ``fn``; it is already launched."""
        self = cls.__new__(cls)
        self._init(config, None, plan)
        self._launched_at = launched_at
        return self

    # ------------------------------------------------------------------------------------ facts

    @property
    def rank(self) -> int:
        """Global rank of this process (0 before ``launch``)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes of the world (the planned number before ``launch``)."""
        return self.plan.world_size

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node; the GPU it uses on CUDA."""
        return self._local_rank

    @property
    def node_rank(self) -> int:
        return self._node_rank

    @property
    def is_global_zero(self) -> bool:
        return self._rank == 0

    @property
    def strategy(self) -> str:
        """``"single"``, ``"ddp"`` or ``"fsdp"`` (never ``"auto"``)."""
        return self.plan.strategy

    @property
    def device(self) -> torch.device:
        """Where this rank's model and batches belong."""
        if self.plan.accelerator == "cuda":
            return torch.device("cuda", self._local_rank)
        return torch.device("cpu")

    # ---------------------------------------------------------------------------------- launching

    def launch(self, fn: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """(the launching process) Start the world and run ``fn(self, *args, **kwargs)`` on every rank.

        - One process (``devices=1``): runs ``fn`` here.
        - Several, started by nobody yet: spawns one worker per rank, returns rank 0's return value; the
          first worker failure stops the others and is raised here with the worker's traceback.
        - Under torchrun or srun: joins their world and runs ``fn`` in this process, returning its value.

        ``fn`` may be left out under torchrun/srun or with one process: the world then stays joined for
        the rest of the program. Call once per Runtime, from under ``if __name__ == "__main__":``.
        """
        site = call_site()
        if self._launched_at is not None:
            raise LaunchError(
                f"launch() called at {site}, but this Runtime was already launched at {self._launched_at}. "
                "Launch once; inside the launched function the world is already running (use the Runtime "
                "passed to it), and to start another run, create a new Runtime"
            )
        if _launch.bootstrapping():
            raise LaunchError(
                f"launch() reached at {site} in a worker process that is still importing the main module: the "
                "call is not under `if __name__ == '__main__':`, so every spawned worker would launch again. "
                "Move it there."
            )
        self._launched_at = site
        if self._cluster is not None:
            self._cluster.export()
            c = self._cluster
            self._join_world(store=None, rank=c.rank, world_size=c.world_size, local_rank=c.local_rank)
            self._node_rank = c.node_rank
            return self._run_here(fn, args, kwargs)
        if self.plan.world_size == 1:
            if self.plan.strategy != "single":
                self._join_world(store=None, rank=0, world_size=1, local_rank=0)
            return self._run_here(fn, args, kwargs)
        if fn is None:
            raise LaunchError(
                f"launch() at {site} needs the function to run on each of the {self.plan.world_size} processes: "
                "rt.launch(main, ...) (or start the script with torchrun, which starts the processes itself)"
            )
        unguarded = _launch.unguarded_main_line()
        if unguarded is not None:
            raise LaunchError(
                f"launch() is reached from {unguarded[0]}:{unguarded[1]}, main-module code outside "
                "`if __name__ == '__main__':`. Spawned workers import the main module, so each would launch "
                "again. Put the call (and the code that leads to it) under that guard."
            )
        logger.info("shardsafe runtime: spawning %d workers (%s)", self.plan.world_size, self.plan.summary())
        return _launch.run_workers(
            self.config,
            self.plan,
            fn,
            args,
            kwargs,
            launched_at=site,
            start_timeout=max(self.deadlines.arrive, 60.0),
            finish_timeout=self.deadlines.io,
        )

    def _run_here(self, fn: Callable[..., Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if fn is None:
            atexit.register(self._leave_world)
            return None
        ok = False
        try:
            result = fn(self, *args, **kwargs)
            ok = True
        finally:
            # After a failure under torchrun/srun the process group may be mid-collective: leave it to the
            # process exit (the launcher stops the other ranks) rather than block in its teardown.
            if ok or self._owned_store is not None:
                self._leave_world()
        return result

    def _join_world(self, *, store: Store | None, rank: int, world_size: int, local_rank: int) -> None:
        """(every rank) Initialise the default process group: over ``store`` (our workers), over the
        ``env://`` variables (torchrun, srun), or over a private store (one process, ddp/fsdp)."""
        if dist.is_initialized():
            raise LaunchError(
                "torch.distributed is already initialised in this process: the Runtime creates the process "
                "group itself. Remove the init_process_group() call, or use the Runtime passed to your function"
            )
        self._rank, self._local_rank = rank, local_rank
        if self.plan.accelerator == "cuda":
            torch.cuda.set_device(self.device)
        options: dict[str, Any] = {"backend": self.plan.backend, "timeout": timedelta(seconds=self.deadlines.io)}
        if self.plan.accelerator == "cuda":
            options["device_id"] = self.device  # connect NCCL now, so a broken GPU fails here, not later
        if store is None and self._cluster is None:
            self._owned_store = TCPStore(
                _launch.HOST, 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
            store = self._owned_store
        if store is not None:
            dist.init_process_group(store=store, rank=rank, world_size=world_size, **options)
        else:
            dist.init_process_group(init_method="env://", rank=rank, world_size=world_size, **options)
        self._joined = True
        logger.debug("shardsafe runtime: rank %d of %d joined (%s)", rank, world_size, self.plan.backend)

    def _leave_world(self) -> None:
        if self._joined and dist.is_initialized():
            dist.destroy_process_group()
        self._joined = False
        self._owned_store = None

    def _need_world(self, what: str) -> bool:
        """True when collectives are needed; joins a one-process world lazily for ddp/fsdp; raises when the
        world should exist but was never launched."""
        if self._joined:
            return True
        if self.plan.world_size > 1:
            when = "before launch()" if self._launched_at is None else "after the launched function returned"
            raise LaunchError(
                f"{what}() called {when}: this Runtime plans {self.plan.world_size} processes. Put the training "
                f"code in a function and run it with rt.launch(fn); call {what}() inside it"
            )
        if what == "setup" and self.plan.strategy != "single":
            self._join_world(store=None, rank=0, world_size=1, local_rank=0)
            atexit.register(self._leave_world)
            return True
        return False

    # ------------------------------------------------------------------------------- model setup

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """(every rank, same call site) Wrap ``model`` for the strategy and rebind ``optimizers`` to the
        wrapped parameters. Returns the model alone, or ``(model, *optimizers)`` when any are given.

        First checks through the rendezvous store (within ``timeout``) that every rank reached this same
        line: a rank on another code path makes every rank raise :class:`RankDesyncError` naming each
        rank's file:line, instead of a deadlock in the first collective. See :mod:`.strategies` for what
        each strategy does.
        """
        if self._need_world("setup"):
            target = f"{type(model).__qualname__} with {len(optimizers)} optimizer(s)"
            rendezvous("setup", target, self.deadlines, match_site=True)
        wrapped = strategies.setup_module(self.plan, self.device, model, optimizers, self.config.block_types)
        return (wrapped, *optimizers) if optimizers else wrapped

    def setup_dataloader(self, loader: DataLoader[Any]) -> DataLoader[Any]:
        """Give each rank its own part of ``loader``'s dataset (a ``DistributedSampler``; shuffling kept,
        seeded by :meth:`seed_everything`). Call ``loader.sampler.set_epoch(epoch)`` each epoch."""
        return strategies.shard_loader(loader, rank=self._rank, world_size=self.world_size, seed=self._seed or 0)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``; gradient synchronisation is done by the DDP/FSDP hooks set up in ``setup``."""
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------------------ collectives

    def barrier(self, name: str | None = None) -> None:
        """(every rank) Wait until every rank is here, within ``timeout``. A named barrier also checks that
        every rank calls it from the same file:line (else :class:`RankDesyncError` on every rank)."""
        if self._need_world("barrier") and self.world_size > 1:
            rendezvous("barrier", name or "", self.deadlines, match_site=name is not None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """(every rank) ``src``'s ``obj`` on every rank: tensors by a collective (in place, and returned),
        other picklable objects by ``broadcast_object_list``."""
        if not self._need_world("broadcast") or self.world_size == 1:
            return obj
        if isinstance(obj, torch.Tensor):
            local = obj.to(self.device)
            dist.broadcast(local, src=src)
            if local is not obj:
                obj.copy_(local)
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=self.device if self.plan.backend == "nccl" else None)
        return box[0]

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """(every rank) ``value`` reduced over all ranks (``"sum"``, ``"mean"``, ``"max"``, ``"min"``), as a new
        tensor; the input is left unchanged."""
        if op not in _REDUCE_OPS:
            raise InvalidArgumentError(f"all_reduce(op={op!r}): choose one of {', '.join(map(repr, _REDUCE_OPS))}")
        tensor = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
        if not self._need_world("all_reduce") or self.world_size == 1:
            return tensor
        out = tensor.to(self.device, dtype=torch.float64 if op == "mean" and not tensor.is_floating_point() else None)
        dist.all_reduce(out, op=_REDUCE_OPS[op])
        if op == "mean":
            out = out / self.world_size
        return out.to(tensor.device)

    # ---------------------------------------------------------------------------------- helpers

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only (flushed, so lines from a run under a launcher appear in order)."""
        if self.is_global_zero:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def seed_everything(self, seed: int) -> int:
        """Seed Python's, NumPy's (when installed) and torch's generators with ``seed`` on this rank. Use the
        same seed on every rank: FSDP shards each rank's own copy of the model (``setup`` also broadcasts
        rank 0's weights first, as DDP does)."""
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np
        except ImportError:  # numpy is optional
            pass
        else:
            np.random.seed(seed % 2**32)
        self._seed = seed
        return seed

    def to_device(self, obj: Any) -> Any:
        """``obj`` with every tensor in it (nested in dicts, lists, tuples) moved to :attr:`device`."""
        if isinstance(obj, torch.Tensor):
            return obj.to(self.device)
        if isinstance(obj, Mapping):
            return type(obj)({k: self.to_device(v) for k, v in obj.items()})  # type: ignore[call-arg]
        if isinstance(obj, (list, tuple)):
            moved = [self.to_device(v) for v in obj]
            return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
        return obj

    # ----------------------------------------------------------------------------- checkpoints

    def save(self, path: str, state: dict[str, Any], **kwargs: Any) -> None:
        """(every rank) :func:`shardsafe.save` over this runtime's world; same keywords."""
        self._need_world("save")
        from shardsafe.engine.api import save

        kwargs.setdefault("timeout", self.config.timeout)
        save(path, state, **kwargs)

    def load(self, path: str, state: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        """(every rank) :func:`shardsafe.load` over this runtime's world; same keywords and result."""
        self._need_world("load")
        from shardsafe.engine.api import load

        kwargs.setdefault("timeout", self.config.timeout)
        result: dict[str, Any] = load(path, state, **kwargs)
        return result

    def __repr__(self) -> str:
        return f"Runtime(rank={self._rank}, {self.plan.summary()})"
