"""What ``Runtime.setup`` does to a model and its optimizers for each strategy, and how
``Runtime.setup_dataloader`` shards a loader.

- ``"single"``: the model moves to the device; nothing else.
- ``"ddp"``: the model moves to the device and is wrapped in ``DistributedDataParallel`` (which broadcasts
  rank 0's weights). Optimizers keep their parameters (DDP does not replace them).
- ``"fsdp"``: the model is never materialised whole on the device: it becomes meta tensors, FSDP2
  ``fully_shard`` is applied to each *block* and finally to the root, the local shards get memory
  (``to_empty``) and are filled with rank 0's values (as DDP starts from rank 0's weights), one tensor
  at a time. A model built on the meta device is sharded as it is, for the user to initialise. Blocks
  are, by default, the modules held in an ``nn.ModuleList`` (where transformer blocks live);
  ``Runtime(block_types=[MyBlock])`` names the classes instead. ``fully_shard``
  replaces every parameter by a sharded DTensor parameter, so each optimizer's param groups are rebuilt
  to point at the new parameters, by parameter name, keeping every hyperparameter. (On CPU it needs a
  torch whose FSDP2 runs there, not 2.6: the Runtime refuses that when it is created, :mod:`.compat`.)
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from shardsafe.errors import InvalidArgumentError, InvalidTypeError
from shardsafe.runtime.config import Plan

logger = logging.getLogger(__name__)


def setup_module(
    plan: Plan,
    device: torch.device,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    block_types: tuple[type[nn.Module], ...] | None,
) -> nn.Module:
    """(every rank, after the setup rendezvous) Wrap ``model`` for ``plan.strategy``; rebind ``optimizers``
    in place. FSDP and DDP run collectives on the training process group here."""
    if isinstance(model, (DistributedDataParallel, FSDPModule)):
        raise InvalidArgumentError(
            f"setup() got a model that is already wrapped ({type(model).__name__}); pass the plain module and "
            "let the Runtime wrap it"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    _check_optimizers(optimizers, names, plan.strategy)
    wrapped: nn.Module
    if plan.strategy == "single":
        wrapped = _to(model, device)
    elif plan.strategy == "ddp":
        wrapped = DistributedDataParallel(
            _to(model, device), device_ids=[device.index] if device.type == "cuda" else None
        )
    elif plan.strategy == "fsdp":
        wrapped = _fully_shard(model, device, block_types)
    else:
        raise AssertionError(f"unresolved strategy {plan.strategy!r}")
    inner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
    _rebind(optimizers, names, inner)
    return wrapped


def fsdp_blocks(model: nn.Module, block_types: tuple[type[nn.Module], ...] | None) -> list[nn.Module]:
    """The modules ``fully_shard`` is applied to before the root, deepest first: instances of
    ``block_types``, or by default every element of an ``nn.ModuleList`` (that has parameters)."""
    if block_types:
        found = [m for m in model.modules() if m is not model and isinstance(m, block_types)]
        if not found:
            raise InvalidArgumentError(
                f"block_types={[t.__name__ for t in block_types]} matches no submodule of "
                f"{type(model).__name__}; name the class of its repeated blocks (e.g. the transformer layer)"
            )
    else:
        found = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    seen: set[int] = set()
    blocks = []
    for m in reversed(found):  # modules() is pre-order, so reversed puts inner blocks first
        if id(m) not in seen and any(True for _ in m.parameters()):
            seen.add(id(m))
            blocks.append(m)
    return blocks


def _fully_shard(model: nn.Module, device: torch.device, block_types: tuple[type[nn.Module], ...] | None) -> nn.Module:
    """Shard without ever holding the whole model on ``device``: keep rank 0's values where the user
    built them, turn the model into meta tensors, shard it, give memory to the local shards only
    (``to_empty``), then fill them from rank 0, one tensor at a time. A model with meta tensors is
    sharded as it is and materialised by the user afterwards (``to_empty`` and initialisation)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    deferred = any(t.is_meta for t in tensors)
    rank0: dict[str, torch.Tensor] = {}
    if deferred:
        _broadcast_from_rank0(model)
    else:
        if dist.get_rank() == 0:  # the values every rank starts from (as DDP does): kept, not copied
            rank0 = {n: t.detach() for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}
        del tensors
        _to_meta(model)  # frees this rank's own full copy (rank 0's lives on in ``rank0``)
    blocks = fsdp_blocks(model, block_types)
    kinds = sorted({type(b).__name__ for b in blocks})
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not deferred:
        model.to_empty(device=device)  # memory for the local shards (and the buffers) only
        _fill_from_rank0(model, rank0, device)
    logger.info(
        "shardsafe runtime: fsdp sharded %d block(s) %s and the root over %d ranks", len(blocks), kinds, mesh.size()
    )
    return model


