"""The state every contender saves and loads: a few large Linear layers plus Adam's moments.

Replicated state is the module wrapped in DistributedDataParallel (every rank holds every byte);
sharded state is the module under FSDP2 ``fully_shard`` (each rank holds its dim-0 row range). Values
are a deterministic function of (tensor, global row, column), so any rank of any world size can tell
whether a load put the right bytes into its shard (:meth:`BenchState.scramble`, :meth:`BenchState.check`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

Kind = Literal["replicated", "sharded"]
Layout = Literal["ddp", "fsdp2", "plain"]

LAYERS = 4
_PROBE = 256  # elements checked at the start of every local tensor after each load
_STEP = 7.0


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (the shard of a DTensor), sharing storage with ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


_PERIOD = 65521  # a prime: rows start at scattered points of a period-long sequence


def _sequence(tid: int, length: int) -> torch.Tensor:
    """``length`` values of tensor ``tid``'s sequence, periodic with ``_PERIOD``."""
    i = torch.arange(length, dtype=torch.int64)
    return ((i * 104729 + tid * 31) % _PERIOD).to(torch.float32) / _PERIOD


def _row_starts(row0: int, rows: int) -> torch.Tensor:
    return (torch.arange(row0, row0 + rows, dtype=torch.int64) * 7919) % _PERIOD


def _pattern(tid: int, row0: int, rows: int, cols: int) -> torch.Tensor:
    """The values of global rows ``row0 .. row0+rows`` of tensor ``tid``: row r is the sequence from
    ``r * 7919 mod _PERIOD`` on, so a shard's values depend only on its global rows."""
    seq = _sequence(tid, _PERIOD + cols)
    return seq[_row_starts(row0, rows)[:, None] + torch.arange(cols)[None, :]]


def _fill_rows(view: torch.Tensor, tid: int, row0: int) -> None:
    """``view[:] = _pattern(tid, row0, *view.shape)``, one memcpy per row (fast for wide rows)."""
    rows, cols = view.shape
    if cols < 1024:
        view.copy_(_pattern(tid, row0, rows, cols))
        return
    seq = _sequence(tid, _PERIOD + cols)
    for b, start in enumerate(_row_starts(row0, rows).tolist()):
        view[b].copy_(seq[start : start + cols])


@dataclass
class BenchState:
    """The model, its optimizer and what the contenders need to address them."""

    kind: Kind
    layout: Layout
    model: nn.Module  # what a user hands to a checkpoint library: DDP-, FSDP2- or un-wrapped
    module: nn.Module  # the bare module inside
    optimizer: torch.optim.Adam
    dim: int
    global_bytes: int  # bytes of the whole state (every tensor once), the denominator of every ratio

    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this rank holds, by a stable name, in a stable order (the optimizer's current ones)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_params():
            out[name] = _local(p.detach())
            for key, value in self.optimizer.state[p].items():
                out[f"optim.{name}.{key}"] = _local(value)
        return out

    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.local_tensors().values())

    @staticmethod
    def _row0(p: torch.Tensor) -> int:
        if not isinstance(p, DTensor):
            return 0
        # FSDP2 shards dim 0 as torch.chunk does: ceil(rows / world) rows per rank, the last ones short.
        chunk = math.ceil(p.shape[0] / p.device_mesh.size())
        return min(p.device_mesh.get_local_rank() * chunk, p.shape[0])

    def _each(self) -> list[tuple[torch.Tensor, int, int]]:
        """(local tensor, pattern id, first global row) for every tensor; steps get pattern id -1."""
        out: list[tuple[torch.Tensor, int, int]] = []
        for i, (_, p) in enumerate(self.named_params()):
            row0 = self._row0(p)
            out.append((_local(p.detach()), 3 * i, row0))
            for j, key in enumerate(("exp_avg", "exp_avg_sq")):
                out.append((_local(self.optimizer.state[p][key]), 3 * i + 1 + j, row0))
            out.append((self.optimizer.state[p]["step"], -1, 0))
        return out

    def fill(self) -> None:
        """Write the deterministic values into every local tensor (once, at build)."""
        with torch.no_grad():
            for t, tid, row0 in self._each():
                if tid < 0:
                    t.fill_(_STEP)
                    continue
                _fill_rows(t.view(t.shape[0], -1), tid, row0)

    def scramble(self) -> None:
        """Overwrite the start of every local tensor, so that a load which restores nothing is caught."""
        with torch.no_grad():
            for t, tid, _ in self._each():
                t.view(-1)[:_PROBE].fill_(-1.0 if tid >= 0 else 0.0)

    def check(self, what: str) -> None:
        """Raise if the start of any local tensor does not hold the saved values after ``what`` loaded it."""
        for t, tid, row0 in self._each():
            flat = t.reshape(-1)[:_PROBE]
            if tid < 0:
                expected = torch.full_like(flat, _STEP)
            else:
                cols = t.shape[1] if t.dim() > 1 else 1
                rows = math.ceil(flat.numel() / cols)
                expected = _pattern(tid, row0, rows, cols).reshape(-1)[: flat.numel()]
            if not torch.equal(flat, expected):
                raise AssertionError(f"{what} did not restore a tensor of shape {tuple(t.shape)} (pattern {tid})")


def _dim_for(total_bytes: int) -> int:
    # Parameters are a third of the bytes (Adam keeps two moments of the same size); d*d + d floats per layer.
    per_layer = total_bytes / 3 / LAYERS / 4
    return max(8, math.isqrt(int(per_layer)) // 8 * 8)


def build(kind: Kind, layout: Layout, size_bytes: int) -> BenchState:
    """(every rank of the session) Build the state of about ``size_bytes`` in ``layout`` and fill it.

    ``layout`` "ddp" and "fsdp2" need the default process group; "plain" is one process holding all.
    Builds on the meta device first, so that FSDP2 never materialises the full tensors on a rank.
    """
    dim = _dim_for(size_bytes)
    with torch.device("meta"):
        module = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(LAYERS)))
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in module:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    module.to_empty(device="cpu")
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    for p in module.parameters():
        # Adam's state as after a step, made directly: a real step over a GiB of state costs seconds.
        optimizer.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.empty_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.empty_like(p, memory_format=torch.preserve_format),
        }
    global_bytes = sum(3 * p.numel() * 4 + 4 for p in module.parameters())
    state = BenchState(kind, layout, module, module, optimizer, dim, global_bytes)
    state.fill()
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        state.model = DistributedDataParallel(module, init_sync=False)
    return state
