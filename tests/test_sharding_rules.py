"""Sharding rules (format v3, docs/format.md section 3b) in one process: a rule's boxes are exactly
what DTensor placements give each mesh coordinate (``Shard``, uneven and empty pieces, a dimension
split twice, ``_StridedShard``, ``Replicate``), the boxes that meet a region are found without
visiting every coordinate, and a hostile rule or mesh is refused when the manifest is read, in time
bounded by the manifest's own size."""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import shardsafe
from shardsafe.format import sharding
from shardsafe.format.manifest import parse_manifest, seal_manifest
from shardsafe.format.sharding import Mesh, Sharding, all_boxes, boxes, overlapping


def _torch_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: list[Any], coord: list[int]) -> list:
    """The boxes DTensor gives ``coord``: every global index split as each placement's ``_split_tensor``
    splits data, mesh dimensions left to right (what ``state/layout.py`` does for a live DTensor), as
    runs of consecutive indices."""
    index = [torch.arange(n) for n in shape]
    for i, p in enumerate(placements):
        if p.is_replicate():
            continue
        along = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
        parts, _ = along._split_tensor(index[p.dim], mesh_shape[i], with_padding=False)
        index[p.dim] = parts[coord[i]] if coord[i] < len(parts) else index[p.dim][:0]
    runs = []
    for idx in index:
        out: list[list[int]] = []
        for g in idx.tolist():
            if out and out[-1][0] + out[-1][1] == g:
                out[-1][1] += 1
            else:
                out.append([g, 1])
        runs.append(out)
    if any(not r for r in runs):
        return []
    return sorted((tuple(r[0] for r in c), tuple(r[1] for r in c)) for c in itertools.product(*runs))


def _rule(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: list[Any]) -> tuple[Sharding, Mesh]:
    """The rule a writer makes of ``placements`` (state/layout.py): replicated mesh dimensions dropped."""
    kept = [i for i, p in enumerate(placements) if not p.is_replicate()]
    dims = tuple(
        (p.dim, int(p.split_factor) if isinstance(p, _StridedShard) else 1) for p in placements if not p.is_replicate()
    )
    shape_kept = tuple(mesh_shape[i] for i in kept)
    return Sharding(0, dims), Mesh(shape_kept, tuple(range(math.prod(shape_kept))))


def _random_layout(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    ndim = rng.choice([1, 1, 2, 2, 3])
    shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 10, 13, 16]) for _ in range(ndim))
    mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2, 2, 3])))
    placements: list[Any] = []
    for _ in mesh_shape:
        kind = rng.choice(["shard", "shard", "replicate", "strided"])
        d = rng.randrange(ndim)
        if kind == "shard":
            placements.append(Shard(d))
        elif kind == "replicate":
            placements.append(Replicate())
        else:
            placements.append(_StridedShard(d, split_factor=rng.choice([2, 3, 4])))
    return shape, mesh_shape, placements


def test_rule_boxes_are_the_dtensor_placements_boxes() -> None:
    """Fails if a rule's split differs from torch's anywhere (uneven or empty pieces, nested splits of
    one dimension, strided splits): 300 random layouts, every coordinate."""
    rng = random.Random(3)
    checked = 0
    for _ in range(300):
        shape, mesh_shape, placements = _random_layout(rng)
        rule, mesh = _rule(shape, mesh_shape, placements)
        kept = [i for i, p in enumerate(placements) if not p.is_replicate()]
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            want = _torch_boxes(shape, mesh_shape, placements, list(coord))
            got = sorted(boxes(shape, rule, mesh, [coord[i] for i in kept]))
            assert got == want, (shape, mesh_shape, placements, coord)
            checked += 1
        if all(not isinstance(p, _StridedShard) for p in placements) and math.prod(shape):
            for coord in itertools.product(*(range(n) for n in mesh_shape)):  # torch's own offset function
                size, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
                mine = boxes(shape, rule, mesh, [coord[i] for i in kept])
                assert mine == ([(tuple(offset), tuple(size))] if math.prod(size) else []), (shape, placements, coord)
    assert checked > 1000


