"""Walking typed JSON trees (the nodes of :mod:`shardsafe.format.values`) without recursion, so a
deep or hostile tree cannot exhaust the stack: one walker, :func:`typed_nodes`, and the questions the
format asks of a tree (tensor references, per-rank nodes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def typed_nodes(node: Any) -> Iterator[dict[str, Any]]:
    """Every typed node (a JSON object) of the tree ``node``, parents before children, in document
    order. Descends into lists, the values of ``dict`` nodes, the items of ``tuple`` nodes and the
    values of ``per_rank`` nodes; a part of an unvalidated tree it cannot read is skipped."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            yield item
            tag = item.get("$")
            children = (
                item.get("ranks") if tag == "per_rank" else item.get("items") if tag in ("dict", "tuple") else None
            )
            if isinstance(children, list):
                if tag == "dict":
                    children = [v[1] if isinstance(v, list) and len(v) == 2 else v for v in children]
                stack.extend(reversed(children))


def has_per_rank(node: Any) -> bool:
    """Whether a typed JSON tree holds a ``per_rank`` node anywhere."""
    return any(n.get("$") == "per_rank" for n in typed_nodes(node))


def per_rank_counts(node: Any) -> list[int]:
    """The number of ranks of every ``per_rank`` node in a (validated) typed JSON tree."""
    return [len(n["ranks"]) for n in typed_nodes(node) if n.get("$") == "per_rank"]


def tensor_refs(node: Any) -> list[str]:
    """Every tensor name a (validated) typed JSON node refers to, in order."""
    return [str(n.get("ref")) for n in typed_nodes(node) if n.get("$") in ("tensor", "ndarray")]
