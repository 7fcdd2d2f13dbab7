"""Per-rank state: values that differ between ranks (RNG states, data-loader positions) are kept per
rank, never silently replaced by rank 0's.

At save, after :func:`~shardsafe.state.flatten.flatten` (every rank), riding on the save's first
agreement so that it costs no round of its own in the common case:

1. Each rank digests its ``value`` and ``stateful`` entries (never modules and optimizers, whose
   tensors the strategy keeps equal or shards): plain values exactly; plain tensors up to
   ``SHARDSAFE_PER_RANK_DIGEST_BYTES`` by their bytes, larger ones and DTensors by dtype and shape
   only; ``per_rank()`` values not at all (they are per rank anyway). With the entry digests it sends
   a digest and a structure signature for every node of those entries (:func:`digests`; when there are
   more than :data:`NODE_CAP`, none).
2. Rank 0 compares them (:func:`decide`) and, top-down, picks the smallest subtrees that differ (a
   dict, list or tuple whose keys or length agree on every rank is descended into). Only when some
   entry differs and some rank sent no node table does a second round ask for the nodes of the
   differing entries (:func:`nodes_of`, :func:`paths`).
3. Every rank turns those subtrees and its ``per_rank()`` values into ``per_rank`` nodes holding its
   own value (:func:`apply`), renames the tensors inside to ``/rank<r>/<name>`` (a name no other tensor
   can have: every other name starts with a non-empty top-level key) and writes them itself, whole.

Each rank's report carries its per-rank values (:func:`report`); rank 0 puts every rank's value into
each ``per_rank`` node of the manifest (:func:`merge_reports`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import xxhash

from shardsafe import knobs
from shardsafe.errors import InconsistentRanksError, UnsafeValueError
from shardsafe.format.datafile import tensor_bytes
from shardsafe.format.manifest import Chunk, TensorEntry
from shardsafe.format.values import PerRank, dtype_from_name, dtype_name
from shardsafe.state.flatten import FlatState, TensorItem

Path = list[Any]  # [entry key, step, ...]: dict keys, list/tuple indices


def per_rank(value: Any) -> PerRank:
    """Mark ``value`` (anything ``save`` stores, or a stateful object at the top level of the state) as
    this rank's own: every rank's value is saved, and ``load`` on the same number of ranks gives each
    rank its own back. Values that differ between ranks are found and kept per rank without the
    marker too (docs/format.md, "Per-rank values"); the marker also covers large tensors, which are
    compared by shape only."""
    return PerRank(value)


# ------------------------------------------------------------------------------------- tree walk


def _children(node: Any) -> list[tuple[Any, Any]]:
    if isinstance(node, list):
        return list(enumerate(node))
    if isinstance(node, dict) and node.get("$") == "dict":
        return [(k, v) for k, v in node["items"]]
    if isinstance(node, dict) and node.get("$") == "tuple":
        return list(enumerate(node["items"]))
    return []


def _signature(node: Any) -> str:
    """What must agree between ranks for a node's children to be compared one by one."""
    if isinstance(node, list):
        return f"list{len(node)}"
    if isinstance(node, dict) and node.get("$") == "dict":
        return "dict" + json.dumps([k for k, _ in node["items"]])
    if isinstance(node, dict) and node.get("$") == "tuple":
        return f"tuple{len(node['items'])}"
    if isinstance(node, dict) and node.get("$") == "per_rank":
        return "per_rank"
    return "leaf"


def _get(objects: dict[str, dict[str, Any]], path: Path) -> Any:
    node = objects[path[0]]["value"]
    for step in path[1:]:
        node = dict(_children(node))[step]
    return node


def _set(objects: dict[str, dict[str, Any]], path: Path, new: Any) -> None:
    if len(path) == 1:
        objects[path[0]]["value"] = new
        return
    parent, step = _get(objects, path[:-1]), path[-1]
    if isinstance(parent, list):
        parent[step] = new
    elif parent["$"] == "tuple":
        parent["items"][step] = new
    else:
        for pair in parent["items"]:
            if pair[0] == step:
                pair[1] = new


def _walk(node: Any, path: Path, visit: Callable[[Path, Any], bool]) -> None:
    """Depth first, parents before children; ``visit`` returns False to skip a subtree."""
    if visit(path, node):
        for step, child in _children(node):
            _walk(child, [*path, step], visit)


# ------------------------------------------------------------------------------------- digests


def _digests(node: Any, path: Path, items: dict[str, TensorItem], out: dict[str, tuple[str, str]] | None) -> str:
    """The digest of a node (xxh3-128 over its value and structure); with ``out``, also record
    ``json(path) -> (digest, signature)`` for it and every node below."""
    sig = _signature(node)
    if sig == "per_rank":
        digest = "per_rank"
    elif sig == "leaf":
        tag = node.get("$") if isinstance(node, dict) else None
        if tag in ("tensor", "ndarray"):
            digest = f"{tag}:{_tensor_digest(items[node['ref']])}"
        else:
            digest = xxhash.xxh3_128_hexdigest(json.dumps(node, sort_keys=True, allow_nan=True).encode())
    else:
        h = xxhash.xxh3_128(sig.encode())
        for step, child in _children(node):
            h.update(_digests(child, [*path, step], items, out).encode())
        digest = h.hexdigest()
    if out is not None:
        out[json.dumps(path)] = (digest, sig)
    return digest