def test_every_element_is_in_exactly_one_box() -> None:
    """Also: all_boxes (which skips coordinates without elements) and count_boxes are the boxes of
    every coordinate, walked one by one."""
    rng = random.Random(5)
    for _ in range(200):
        shape, mesh_shape, placements = _random_layout(rng)
        rule, mesh = _rule(shape, mesh_shape, placements)
        covered = torch.zeros(shape, dtype=torch.int32)
        for _, (offsets, sizes) in all_boxes(shape, rule, mesh):
            covered[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
        assert bool((covered == 1).all()), (shape, mesh_shape, placements)
        walked = sorted((i, b) for i in range(len(mesh.ranks)) for b in boxes(shape, rule, mesh, mesh.coordinate(i)))
        assert sorted(all_boxes(shape, rule, mesh)) == walked
        assert sharding.count_boxes(shape, rule, mesh) == len(walked)


def test_a_huge_mesh_costs_only_its_boxes() -> None:
    """A 3-row tensor ruled over 2^22 writers (a manifest may list that many): its 3 boxes are found
    without visiting the 2^22 coordinates, and counted from the rule alone (inspect)."""
    n = 2**22
    mesh = Mesh((n,), tuple(range(n)))
    for dims in (((0, 1),), ((0, 2),)):
        rule = Sharding(0, dims)
        found = list(all_boxes((3, 5), rule, mesh))
        assert len(found) == 3 and sharding.count_boxes((3, 5), rule, mesh) == 3


def test_overlapping_finds_exactly_the_boxes_that_meet_a_region() -> None:
    rng = random.Random(7)
    for _ in range(400):
        shape, mesh_shape, placements = _random_layout(rng)
        if not math.prod(shape):
            continue
        rule, mesh = _rule(shape, mesh_shape, placements)
        lo = tuple(rng.randrange(n) for n in shape)
        size = tuple(rng.randrange(1, n - o + 1) for o, n in zip(lo, shape, strict=True))

        def meets(box: tuple[tuple[int, ...], tuple[int, ...]], lo: Any = lo, size: Any = size) -> bool:
            return all(max(a, b) < min(a + s, b + t) for a, s, b, t in zip(box[0], box[1], lo, size, strict=True))

        want = sorted((i, b) for i, b in all_boxes(shape, rule, mesh) if meets(b))
        assert sorted(overlapping(shape, rule, mesh, (lo, size))) == want, (shape, mesh_shape, placements, lo, size)


def test_overlapping_does_not_visit_every_coordinate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's own rows of a tensor split over 2^20 writers: a handful of pieces are cut, not 2^20
    (fails if the search walks the coordinates)."""
    calls = 0
    real = sharding.part

    def counted(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(sharding, "part", counted)
    n = 2**20
    mesh = Mesh((n,), tuple(range(n)))
    rule = Sharding(0, ((0, 1),))
    found = overlapping((3 * n - 5, 64), rule, mesh, ((3 * 777, 0), (3, 64)))
    assert found == [(777, ((3 * 777, 0), (3, 64)))]
    assert calls <= 4
    calls = 0
    hsdp_tp = Mesh((1024, 8), tuple(range(8192)))  # dp x tp, FSDP over tensor parallelism
    rule = Sharding(0, ((0, 8), (0, 1)))
    found = overlapping((8192 * 4, 16), rule, hsdp_tp, ((100, 0), (1, 16)))
    assert len(found) == 1 and calls <= 64


# ------------------------------------------------------------------------------- hostile rules


def _ruled(tmp_path: Any) -> dict[str, Any]:
    """A valid sealed v3 manifest document with one ruled tensor (its files need not exist: these
    rules are refused before any file is read)."""
    path = tmp_path / "c"
    shardsafe.save(path, {"w": torch.zeros(4, 2)})
    doc: dict[str, Any] = json.loads((path / "MANIFEST.json").read_text())
    doc["world_size"] = 4
    doc["meshes"] = [{"shape": [4], "ranks": [0, 1, 2, 3]}]
    doc["tensors"]["w"] = {"dtype": "float32", "shape": [4, 2], "sharding": {"mesh": 0, "dims": [[0, 1]]}}
    parse_manifest(json.dumps(seal_manifest(doc)).encode(), "x")  # valid as it stands
    return doc


HOSTILE = [
    (
        "a 2^40-coordinate mesh",
        lambda d: (d.update(world_size=2**31 - 1), d["meshes"][0].update(shape=[2**20, 2**20])),
        "not one per coordinate",
    ),
    ("a mesh dimension past the world", lambda d: d["meshes"][0].update(shape=[5], ranks=[0] * 5), "dimension"),
    ("a rank outside the world", lambda d: d["meshes"][0].update(ranks=[0, 1, 2, 4]), r"a rank of meshes\[0\] is 4"),
    ("17 mesh dimensions", lambda d: d["meshes"][0].update(shape=[1] * 17, ranks=[0]), "more than 16"),
    ("a split factor of 2^17", lambda d: d["tensors"]["w"]["sharding"].update(dims=[[0, 2**17]]), "factor"),
    (
        "boxes past the budget",
        lambda d: (
            d["meshes"].append({"shape": [2, 2], "ranks": [0, 1, 2, 3]}),
            d["tensors"]["w"]["sharding"].update(mesh=1, dims=[[0, 300], [1, 300]]),
        ),
        "boxes per coordinate",
    ),
    ("a tensor dim past the shape", lambda d: d["tensors"]["w"]["sharding"].update(dims=[[2, 1]]), "tensor dim"),
    ("a missing mesh", lambda d: d["tensors"]["w"]["sharding"].update(mesh=1), "mesh"),
    ("dims of another mesh", lambda d: d["tensors"]["w"]["sharding"].update(dims=[[0, 1], [1, 1]]), "dims for mesh"),
    ("a rule and chunks", lambda d: d["tensors"]["w"].update(chunks=[]), "unexpected field"),
    ("a rule with no meshes", lambda d: d.update(meshes=[]), "lists no meshes"),
    ("a float factor", lambda d: d["tensors"]["w"]["sharding"].update(dims=[[0, 1.0]]), "factor"),
    ("a string mesh", lambda d: d["tensors"]["w"]["sharding"].update(mesh="0"), "mesh"),
    ("a bool rank", lambda d: d["meshes"][0].update(ranks=[0, 1, 2, True]), "a rank"),
]


@pytest.mark.parametrize("what, change, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_rules_are_refused_when_read(tmp_path: Any, what: str, change: Any, words: str) -> None:
    doc = _ruled(tmp_path)
    change(doc)
    raw = json.dumps(seal_manifest(doc)).encode()
    with pytest.raises(shardsafe.CorruptCheckpointError, match=words):
        parse_manifest(raw, "ckpt/MANIFEST.json")


# ------------------------------------------------------------------------------- the save's plan


def _item(name: str, shape: tuple[int, ...], rank: int, boxes_held: list[Any], rule: Any) -> Any:
    from shardsafe.state.flatten import TensorItem

    pieces = [(o, torch.empty(s, device="meta")) for o, s in boxes_held]
    first = pieces[0] if pieces else ((0,) * len(shape), torch.empty((0,) * len(shape), device="meta"))
    return TensorItem(name, first[1], shape, first[0], False, True, True, pieces, rule)


def test_save_plan_orders_ruled_chunks_as_the_format_does_and_refuses_a_rule_its_boxes_contradict() -> None:
    """Rank 1 of 4 (10 rows: 3, 3, 3, 1; a strided tensor's two boxes): its ruled chunks in manifest
    order, each tensor's boxes in rule order; rank 0: its listed chunk (the step) first; a rule that places other boxes
    on the rank than it holds is refused before anything is written (a manifest would place chunks
    where they are not)."""
    from shardsafe.engine.plan import plan_save
    from shardsafe.errors import CheckpointError
    from shardsafe.state.flatten import FlatState, TensorItem
    from shardsafe.state.layout import Rule

    even = Rule((4,), (0, 1, 2, 3), ((0, 1),))
    strided = Rule((2,), (1, 3), ((0, 2),))  # rank 1 at coordinate 0: rows 0-2 and 5-7 of 10
    step = TensorItem("s", torch.empty((), device="meta"), (), (), True, True)
    items = [
        _item("b", (10, 2), 1, [((5, 0), (3, 2)), ((0, 0), (3, 2))], strided),
        _item("a", (10, 2), 1, [((3, 0), (3, 2))], even),
        step,
    ]
    plan = plan_save(FlatState(objects={}, items=items, strategy="fsdp"), 1, 4)
    assert plan.ruled == 3 and set(plan.rules.tensors) == {"a", "b"}
    assert [(c.name, c.offsets) for c in plan.chunks] == [("b", (0, 0)), ("b", (5, 0)), ("a", (3, 0))]
    rank0 = [_item("a", (10, 2), 0, [((0, 0), (3, 2))], even), step]
    zero = plan_save(FlatState(objects={}, items=rank0, strategy="fsdp"), 0, 4)  # rank 0 writes the step
    assert [(c.name, c.offsets) for c in zero.chunks] == [("s", ()), ("a", (0, 0))] and zero.ruled == 1
    assert [m.ranks for m in plan.rules.meshes] == [(1, 3), (0, 1, 2, 3)]
    wrong = [_item("a", (10, 2), 1, [((2, 0), (4, 2))], even)]
    with pytest.raises(CheckpointError, match="sharding rule of tensor 'a'"):
        plan_save(FlatState(objects={}, items=wrong, strategy="fsdp"), 1, 4)
    outside = [_item("a", (10, 2), 1, [((3, 0), (3, 2))], Rule((4,), (0, 1, 2, 9), ((0, 1),)))]
    plan = plan_save(FlatState(objects={}, items=outside, strategy="fsdp"), 1, 4)
    assert plan.ruled == 0 and not plan.rules.tensors  # writers outside the saving group: listed
