"""A small runtime for distributed training: launch a world of processes (or join one that torchrun or
srun started), set up model and optimizers for ``single``, ``ddp`` or ``fsdp`` (FSDP2), and talk across
ranks with deadlines and desync detection. Checkpoints go through :func:`shardsafe.save`/:func:`shardsafe.load`.

Not loaded by ``import shardsafe``: ``from shardsafe.runtime import Runtime``.

Layer: may import engine, coord, errors; imported by nothing of the checkpoint API."""

from shardsafe.runtime.config import RuntimeConfig
from shardsafe.runtime.errors import LaunchError, WorkerError, WorkerTraceback
from shardsafe.runtime.runtime import Runtime

__all__ = ["LaunchError", "Runtime", "RuntimeConfig", "WorkerError", "WorkerTraceback"]