def _tensor_digest(item: TensorItem) -> str:
    meta = f"{item.local.dtype}|{list(item.shape)}|{item.replicated}"
    if item.dtensor or item.nbytes > knobs.per_rank_digest_bytes():
        return meta  # placed by the strategy, or too large to compare: assumed equal (docs/format.md)
    data = item.local.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return meta + "|" + xxhash.xxh3_128_hexdigest(tensor_bytes(data.contiguous()))


def _compared(flat: FlatState) -> list[str]:
    return [k for k, obj in flat.objects.items() if obj["kind"] in ("value", "stateful")]


# ------------------------------------------------------------------------------------- the exchange


NODE_CAP = 2000
"""At most this many node digests per rank ride on a save's arrival message; with more, rank 0 asks for
the nodes of the differing entries in a round of their own (only when some entry differs)."""


def digests(flat: FlatState) -> tuple[dict[str, list[str]], dict[str, list[str]] | None]:
    """(every rank, before the save's rendezvous) This rank's side of the per-rank comparison: for every
    entry, its kind and (for value and stateful entries) its digest; and the digest and structure of
    every node of those entries, or ``None`` when there are more than :data:`NODE_CAP`."""
    items = {i.name: i for i in flat.items}
    entries = {k: [obj["kind"], ""] for k, obj in flat.objects.items()}
    nodes: dict[str, tuple[str, str]] = {}
    for key in _compared(flat):
        entries[key][1] = _digests(flat.objects[key]["value"], [key], items, nodes)
    table = {k: list(v) for k, v in nodes.items()} if len(nodes) <= NODE_CAP else None
    return entries, table


def nodes_of(flat: FlatState, keys: list[str]) -> dict[str, list[str]]:
    """(every rank, when rank 0 asks) The digest and structure of every node of the entries ``keys``."""
    items = {i.name: i for i in flat.items}
    nodes: dict[str, tuple[str, str]] = {}
    for key in keys:
        _digests(flat.objects[key]["value"], [key], items, nodes)
    return {k: list(v) for k, v in nodes.items()}


def decide(
    flat: FlatState, entries: list[dict[str, list[str]]], nodes: list[dict[str, list[str]] | None], target: str
) -> tuple[list[Path] | None, list[str]]:
    """(rank 0, every rank's :func:`digests` in rank order) The subtrees to keep per rank, or ``None``
    when some rank sent no node table and some entries differ (then a round with :func:`nodes_of`
    follows, and :func:`paths` decides); and the entries that differ. Raises :class:`CheckpointError`
    when the ranks' entries themselves differ (every rank raises it)."""
    differ = _differing_entries(flat, entries, target)
    if not differ:
        return [], []
    if any(n is None for n in nodes):
        return None, differ
    return paths(flat, differ, [n for n in nodes if n is not None]), differ


def paths(flat: FlatState, differ: list[str], tables: list[dict[str, list[str]]]) -> list[Path]:
    """(rank 0) The smallest subtrees of the entries ``differ`` that differ, from every rank's node table."""
    return _differing_paths(flat, differ, tables)


def apply(flat: FlatState, decided: list[Path], rank: int) -> None:
    """(every rank, once the per-rank subtrees are decided) Turn them, and this rank's ``per_rank()``
    values, into per-rank nodes of ``flat`` (see the module docstring)."""
    _mark(flat, decided, rank)


def _differing_entries(flat: FlatState, tables: list[dict[str, list[str]]], target: str) -> list[str]:
    """(rank 0) The value/stateful entries whose digest is not the same on every rank. Raises
    :class:`CheckpointError` (the other ranks get :class:`RemoteRankError`) when the ranks' entries
    themselves differ."""
    kinds = [{k: v[0] for k, v in table.items()} for table in tables]
    odd = [r for r, k in enumerate(kinds) if list(k.items()) != list(kinds[0].items())]
    if odd:
        raise InconsistentRanksError(
            f"save of {target!r}: ranks {odd} passed a state with other entries than rank 0 (rank 0: {kinds[0]}; "
            f"rank {odd[0]}: {kinds[odd[0]]}). Every rank must pass the same keys, of the same kinds, in the same "
            "order; put values that only some ranks have in a dict under one key."
        )
    return [k for k in _compared(flat) if len({t[k][1] for t in tables}) > 1]


