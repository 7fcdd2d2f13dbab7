"""Typed JSON: every non-tensor value of a checkpoint, stored without pickle (format v1, docs/format.md).

JSON ``null``, ``true``/``false``, integers, strings, finite floats (always written with a ``.`` or
exponent) and arrays stand for themselves. Every JSON object is a tagged node ``{"$": TAG, ...}``:

=============  ===========================================  =====================================
tag            fields                                       Python value
=============  ===========================================  =====================================
``float``      ``v``: ``"nan"``, ``"inf"`` or ``"-inf"``    non-finite float
``dict``       ``items``: ``[[key, value], ...]``           dict with ``str`` or ``int`` keys
``tuple``      ``items``: ``[value, ...]``                  tuple
``bytes``      ``b64``: base64 text                         bytes
``size``       ``v``: ``[int, ...]``                        torch.Size
``dtype``      ``v``: ``"float32"`` ...                     torch.dtype
``device``     ``v``: ``"cpu"`` ...                         torch.device
``tensor``     ``ref``: tensor name in the manifest         torch.Tensor (stored in data files)
``ndarray``    ``ref``: tensor name in the manifest         numpy.ndarray (stored as a tensor)
``npscalar``   ``dtype``: numpy dtype name, ``v``: value    numpy scalar
``pickle``     ``b64``: pickled bytes                       anything (opt-in on both sides only)
``per_rank``   ``ranks``: ``[value, ...]``, one per rank    the value of each saving rank
=============  ===========================================  =====================================

Any other tag is rejected on load, never skipped.
"""

from __future__ import annotations

import base64
import math
import pickle
from collections.abc import Callable
from typing import Any

import torch

from shardsafe.errors import CorruptCheckpointError, UnsafeValueError

Json = Any
TensorSink = Callable[[str, torch.Tensor], str]
"""Called with (path, tensor) for every tensor met while encoding; returns the manifest name."""
TensorSource = Callable[[str], Any]
"""Called with a manifest tensor name while decoding; returns the tensor to put there."""

_TAGS = frozenset(
    {
        "float",
        "dict",
        "tuple",
        "bytes",
        "size",
        "dtype",
        "device",
        "tensor",
        "ndarray",
        "npscalar",
        "pickle",
        "per_rank",
    }
)


class PerRank:
    """A value that each rank keeps for itself (see :func:`shardsafe.per_rank`): saved once per rank
    as a ``per_rank`` node, and restored to the same rank."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"per_rank({self.value!r})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r}")
    return value


def encode(value: Any, path: str, on_tensor: TensorSink, *, allow_pickle: bool = False) -> Json:
    """Typed JSON for ``value``; ``path`` names it in errors (``model/layers.0.weight``)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, PerRank):
        # This rank's value only; the save collects every rank's into "ranks" (state/per_rank.py).
        inner = encode(value.value, path, on_tensor, allow_pickle=allow_pickle)
        if has_per_rank(inner):
            raise UnsafeValueError(f"{path!r}: per_rank() inside per_rank(); mark the outer value only")
        return {"$": "per_rank", "ranks": [inner]}
    if type(value).__module__.startswith("numpy"):  # np.float64 is a float subclass: keep its type
        numpy = _numpy_value(value, path, on_tensor)
        if numpy is not None:
            return numpy
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$": "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Tensor):
        return {"$": "tensor", "ref": on_tensor(path, value)}
    if isinstance(value, torch.Size):
        return {"$": "size", "v": list(value)}
    if isinstance(value, torch.dtype):
        return {"$": "dtype", "v": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$": "device", "v": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$": "bytes", "b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise UnsafeValueError(
                    f"{path!r}: dict key {k!r} of type {type(k).__name__} cannot be stored; "
                    "use str or int keys (or pass allow_pickle=True to save and load)"
                )
            items.append([k, encode(v, f"{path}/{k}", on_tensor, allow_pickle=allow_pickle)])
        return {"$": "dict", "items": items}
    if isinstance(value, list):
        return [encode(v, f"{path}/{i}", on_tensor, allow_pickle=allow_pickle) for i, v in enumerate(value)]
    if type(value) is tuple:
        items = [encode(v, f"{path}/{i}", on_tensor, allow_pickle=allow_pickle) for i, v in enumerate(value)]
        return {"$": "tuple", "items": items}
    if allow_pickle:
        return {"$": "pickle", "b64": base64.b64encode(pickle.dumps(value)).decode()}
    raise UnsafeValueError(
        f"{path!r}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored without "
        "pickle. Convert it to plain types (int, float, str, bool, None, list, tuple, dict, bytes, tensors), give "
        "the object state_dict()/load_state_dict(), or opt in with allow_pickle=True on both save and load."
    )


def _numpy_value(value: Any, path: str, on_tensor: TensorSink) -> Json | None:
    module = type(value).__module__
    if not module.startswith("numpy"):
        return None
    import numpy as np

    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return None
        return {"$": "ndarray", "ref": on_tensor(path, torch.from_numpy(np.ascontiguousarray(value)))}
    if isinstance(value, np.generic) and isinstance(value, (np.bool_, np.integer, np.floating)):
        inner = encode(value.item(), path, on_tensor)
        return {"$": "npscalar", "dtype": str(value.dtype), "v": inner}
    return None


