"""Which part of a checkpoint an export writes, and under which names.

A checkpoint holds several entries (``model``, ``optimizer``, ``step``...). An export picks one
sub-tree by key and names its tensors the way a ``state_dict`` does: dict keys and list indices joined
with ``.``, so a module entry's tensors keep the parameter names ``from_pretrained`` expects
(``transformer.h.0.attn.c_attn.weight``). Only the manifest is read here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardsafe.errors import InvalidArgumentError
from shardsafe.format.manifest import Manifest

ALL = "/"
"""The key that selects every entry of the checkpoint."""


@dataclass(frozen=True)
class Selection:
    key: str  # the entry path that was selected (``ALL`` for every entry)
    node: Any  # its typed JSON value
    tensors: list[tuple[str, str]]  # (export name, manifest tensor name), in checkpoint order
    skipped: list[str]  # export names of the non-tensor values inside it, left out of the export


def select(manifest: Manifest, key: str | None, where: str, *, strip_prefix: str | None = None) -> Selection:
    """The sub-tree ``key`` of the checkpoint at ``where`` (a ``/``-separated path: top-level entry, then
    dict keys or list indices; ``/`` for everything; ``None``: the one module entry)."""
    if key is None:
        key = _default_key(manifest, where)
    if key == ALL:
        node: Any = {"$": "dict", "items": [[k, o["value"]] for k, o in manifest.objects.items()]}
    else:
        node = _descend(manifest, key, where)
    tensors: list[tuple[str, str]] = []
    skipped: list[str] = []
    leaf = key.rstrip("/").rsplit("/", 1)[-1]
    for name, ref in _walk(node, ""):
        name = name or leaf  # the key selected a single tensor or value
        if ref is None:
            skipped.append(name)
        else:
            tensors.append((name, ref))
    if strip_prefix:
        tensors = [(_strip(name, strip_prefix, where, key), ref) for name, ref in tensors]
    seen: dict[str, str] = {}
    for name, ref in tensors:
        if name in seen:
            raise InvalidArgumentError(
                f"{where}: entry {key!r} gives two tensors the export name {name!r} ({seen[name]!r} and {ref!r}); "
                "pick a sub-tree whose names are unique with key="
            )
        seen[name] = ref
    if not tensors:
        raise InvalidArgumentError(f"{where}: entry {key!r} holds no tensors; nothing to export. Pick another key=")
    return Selection(key=key, node=node, tensors=tensors, skipped=skipped)


def describe(manifest: Manifest) -> str:
    """``model (module), optimizer (optimizer), step (value)``: the entries, for error messages."""
    return ", ".join(f"{k} ({o['kind']})" for k, o in manifest.objects.items()) or "nothing"


def _default_key(manifest: Manifest, where: str) -> str:
    modules = [k for k, o in manifest.objects.items() if o["kind"] == "module"]
    if len(modules) == 1:
        return modules[0]
    raise InvalidArgumentError(
        f"{where} holds {len(modules)} module entries among: {describe(manifest)}. Name the one to export with "
        "key= (--key), e.g. --key model, or a path into an entry (--key state_dict), or --key / for everything"
    )


def _descend(manifest: Manifest, key: str, where: str) -> Any:
    parts = key.split("/")
    if not parts[0] or parts[0] not in manifest.objects:
        raise InvalidArgumentError(f"{where} has no entry {parts[0]!r} (key {key!r}); it holds: {describe(manifest)}")
    node = manifest.objects[parts[0]]["value"]
    for i, part in enumerate(parts[1:], 1):
        here = "/".join(parts[:i])
        children = dict(_children(node))
        if part not in children:
            shown = ", ".join(list(children)[:20]) + (", ..." if len(children) > 20 else "")
            raise InvalidArgumentError(
                f"{where}: {here!r} has no {part!r} (key {key!r}); it holds: {shown or 'no sub-keys'}"
            )
        node = children[part]
    return node


def _children(node: Any) -> Iterator[tuple[str, Any]]:
    """(name, child) of a container node: dict keys (int keys as text), tuple and list indices."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            yield str(i), v
    elif isinstance(node, dict) and node.get("$") == "dict":
        for k, v in node["items"]:
            yield str(k), v
    elif isinstance(node, dict) and node.get("$") == "tuple":
        for i, v in enumerate(node["items"]):
            yield str(i), v


def _walk(node: Any, prefix: str) -> Iterator[tuple[str, str | None]]:
    """(name, tensor ref or None for a non-tensor leaf), depth first in the checkpoint's order."""
    if isinstance(node, dict) and node.get("$") in ("tensor", "ndarray"):
        yield prefix, str(node["ref"])
        return
    if isinstance(node, list) or (isinstance(node, dict) and node.get("$") in ("dict", "tuple")):
        for name, child in _children(node):
            yield from _walk(child, f"{prefix}.{name}" if prefix else name)
        return
    yield prefix, None


def _strip(name: str, prefix: str, where: str, key: str) -> str:
    if not name.startswith(prefix) or len(name) == len(prefix):
        raise InvalidArgumentError(
            f"{where}: tensor {name!r} of entry {key!r} does not start with the prefix {prefix!r} to strip; "
            "give the prefix every name shares, or pick a deeper key="
        )
    return name[len(prefix) :]
