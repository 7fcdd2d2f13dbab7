"""Where this rank's data of a tensor sits in the global tensor: a list of boxes (global offsets, data).

- A plain tensor is one box, the whole tensor, held identically by every rank (``replicated``).
- A DTensor is usually one box (its local shard). Replicated mesh dimensions mean several ranks hold
  the same box: only the one at coordinate 0 on those dimensions writes it (``owner``). A mesh that
  is a slice of a larger mesh (``mesh["dp"]`` of a dp x tp mesh) is replicated over the dimensions it
  does not cover: only the slice at coordinate 0 on them writes. ``_StridedShard`` placements (FSDP2
  over tensor parallelism) are resolved index by index, so a local shard that is not one box in the
  global tensor becomes several boxes instead of a wrong offset.
- A ``ShardedTensor`` (FSDP1's sharded state dict without a device mesh) is its local shards, each
  with the global offsets its metadata carries.

A DTensor whose placements are ``Shard``, ``_StridedShard`` and ``Replicate`` also gets its sharding as
a :class:`Rule` (format v3, docs/format.md section 3b), the same on every rank: the writers' mesh (the
owners: coordinate 0 on replicated dimensions, the first slice of a sliced mesh) and, per sharded
mesh dimension, the tensor dimension and split factor. The save describes such a tensor by its rule
instead of one chunk per rank.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from shardsafe.errors import UnsafeValueError

Box = tuple[tuple[int, ...], torch.Tensor]
"""(global offsets, this rank's data for the box, shaped like the box)"""

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class Rule:
    """A DTensor's sharding as every rank sees it: the writers' grid (``mesh_shape``, global ranks in
    row-major order) and, per mesh dimension of that grid, (tensor dimension, split factor)."""

    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dims: tuple[tuple[int, int], ...]


@dataclass
class Layout:
    """This rank's part of one global tensor."""

    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    boxes: list[Box]  # this rank's data; may be empty (an FSDP1 rank holding none of a parameter)
    replicated: bool  # every rank holds the whole tensor (plain tensors, fully replicated DTensors)
    owner: bool  # this rank writes its boxes (False for the replicas of a sharded box)
    rule: Rule | None = None  # (saves) its sharding as a rule, where it is one


def is_sharded_tensor(t: Any) -> bool:
    cls = type(t)
    return cls.__name__ == "ShardedTensor" and cls.__module__.startswith("torch.distributed._shard")


def layout_of(t: torch.Tensor, *, roles: bool = True) -> Layout:
    """(every rank, locally, no collective) The layout of a plain tensor, DTensor or ShardedTensor.
    ``roles=False`` (loads, which only need the boxes): ``replicated`` and ``owner`` are not worked
    out, so a mesh or process group whose replicas cannot be told apart is not refused."""
    if DTensor is not None and isinstance(t, DTensor):
        return _dtensor_layout(t, roles)
    if is_sharded_tensor(t):
        return _sharded_tensor_layout(t, roles)
    data = t.detach()
    return Layout(tuple(data.shape), data.dtype, [((0,) * data.dim(), data)], True, True)


def _dtensor_layout(dt: Any, roles: bool) -> Layout:
    placements = tuple(dt.placements)
    if any(p.is_partial() for p in placements):
        raise UnsafeValueError(
            "a DTensor with Partial placement must be reduced before it is saved or loaded into (it holds partial sums)"
        )
    mesh = dt.device_mesh
    shape = tuple(int(n) for n in dt.shape)
    inner = getattr(dt, "_local_tensor", None)  # what to_local() returns, without its autograd node
    local = (inner if isinstance(inner, torch.Tensor) else dt.to_local()).detach()
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing of the tensor
        return Layout(shape, local.dtype, [], False, False)
    replicate_dims = [i for i, p in enumerate(placements) if p.is_replicate()]
    owner = (all(coord[i] == 0 for i in replicate_dims) and _first_slice(mesh)) if roles else True
    replicated = len(replicate_dims) == len(placements) and (_spans_world(mesh) if roles else True)
    if all(p.is_replicate() or type(p).__name__ == "Shard" for p in placements):
        boxes = [(_offsets(shape, mesh, placements), local)]
    else:
        boxes = _indexed_boxes(shape, local, mesh, placements, coord)
    rule = _rule(mesh, placements, len(shape)) if roles and not replicated else None
    return Layout(shape, local.dtype, boxes, replicated, owner, rule)


@functools.lru_cache(maxsize=4096)  # once per shape, mesh and placements: every layer's tensors share them
def _offsets(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> tuple[int, ...]:
    """This rank's global offsets of a DTensor of ``shape`` (``Shard``/``Replicate`` placements)."""
    _, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(o) for o in offsets)


def _rule(mesh: Any, placements: tuple[Any, ...], ndim: int) -> Rule | None:
    """The sharding of a DTensor as a :class:`Rule`, or ``None`` where its placements are other than
    ``Shard``, ``_StridedShard`` and ``Replicate`` or its writers cannot be told from its mesh."""
    dims: list[tuple[int, int]] = []
    for p in placements:
        kind = type(p).__name__
        if p.is_replicate():
            continue
        if kind not in ("Shard", "_StridedShard") or not ndim:
            return None
        factor = int(getattr(p, "split_factor", 1)) if kind == "_StridedShard" else 1
        dims.append((int(p.dim) % ndim, factor))
    grid = _writers(mesh, tuple(i for i, p in enumerate(placements) if p.is_replicate()))
    if grid is None:
        return None
    return Rule(grid[0], grid[1], tuple(dims))


@functools.lru_cache(maxsize=256)  # once per mesh and pattern, not once per tensor
def _writers(mesh: Any, replicated: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The writers' grid of ``mesh`` with ``replicated`` dimensions taken at coordinate 0: the ranks
    of the first slice (:func:`_first_slice`) of a mesh sliced from a larger one."""
    grid = _first_grid(mesh)
    if grid is None:
        return None
    sub = grid[tuple(0 if i in replicated else slice(None) for i in range(grid.dim()))]
    return tuple(int(n) for n in sub.shape), tuple(int(r) for r in sub.reshape(-1).tolist())


def _first_grid(mesh: Any) -> torch.Tensor | None:
    """The ranks, shaped like ``mesh.mesh``, of the slice of ``mesh``'s root that writes (``mesh``
    itself when it spans the world); ``None`` when the root does not show it plainly (a flattened or
    reordered slice)."""
    own = mesh.mesh
    if _spans_world(mesh):
        return own  # type: ignore[no-any-return]
    try:
        root = _root(mesh)
    except Exception:  # any failure to find the root: the tensor is listed chunk by chunk
        return None
    ranks = root.mesh
    if root is mesh or int(ranks.numel()) == int(own.numel()):
        return None
    where = [tuple(int(c) for c in (ranks == r).nonzero()[0].tolist()) for r in own.flatten().tolist()]
    covered = [d for d in range(ranks.dim()) if len({w[d] for w in where}) > 1]
    if len(covered) != own.dim():
        return None
    mine = ranks[tuple(slice(None) if d in covered else where[0][d] for d in range(ranks.dim()))]
    first = ranks[tuple(slice(None) if d in covered else 0 for d in range(ranks.dim()))]
    if tuple(mine.shape) != tuple(own.shape) or not torch.equal(mine, own):
        return None
    return first  # type: ignore[no-any-return]


def _indexed_boxes(
    shape: tuple[int, ...], local: torch.Tensor, mesh: Any, placements: tuple[Any, ...], coord: list[int]
) -> list[Box]:
    """Boxes of a DTensor with placements beyond Shard/Replicate (``_StridedShard``): the global index
    of every local row is found by splitting an index tensor exactly as the placements split data
    (each placement's own ``_split_tensor``, mesh dimensions left to right); runs of consecutive
    indices become boxes."""
    runs = _index_runs(shape, mesh, placements, tuple(coord))
    for d, n in enumerate(local.shape):
        if sum(r[2] for r in runs[d]) != n:
            raise UnsafeValueError(
                f"DTensor layout {placements} on mesh {tuple(mesh.shape)} does not match its local shard "
                f"{tuple(local.shape)} along dim {d}"
            )
    boxes = []
    for combo in itertools.product(*runs):
        offsets = tuple(g for g, _, _ in combo)
        view = local[tuple(slice(lo, lo + n) for _, lo, n in combo)]
        boxes.append((offsets, view))
    return boxes


@functools.lru_cache(maxsize=1024)  # once per shape, mesh and placements: every layer's tensors share them
def _index_runs(
    shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], coord: tuple[int, ...]
) -> list[list[tuple[int, int, int]]]:
    """Per dimension, the runs of global indices (:func:`_runs`) this coordinate's local shard holds."""
    index = [torch.arange(n).view([n if d == k else 1 for k in range(len(shape))]) for d, n in enumerate(shape)]
    for i, p in enumerate(placements):
        if p.is_replicate():
            continue
        split = getattr(p, "_split_tensor", None)
        if split is None or not hasattr(p, "dim"):
            raise UnsafeValueError(f"DTensor placement {p!r} is not supported (Shard, _StridedShard, Replicate are)")
        parts, _ = split(index[p.dim], mesh.size(i), with_padding=False)
        index[p.dim] = parts[coord[i]] if coord[i] < len(parts) else index[p.dim][..., :0]
    return [_runs(index[d].reshape(-1).tolist()) for d in range(len(shape))]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive global indices: (global start, local start, length)."""
    out: list[tuple[int, int, int]] = []
    for pos, g in enumerate(indices):
        if out and out[-1][0] + out[-1][2] == g:
            start, lo, n = out[-1]
            out[-1] = (start, lo, n + 1)
        else:
            out.append((g, pos, 1))
    return out


def _root(mesh: Any) -> Any:
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # torch < 2.8

    return _mesh_resources.get_root_mesh(mesh)


def _spans_world(mesh: Any) -> bool:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return int(mesh.mesh.numel()) >= world


@functools.lru_cache(maxsize=256)  # once per mesh, not once per tensor (meshes live as long as the model)
def _first_slice(mesh: Any) -> bool:
    """Whether ``mesh`` is, among the slices of its root mesh that hold the same data, the one at
    coordinate 0 on every root dimension it does not cover. A mesh over every rank is its own root."""
    if _spans_world(mesh):
        return True
    root = _root(mesh)
    ranks = root.mesh
    if root is mesh or int(ranks.numel()) == int(mesh.mesh.numel()):
        import torch.distributed as dist

        raise UnsafeValueError(
            f"a DTensor lives on a device mesh of ranks {mesh.mesh.flatten().tolist()}, fewer than the "
            f"{dist.get_world_size()} ranks saving, and no larger mesh it was sliced from is known, so shardsafe "
            "cannot tell which other ranks hold copies of it. Build meshes with init_device_mesh over every rank "
            "and slice them (mesh['dp'])."
        )
    mine = mesh.mesh.flatten().tolist()
    where = [tuple(int(c) for c in (ranks == r).nonzero()[0].tolist()) for r in mine]
    covered = [d for d in range(ranks.dim()) if len({w[d] for w in where}) > 1]
    return all(where[0][d] == 0 for d in range(ranks.dim()) if d not in covered)


def _sharded_tensor_layout(st: Any, roles: bool) -> Layout:
    import torch.distributed as dist

    pg = getattr(st, "_process_group", None)
    if roles and pg is not None and dist.is_initialized() and dist.get_world_size(pg) < dist.get_world_size():
        raise UnsafeValueError(
            "a ShardedTensor sharded over a process group smaller than the world (FSDP1 hybrid sharding without a "
            "device mesh): shardsafe cannot tell which ranks hold its replicas. Pass the FSDP1 module itself "
            "(shardsafe saves it without a state dict), or build it with a device_mesh."
        )
    shape = tuple(int(n) for n in st.size())
    dtype = st.dtype
    boxes: list[Box] = []
    for shard in st.local_shards():
        offsets = tuple(int(o) for o in shard.metadata.shard_offsets)
        boxes.append((offsets, shard.tensor.detach()))
    return Layout(shape, dtype, boxes, False, True)