def _differing_paths(flat: FlatState, keys: list[str], tables: list[dict[str, list[str]]]) -> list[Path]:
    """(rank 0) Top down, the smallest subtrees of the entries ``keys`` that are not equal on every
    rank: a container whose structure agrees everywhere is descended into, anything else is kept
    per rank whole."""
    out: list[Path] = []

    def visit(path: Path, node: Any) -> bool:
        seen = [t.get(json.dumps(path)) for t in tables]
        if all(s is not None for s in seen) and len({s[0] for s in seen if s}) == 1:
            return False  # equal everywhere
        sigs = {s[1] if s else None for s in seen}
        if len(sigs) == 1 and None not in sigs and _signature(node) not in ("leaf", "per_rank"):
            return True  # same structure: compare the children
        out.append(path)
        return False

    for key in keys:
        _walk(flat.objects[key]["value"], [key], visit)
    return out


def _mark(flat: FlatState, decided: list[Path], rank: int) -> None:
    """(every rank) Turn the subtrees at ``decided`` and every ``per_rank()`` node outside them into
    per-rank nodes holding this rank's value; move the tensors inside to ``flat.per_rank``."""
    chosen = {json.dumps(p) for p in decided}
    paths = list(decided)

    def visit(path: Path, node: Any) -> bool:
        if json.dumps(path) in chosen:
            return False
        if isinstance(node, dict) and node.get("$") == "per_rank":
            paths.append(path)
            return False
        return True

    for key in _compared(flat):
        _walk(flat.objects[key]["value"], [key], visit)
    paths.sort(key=json.dumps)
    items = {i.name: i for i in flat.items}
    moved: set[str] = set()
    for path in paths:
        node = _get(flat.objects, path)
        inner = node["ranks"][0] if isinstance(node, dict) and node.get("$") == "per_rank" else node
        inner = _own(inner, path, rank, items, moved)
        _set(flat.objects, path, {"$": "per_rank", "ranks": [inner]})
    for name in moved:
        item = items[name]
        flat.per_rank.append(
            TensorItem(f"/rank{rank}/{name}", item.local, item.shape, item.offsets, True, True, dtensor=False)
        )
    flat.items = [i for i in flat.items if i.name not in moved]
    flat.per_rank_paths = paths


def _own(node: Any, path: Path, rank: int, items: dict[str, TensorItem], moved: set[str]) -> Any:
    """A copy of ``node`` for a per-rank node of this rank: inner per-rank markers dropped (the
    whole subtree is per rank), tensor references renamed to this rank's names."""
    where = "/".join(map(str, path))
    if isinstance(node, list):
        return [_own(v, path, rank, items, moved) for v in node]
    if not isinstance(node, dict):
        return node
    tag = node.get("$")
    if tag == "per_rank":
        return _own(node["ranks"][0], path, rank, items, moved)
    if tag == "dict":
        return {"$": "dict", "items": [[k, _own(v, path, rank, items, moved)] for k, v in node["items"]]}
    if tag == "tuple":
        return {"$": "tuple", "items": [_own(v, path, rank, items, moved) for v in node["items"]]}
    if tag in ("tensor", "ndarray"):
        item = items[node["ref"]]
        if item.dtensor:
            raise UnsafeValueError(
                f"{where!r}: differs between ranks (or is marked per_rank()) and holds a DTensor or sharded tensor "
                f"{item.name!r}, which its strategy already places. Keep such tensors out of per-rank values."
            )
        moved.add(item.name)
        return {"$": tag, "ref": f"/rank{rank}/{item.name}"}
    return node


# ------------------------------------------------------------------------------------- writing


def report(flat: FlatState) -> dict[str, Any]:
    """(every rank) What rank 0 needs to build the per-rank nodes: this rank's value at each path (in
    ``flat.per_rank_paths`` order) and the dtype and shape of its per-rank tensors."""
    return {
        "nodes": [_get(flat.objects, p)["ranks"][0] for p in flat.per_rank_paths],
        "tensors": [[i.name, dtype_name(i.local.dtype), list(i.shape)] for i in flat.per_rank],
    }


def merge_reports(
    flat: FlatState, reports: list[dict[str, Any]], chunks: dict[str, list[Chunk]]
) -> dict[str, TensorEntry]:
    """(rank 0, building the manifest) Fill every per-rank node of ``flat.objects`` with each rank's
    value (in rank order) and return the manifest entries of every rank's per-rank tensors."""
    ordered = sorted(reports, key=lambda r: int(r["rank"]))
    parts = [r.get("per_rank") or {"nodes": [], "tensors": []} for r in ordered]
    for i, path in enumerate(flat.per_rank_paths):
        if any(len(p["nodes"]) != len(flat.per_rank_paths) for p in parts):
            raise InconsistentRanksError("ranks found different per-rank values (planning differed between ranks)")
        _set(flat.objects, path, {"$": "per_rank", "ranks": [p["nodes"][i] for p in parts]})
    tensors: dict[str, TensorEntry] = {}
    for part in parts:
        for name, dtype, shape in part["tensors"]:
            mine = sorted(chunks.get(name, []), key=lambda c: c.offsets)
            if sum(math.prod(c.sizes) for c in mine) != math.prod(shape):
                raise InconsistentRanksError(f"per-rank tensor {name!r} was not fully written by its rank")
            tensors[name] = TensorEntry(dtype_from_name(dtype, name), tuple(shape), tuple(mine))
    return tensors