def _to_meta(model: nn.Module) -> None:
    """``model.to("meta")``, keeping tied parameters (and shared buffers) tied: moving to another kind of
    device makes a new tensor for every module that holds one."""
    shared: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    shared.setdefault(id(t), []).append((module, kind, name))
    model.to(torch.device("meta"))
    for places in shared.values():
        first_module, kind, first_name = places[0]
        first = getattr(first_module, kind)[first_name]
        for module, kind, name in places[1:]:
            getattr(module, kind)[name] = first


def _fill_from_rank0(model: nn.Module, rank0: dict[str, torch.Tensor], device: torch.device) -> None:
    """(every rank, in the same order) Broadcast each parameter and buffer from rank 0, one at a time,
    and keep this rank's box of it: at most one whole tensor is on ``device`` beside the shards."""
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name in rank0:
                full = rank0.pop(name).to(device).contiguous()
            else:
                full = torch.empty(t.shape, dtype=t.dtype, device=device)
            dist.broadcast(full, src=0)
            if isinstance(t, DTensor):
                _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                local = t.to_local()
                box = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
                local.copy_(full[box])
            else:
                t.copy_(full)
            del full


def _broadcast_from_rank0(model: nn.Module) -> None:
    """Make every rank start from rank 0's weights before sharding a model with meta tensors: the
    tensors that have data are broadcast in place; the meta ones are the user's to initialise."""
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.is_meta:
                continue  # materialised after sharding by the user (to_empty + init)
            buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
            dist.broadcast(buf, src=0)
            if buf.data_ptr() != t.data_ptr():
                t.detach().copy_(buf)


def _to(model: nn.Module, device: torch.device) -> nn.Module:
    if any(p.is_meta for p in itertools.chain(model.parameters(), model.buffers())):
        return model  # a meta model has no data to move
    return model.to(device)


def _check_optimizers(optimizers: Sequence[torch.optim.Optimizer], names: dict[int, str], strategy: str) -> None:
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise InvalidTypeError(f"setup(): argument {i + 2} is a {type(opt).__name__}, not a torch.optim.Optimizer")
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise InvalidArgumentError(
                        f"setup(): optimizer {i} ({type(opt).__name__}) holds a parameter of shape {tuple(p.shape)} "
                        "that is not a parameter of the model; build each optimizer from model.parameters()"
                    )
        if strategy == "fsdp" and len(opt.state) > 0:
            raise InvalidArgumentError(
                f"setup(): optimizer {i} ({type(opt).__name__}) has already stepped; with strategy='fsdp' its "
                "state would not match the sharded parameters. Call setup() before the first optimizer step"
            )


def _rebind(optimizers: Sequence[torch.optim.Optimizer], names: dict[int, str], module: nn.Module) -> None:
    """Point each optimizer at ``module``'s current parameters, by name (a no-op when they are the same)."""
    current = dict(module.named_parameters())
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [current[names[id(p)]] for p in group["params"]]


_LOADER_SETTINGS = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
)
"""What a rebuilt loader keeps of the user's (its sampler is replaced by a ``DistributedSampler``)."""


def shard_loader(loader: DataLoader, *, rank: int, world_size: int, seed: int) -> DataLoader:  # type: ignore[type-arg]
    """(every rank) ``loader`` with a ``DistributedSampler``: each rank reads ``1/world_size`` of the data."""
    if world_size == 1 or isinstance(loader.sampler, DistributedSampler):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        raise InvalidArgumentError(
            "setup_dataloader(): an IterableDataset cannot be given a sampler, and unsharded every rank would "
            "read the same data. Shard it inside the dataset (by rt.rank and rt.world_size) and use the loader "
            "as it is"
        )
    if not isinstance(loader.batch_sampler, BatchSampler) or type(loader.sampler) not in (
        RandomSampler,
        SequentialSampler,
    ):
        raise InvalidArgumentError(
            f"setup_dataloader(): the loader uses its own sampler ({type(loader.sampler).__name__}) or batch "
            "sampler; make it shard by rank itself (e.g. wrap it in a DistributedSampler) and pass the loader "
            "on unchanged"
        )
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        drop_last=loader.drop_last,
    )
    kept = {name: getattr(loader, name) for name in _LOADER_SETTINGS}
    prefetch = loader.prefetch_factor if loader.num_workers > 0 else None
    return DataLoader(loader.dataset, sampler=sampler, prefetch_factor=prefetch, **kept)
