"""Detecting a world that someone else started: torchrun (torch.distributed.run) or SLURM's srun.

When one is present, :meth:`shardsafe.runtime.Runtime.launch` starts no process and joins it instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from shardsafe.errors import InvalidArgumentError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class ClusterEnv:
    """This process's place in a world started by an outside launcher."""

    kind: str
    """``"torchrun"`` or ``"slurm"``."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def export(self) -> None:
        """Set the variables ``init_process_group(init_method="env://")`` reads, where missing."""
        for key, value in (
            ("RANK", self.rank),
            ("WORLD_SIZE", self.world_size),
            ("LOCAL_RANK", self.local_rank),
            ("LOCAL_WORLD_SIZE", self.local_world_size),
            ("MASTER_ADDR", self.master_addr),
            ("MASTER_PORT", self.master_port),
        ):
            os.environ.setdefault(key, str(value))


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """The outside world this process belongs to, or ``None`` when it was started on its own."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in _TORCHRUN_VARS):
        return _torchrun(env)
    if _int(env, "SLURM_NTASKS", 1) > 1 and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return _slurm(env)
    return None


def _torchrun(env: Mapping[str, str]) -> ClusterEnv:
    missing = [k for k in _TORCHRUN_VARS if k not in env]
    if missing:
        raise InvalidArgumentError(
            f"torchrun-style environment without {', '.join(missing)}: start the script with torchrun "
            "(python -m torch.distributed.run) or set all of " + ", ".join(_TORCHRUN_VARS)
        )
    world = _int(env, "WORLD_SIZE", 1)
    port = _int(env, "MASTER_PORT", 0)
    place = _place(env, "RANK", "LOCAL_RANK", "GROUP_RANK")
    return ClusterEnv(
        kind="torchrun",
        **place,
        world_size=world,
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
        master_addr=env["MASTER_ADDR"],
        master_port=port,
    )


def _slurm(env: Mapping[str, str]) -> ClusterEnv:
    world = _int(env, "SLURM_NTASKS", 1)
    nodes = max(1, _int(env, "SLURM_NNODES", 1))
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    match = re.match(r"^(\d+)", per_node)
    local_world = int(match.group(1)) if match else max(1, world // nodes)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
    job_id = _int(env, "SLURM_JOB_ID", 0)
    # Every task derives the same port from the job id: nothing is bound and released first.
    port = _int(env, "MASTER_PORT", 10000 + job_id % 20000)
    addr = env.get("MASTER_ADDR") or first_host(nodelist)
    place = _place(env, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
    return ClusterEnv(
        kind="slurm", **place, world_size=world, local_world_size=local_world, master_addr=addr, master_port=port
    )


def _place(env: Mapping[str, str], rank: str, local_rank: str, node_rank: str) -> dict[str, int]:
    """This process's ranks (global, on its node, of its node) from the launcher's variables of those names."""
    return {"rank": _int(env, rank, 0), "local_rank": _int(env, local_rank, 0), "node_rank": _int(env, node_rank, 0)}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    head = re.match(r"^([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if head is None or (not head.group(1) and not head.group(2)):
        raise InvalidArgumentError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = head.group(1), head.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {key}={raw!r} is not an integer") from None
