"""What the user asked the runtime for (:class:`RuntimeConfig`), and what it resolved to (:class:`Plan`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from shardsafe.errors import InvalidArgumentError, InvalidTypeError
from shardsafe.runtime.compat import fsdp_on_cpu_problem
from shardsafe.runtime.env import ClusterEnv
from shardsafe.runtime.errors import LaunchError

logger = logging.getLogger(__name__)

ACCELERATORS = ("auto", "cpu", "cuda")
STRATEGIES = ("auto", "single", "ddp", "fsdp")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """The arguments of :class:`shardsafe.runtime.Runtime`, checked on creation."""

    accelerator: str = "auto"
    """``"cpu"``, ``"cuda"``, or ``"auto"`` (CUDA when available)."""
    devices: int | str = "auto"
    """Processes per node, one per device; ``"auto"``: every GPU, one process on CPU, or what torchrun or
    SLURM started."""
    strategy: str = "auto"
    """``"single"`` (one process), ``"ddp"`` (DistributedDataParallel), ``"fsdp"`` (FSDP2 ``fully_shard``), or
    ``"auto"`` (single for one process, else ddp)."""
    num_nodes: int = 1
    """Nodes of the world; more than one needs an outside launcher (torchrun or SLURM)."""
    timeout: float | None = None
    """Seconds a rank waits for the others at ``setup``/``barrier`` (and for collectives); ``None``: the
    ``SHARDSAFE_TIMEOUT`` default."""
    block_types: tuple[type[nn.Module], ...] | None = None
    """FSDP: module classes to shard one by one (e.g. the transformer block). ``None``: every module held
    in an ``nn.ModuleList``."""

    def __post_init__(self) -> None:
        if self.accelerator not in ACCELERATORS:
            raise InvalidArgumentError(
                f"accelerator={self.accelerator!r}: choose one of {', '.join(map(repr, ACCELERATORS))}"
            )
        if self.strategy not in STRATEGIES:
            raise InvalidArgumentError(f"strategy={self.strategy!r}: choose one of {', '.join(map(repr, STRATEGIES))}")
        if self.devices != "auto" and (
            isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1
        ):
            raise InvalidArgumentError(
                f"devices={self.devices!r}: give a number of processes per node (>= 1) or 'auto'"
            )
        if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, int) or self.num_nodes < 1:
            raise InvalidArgumentError(f"num_nodes={self.num_nodes!r} must be an integer >= 1")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not self.timeout > 0):
            raise InvalidArgumentError(f"timeout={self.timeout!r} must be a positive number of seconds, or None")
        for cls in self.block_types or ():
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise InvalidTypeError(
                    f"block_types holds {cls!r}; give nn.Module subclasses, e.g. block_types=[Block]"
                )


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The resolved configuration: no ``"auto"`` left."""

    accelerator: str
    devices: int
    num_nodes: int
    strategy: str
    backend: str
    picked: tuple[str, ...] = field(default=())
    """What ``"auto"`` chose, and why, for the log."""

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def summary(self) -> str:
        text = (
            f"accelerator={self.accelerator} devices={self.devices} num_nodes={self.num_nodes} "
            f"strategy={self.strategy} backend={self.backend}"
        )
        return text + (f" (auto: {'; '.join(self.picked)})" if self.picked else "")


def resolve(config: RuntimeConfig, cluster: ClusterEnv | None) -> Plan:
    """Replace every ``"auto"`` by a choice, and check the result against the machine and against the
    world an outside launcher started (``cluster``)."""
    picked: list[str] = []
    accelerator = config.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        picked.append(f"accelerator={accelerator} ({'a GPU is' if accelerator == 'cuda' else 'no GPU'} visible)")
    elif accelerator == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("accelerator='cuda' but torch sees no GPU; use accelerator='cpu' or 'auto'")

    devices = config.devices
    if devices == "auto":
        if cluster is not None:
            devices = cluster.local_world_size
            picked.append(f"devices={devices} (the processes per node {cluster.kind} started)")
        elif accelerator == "cuda":
            devices = torch.cuda.device_count()
            picked.append(f"devices={devices} (every visible GPU)")
        else:
            devices = 1
            picked.append("devices=1 (one process on CPU; ask for more with devices=N)")
    assert isinstance(devices, int)
    if accelerator == "cuda" and cluster is None and devices > torch.cuda.device_count():
        raise InvalidArgumentError(f"devices={devices} but only {torch.cuda.device_count()} GPU(s) are visible")
    if config.num_nodes > 1 and cluster is None:
        raise LaunchError(
            f"num_nodes={config.num_nodes} needs an outside launcher: start the script on every node with "
            "torchrun (--nnodes) or srun; Runtime.launch() then joins that world"
        )
    if cluster is not None and (devices != cluster.local_world_size or config.num_nodes != cluster.num_nodes):
        raise LaunchError(
            f"Runtime(devices={config.devices!r}, num_nodes={config.num_nodes}) expects a world of "
            f"{devices} x {config.num_nodes} processes, but {cluster.kind} started {cluster.world_size} "
            f"({cluster.local_world_size} per node on {cluster.num_nodes} node(s)). Make them agree: pass "
            f"devices={cluster.local_world_size}, num_nodes={cluster.num_nodes} (or devices='auto'), or change "
            f"the launcher's --nproc-per-node/--nnodes"
        )

    world = devices * config.num_nodes
    strategy = config.strategy
    if strategy == "auto":
        strategy = "single" if world == 1 else "ddp"
        picked.append(f"strategy={strategy} ({'one process' if world == 1 else f'{world} processes'})")
    elif strategy == "single" and world > 1:
        raise InvalidArgumentError(
            f"strategy='single' runs one process but devices={devices} x num_nodes={config.num_nodes} asks "
            f"for {world}; use strategy='ddp' or 'fsdp', or devices=1"
        )
    if config.block_types is not None and strategy != "fsdp":
        raise InvalidArgumentError(f"block_types= only applies to strategy='fsdp' (got strategy={strategy!r})")
    problem = fsdp_on_cpu_problem() if strategy == "fsdp" and accelerator == "cpu" else None
    if problem is not None:
        raise InvalidArgumentError(
            f"strategy='fsdp' with accelerator='cpu': {problem}. Use strategy='ddp' on CPU, accelerator='cuda', or a "
            "newer torch (the install section of the README lists the tested releases)"
        )
    backend = "nccl" if accelerator == "cuda" else "gloo"
    plan = Plan(
        accelerator=accelerator,
        devices=devices,
        num_nodes=config.num_nodes,
        strategy=strategy,
        backend=backend,
        picked=tuple(picked),
    )
    logger.info("shardsafe runtime: %s", plan.summary())
    return plan
