"""Which part of a checkpoint an export writes, and under which names.

A checkpoint holds several entries (``model``, ``optimizer``, ``step``...). An export picks one
sub-tree by key and names its tensors the way a ``state_dict`` does: dict keys and list indices joined
with ``.``, so a module entry's tensors keep the parameter names ``from_pretrained`` expects
(``transformer.h.0.attn.c_attn.weight``). Only the manifest is read here.

Without a key: the checkpoint's one module entry; with no module entry, the one entry that is a dict of
tensors only (a ``state_dict``, as an imported ``torch.save`` file holds under ``model``), or everything
when every entry holding tensors is a single tensor (an imported flat state dict).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardsafe.errors import InvalidArgumentError
from shardsafe.format.manifest import Manifest

logger = logging.getLogger(__name__)

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
    dict keys or list indices; ``/`` for everything; ``None``: see the module docstring). With
    ``strip_prefix``, the tensors whose names start with it are taken without it; the others are left
    out (listed in ``skipped``, and warned about); none starting with it is an error."""
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
        inside = [(name[len(strip_prefix) :], ref) for name, ref in tensors if _under(name, strip_prefix)]
        outside = [name for name, _ in tensors if not _under(name, strip_prefix)]
        if not inside:
            raise InvalidArgumentError(
                f"{where}: tensor {tensors[0][0]!r} of entry {key!r} does not start with the prefix {strip_prefix!r} "
                "to strip, nor does any other; give the prefix the model's names share, or pick a deeper key="
            )
        if outside:
            logger.warning(
                "shardsafe export: %d tensor(s) of %s [%s] do not start with %r and are left out: %s",
                len(outside),
                where,
                key,
                strip_prefix,
                ", ".join(outside[:5]) + (", ..." if len(outside) > 5 else ""),
            )
        tensors, skipped = inside, skipped + outside
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
    objects = manifest.objects
    modules = [k for k, o in objects.items() if o["kind"] == "module"]
    if len(modules) == 1:
        return modules[0]
    holding = [k for k, o in objects.items() if any(ref is not None for _, ref in _walk(o["value"], ""))]
    if not modules:
        if holding and all(_is_tensor(objects[k]["value"]) for k in holding):
            return ALL  # a flat state dict: one entry per tensor
        state_dicts = [k for k in holding if _state_dict(objects[k]["value"])]
        if len(state_dicts) == 1:
            return state_dicts[0]
    choices = modules or [k for k in holding if _state_dict(objects[k]["value"])] or holding
    if not choices:
        raise InvalidArgumentError(f"{where} holds no tensors, among: {describe(manifest)}; nothing to export")
    what = f"{len(modules)} module entries" if modules else "no module entry"
    raise InvalidArgumentError(
        f"{where} holds {what} among: {describe(manifest)}. Name the one to export with key= (--key), e.g. "
        f"--key {choices[0]} ({', '.join(choices[:6])} hold tensors), a path into an entry (--key "
        f"{choices[0]}/...), or --key / for everything"
    )


def _is_tensor(node: Any) -> bool:
    return isinstance(node, dict) and node.get("$") in ("tensor", "ndarray")


def _state_dict(node: Any) -> bool:
    """A dict whose values are all tensors (what ``model.state_dict()`` saves as)."""
    children = list(_children(node)) if isinstance(node, dict) and node.get("$") == "dict" else []
    return bool(children) and all(_is_tensor(v) for _, v in children)


def _under(name: str, prefix: str) -> bool:
    return name.startswith(prefix) and len(name) > len(prefix)


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
