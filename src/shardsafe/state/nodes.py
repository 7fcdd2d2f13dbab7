"""Helpers for loading (state/restore.py): typed JSON nodes described and searched, states searched for
tensors, and module state-dict names matched across wrappers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from shardsafe.format.manifest import Manifest
from shardsafe.format.values import PerRank
from shardsafe.format.walk import typed_nodes

WRAPPERS = ("module.", "_orig_mod.", "_forward_module.")  # DDP, torch.compile, Lightning Fabric


def cpu_alloc(manifest: Manifest, name: str) -> Callable[[], torch.Tensor]:
    entry = manifest.tensors[name]
    return lambda: torch.empty(entry.shape, dtype=entry.dtype)


def tag_of(node: Any) -> str | None:
    if isinstance(node, list):
        return "list"
    if isinstance(node, dict):
        tag = node.get("$")
        return tag if isinstance(tag, str) else None
    return None


def refs(node: Any) -> list[tuple[str, str]]:
    """(tag, name) of every tensor/ndarray reference in a typed JSON tree, in order."""
    return [(n["$"], n["ref"]) for n in typed_nodes(node) if n.get("$") in ("tensor", "ndarray")]


def holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, PerRank):
        return holds_tensor(value.value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensor(v) for v in value)
    return False


def describe(node: Any) -> str:
    tag = tag_of(node)
    if tag == "list":
        return f"a list of {len(node)}"
    if tag == "dict":
        return f"a dict of {len(node['items'])}"
    if tag == "tuple":
        return f"a tuple of {len(node['items'])}"
    if tag in ("tensor", "ndarray"):
        return f"a {tag}"
    if tag is not None:
        return f"a {tag} value"
    return f"the value {json.dumps(node)[:40]}"


def describe_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _strip(name: str) -> str:
    while True:
        prefix = next((p for p in WRAPPERS if name.startswith(p)), None)
        if prefix is None:
            return name
        name = name[len(prefix) :]


def align(dest: list[Any], saved: list[Any]) -> dict[Any, Any]:
    """Module state dicts: each destination name -> its saved name. Exact names first; then names that
    agree once wrapper prefixes are dropped (``model.state_dict()`` of a DDP or compiled model holds
    ``module.``/``_orig_mod.`` names, a module entry its model's own)."""
    exact = set(saved)
    out = {k: k for k in dest if k in exact}
    used = set(out.values())
    loose: dict[str, Any] = {}
    for k in saved:
        if k not in used and isinstance(k, str):
            loose.setdefault(_strip(k), k)
    for k in dest:
        if k in out or not isinstance(k, str):
            continue
        match = loose.get(_strip(k))
        if match is not None and match not in used:
            out[k] = match
            used.add(match)
    return out