def decode(node: Json, where: str, resolve: TensorSource, *, allow_pickle: bool = False) -> Any:
    """The Python value of a typed JSON node; ``where`` names it in errors."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [decode(v, f"{where}/{i}", resolve, allow_pickle=allow_pickle) for i, v in enumerate(node)]
    if not isinstance(node, dict) or not isinstance(node.get("$"), str):
        raise CorruptCheckpointError(f"{where}: malformed value node {str(node)[:80]!r}")
    tag = node["$"]
    if tag not in _TAGS:
        raise CorruptCheckpointError(f"{where}: unknown value kind {tag!r}; this checkpoint needs a newer shardsafe")
    try:
        return _decode_tagged(tag, node, where, resolve, allow_pickle)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CorruptCheckpointError(f"{where}: malformed {tag!r} node: {err}") from err


def _decode_tagged(tag: str, node: dict[str, Any], where: str, resolve: TensorSource, allow_pickle: bool) -> Any:
    if tag == "float":
        if node["v"] not in ("nan", "inf", "-inf"):
            raise ValueError(f"bad float {node['v']!r}")
        return float(node["v"])
    if tag == "dict":
        out: dict[Any, Any] = {}
        for key, value in node["items"]:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise ValueError(f"bad dict key {key!r}")
            out[key] = decode(value, f"{where}/{key}", resolve, allow_pickle=allow_pickle)
        return out
    if tag == "tuple":
        return tuple(decode(v, f"{where}/{i}", resolve, allow_pickle=allow_pickle) for i, v in enumerate(node["items"]))
    if tag == "bytes":
        return base64.b64decode(node["b64"], validate=True)
    if tag == "size":
        return torch.Size([int(v) for v in node["v"]])
    if tag == "dtype":
        return dtype_from_name(node["v"], where)
    if tag == "device":
        return torch.device(node["v"])
    if tag == "tensor":
        return resolve(str(node["ref"]))
    if tag == "ndarray":
        tensor = resolve(str(node["ref"]))
        return tensor.numpy() if isinstance(tensor, torch.Tensor) else tensor
    if tag == "npscalar":
        import numpy as np

        return np.dtype(str(node["dtype"])).type(decode(node["v"], where, resolve))
    if tag == "per_rank":  # every rank's value, by rank (a loader picks its own rank's beforehand)
        return {
            r: decode(v, f"{where}@rank{r}", resolve, allow_pickle=allow_pickle)
            for r, v in enumerate(_rank_nodes(node))
        }
    # tag == "pickle"
    if not allow_pickle:
        raise UnsafeValueError(
            f"{where}: the checkpoint holds a pickled value, and loading it would run code from whoever wrote the "
            "file. Refused; pass allow_pickle=True to load only if you trust its author."
        )
    return pickle.loads(base64.b64decode(node["b64"], validate=True))


def validate(node: Json, where: str, *, allow_pickle: bool) -> None:
    """Check a typed JSON tree without building it: every tag known, every leaf well formed, and no
    pickle unless allowed (nothing is unpickled here)."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return
    if isinstance(node, list):
        for i, v in enumerate(node):
            validate(v, f"{where}/{i}", allow_pickle=allow_pickle)
        return
    if not isinstance(node, dict) or not isinstance(node.get("$"), str):
        raise CorruptCheckpointError(f"{where}: malformed value node {str(node)[:80]!r}")
    tag = node["$"]
    try:
        if tag == "dict":
            for key, value in node["items"]:
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise ValueError(f"bad dict key {key!r}")
                validate(value, f"{where}/{key}", allow_pickle=allow_pickle)
        elif tag == "tuple":
            for i, v in enumerate(node["items"]):
                validate(v, f"{where}/{i}", allow_pickle=allow_pickle)
        elif tag in ("tensor", "ndarray"):
            if not isinstance(node["ref"], str):
                raise ValueError(f"bad tensor reference {node['ref']!r}")
        elif tag == "per_rank":
            for r, v in enumerate(_rank_nodes(node)):
                validate(v, f"{where}@rank{r}", allow_pickle=allow_pickle)
                if has_per_rank(v):
                    raise ValueError("a per_rank node inside a per_rank node")
        elif tag == "pickle":
            if not isinstance(node["b64"], str):
                raise ValueError("pickle payload is not text")
            if not allow_pickle:
                decode(node, where, _no_source)  # raises the refusal
        else:
            decode(node, where, _no_source)
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptCheckpointError(f"{where}: malformed {tag!r} node: {err}") from err


def _rank_nodes(node: dict[str, Any]) -> list[Json]:
    ranks = node["ranks"]
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("'ranks' must be a non-empty list, one value per saving rank")
    return ranks


def has_per_rank(node: Json) -> bool:
    """Whether a typed JSON tree holds a ``per_rank`` node anywhere."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            tag = item.get("$")
            if tag == "per_rank":
                return True
            if tag in ("dict", "tuple") and isinstance(item.get("items"), list):
                stack.extend(
                    v[1] if tag == "dict" and isinstance(v, list) and len(v) == 2 else v for v in item["items"]
                )
    return False


def _no_source(ref: str) -> Any:
    raise CorruptCheckpointError(f"unexpected tensor reference {ref!r}")


def tensor_refs(node: Json) -> list[str]:
    """Every tensor name a typed JSON node refers to, in order."""
    out: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            if item.get("$") in ("tensor", "ndarray"):
                out.append(str(item.get("ref")))
            elif item.get("$") == "dict":
                stack.extend(reversed([v for _, v in item.get("items", [])]))
            elif item.get("$") == "tuple":
                stack.extend(reversed(item.get("items", [])))
            elif item.get("$") == "per_rank":
                stack.extend(reversed(item.get("ranks", [])))
    return out
