"""DCP's side of bench/scale_sim.py, on the same layouts (bench/scale_layouts.py).

Save: every rank's local plan is the list of ``WriteItem``\\ s DCP's ``create_local_plan`` makes of its
state dict (``planner_helpers._create_write_items``: a ``SHARD`` item per DTensor, its box from
``compute_local_shape_and_global_offset``, which calls the same ``_compute_local_shape_and_global_offset``
used here with the rank's coordinate; a ``TENSOR`` item per plain tensor on every rank; ``BYTE_IO``
items for the non-tensor values on the coordinator), with the flattening mapping DCP keeps in
``planner_data``. The coordinator's work is ``DefaultSavePlanner.create_global_plan`` (de-duplication,
metadata, validation), timed, and the ``.metadata`` file is what ``FileSystemWriter.finish`` writes:
the metadata with one ``_StorageInfo`` per item (file ``__<rank>_0.distcp``, offset, length),
pickled. ``check_local_plan`` builds one rank's plan with DCP's own ``create_local_plan`` on real
DTensors (a fake process group) and compares it with the one built here.

Load: one rank reads and unpickles ``.metadata`` and runs ``DefaultLoadPlanner.set_up_planner`` and
``create_local_plan`` on its real DTensors (bench/scale_rank.py).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from bench.scale_layouts import Layout, coordinate, placements

PARAM_GROUP = {
    "lr": 3e-4,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.1,
    "amsgrad": False,
    "foreach": None,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


def fqns(layout: Layout) -> list[tuple[str, tuple[str, ...], str | None]]:
    """(DCP key, path in the nested state dict, parameter) of every tensor DCP saves of the layout."""
    out = []
    for name, _, _ in layout.model.params():
        out.append((f"model.{name}", ("model", name), name))
    for name, _, _ in layout.model.params():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            out.append((f"optim.state.{name}.{k}", ("optim", "state", name, k), name if k != "step" else None))
    return out


@functools.lru_cache(maxsize=1 << 16)
def _box(shape: tuple[int, ...], mesh: tuple[int, ...], where: tuple[Any, ...], coord: tuple[int, ...]) -> Any:
    size, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), list(where))
    return torch.Size(size), torch.Size(offset)


_F32 = TensorProperties(dtype=torch.float32)


def local_plan(layout: Layout, rank: int) -> SavePlan:
    """Rank ``rank``'s local save plan, as DCP makes it (module docstring)."""
    coord = coordinate(layout.mesh, rank)
    params = {n: (s, st) for n, s, st in layout.model.params()}
    items: list[WriteItem] = []
    mapping: dict[str, tuple[str, ...]] = {}
    for key, path, param in fqns(layout):
        mapping[key] = path
        if param is None:  # a plain 0-d step tensor, on every rank
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size(())),
                    type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(()), sizes=torch.Size(())),
                        properties=_F32,
                        size=torch.Size(()),
                    ),
                )
            )
            continue
        shape, style = params[param]
        sizes, offsets = _box(shape, layout.mesh, tuple(placements(layout.strategy, style)), coord)
        items.append(
            WriteItem(
                index=MetadataIndex(key, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=_F32,
                    size=torch.Size(shape),
                ),
            )
        )
    if rank == 0:  # non-tensor values: the coordinator writes them
        for k in PARAM_GROUP:
            key = f"optim.param_groups.0.{k}"
            mapping[key] = ("optim", "param_groups", "0", k)
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        key = "optim.param_groups.0.params"
        mapping[key] = ("optim", "param_groups", "0", "params")
        items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
    return SavePlan(items, planner_data=mapping)


def global_plan(plans: list[SavePlan], layout: Layout) -> dict[str, Any]:
    """The coordinator: ``create_global_plan`` (timed), then the ``.metadata`` file FileSystemWriter
    writes (storage info per item), pickled (timed)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    started, used = time.perf_counter(), time.process_time()
    final, metadata = planner.create_global_plan(plans)
    planned, planned_cpu = time.perf_counter() - started, time.process_time() - used
    params_bytes = len(_torch_bytes([n for n, _, _ in layout.model.params()]))
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rank, plan in enumerate(final):
        name = f"__{rank}_0.distcp"
        offset = 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                length = params_bytes if item.index.fqn.endswith("params") else 420
            else:
                assert item.tensor_data is not None
                length = math.prod(item.tensor_data.chunk.sizes) * 4
            storage[item.index] = _StorageInfo(name, offset, length)
            offset += length
    metadata = dataclasses.replace(metadata, storage_data=storage)
    metadata.version = "1.0.0"
    metadata.storage_meta = StorageMeta(checkpoint_id="/ckpt", save_id="a" * 32, load_id=None)
    started, used = time.perf_counter(), time.process_time()
    raw = pickle.dumps(metadata)
    pickled, pickled_cpu = time.perf_counter() - started, time.process_time() - used
    chunks = sum(len(p.items) for p in final)
    return {
        "seconds": planned,
        "cpu_seconds": planned_cpu,
        "pickle_seconds": pickled,
        "pickle_cpu_seconds": pickled_cpu,
        "raw": raw,
        "items": chunks,
    }


def _torch_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def metadata_of(raw: bytes) -> Metadata:
    out: Metadata = pickle.loads(raw)
    return out
