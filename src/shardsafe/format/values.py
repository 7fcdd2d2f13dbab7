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

Any other tag is rejected on load, never skipped. Reading is strict (docs/format.md, section 4): each
node has exactly its fields, each field its JSON type (``items`` a list, ``v`` of a ``size`` a list of
integers >= 0, ...), dtype names come from fixed tables, and a value nests at most
:data:`MAX_DEPTH` levels, which the writer enforces too.
"""

from __future__ import annotations

import base64
import binascii
import math
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch

from shardsafe.errors import CorruptCheckpointError, MissingPackageError, UnsafeValueError
from shardsafe.format.walk import has_per_rank

Json = Any
TensorSink = Callable[[str, torch.Tensor], str]
"""Called with (path, tensor) for every tensor met while encoding; returns the manifest name."""
TensorSource = Callable[[str], Any]
"""Called with a manifest tensor name while decoding; returns the tensor to put there."""

MAX_DEPTH = 100
"""Most levels of JSON arrays and objects one value's typed JSON may nest (a dict costs three: its
node, ``items`` and the pair; a tuple two; a list one). Deeper values are refused at save and
rejected on load, so that no reader recurses without bound."""

MAX_DIMS = 64
"""Most dimensions of a tensor in a checkpoint."""
INT_LIMIT = 2**62
"""Every size, offset, byte position and element count in a manifest is at most this."""

_FIELDS: dict[str, frozenset[str]] = {
    tag: frozenset({"$", *fields})
    for tag, fields in {
        "float": ("v",),
        "dict": ("items",),
        "tuple": ("items",),
        "bytes": ("b64",),
        "size": ("v",),
        "dtype": ("v",),
        "device": ("v",),
        "tensor": ("ref",),
        "ndarray": ("ref",),
        "npscalar": ("dtype", "v"),
        "pickle": ("b64",),
        "per_rank": ("ranks",),
    }.items()
}
_NON_FINITE = ("nan", "inf", "-inf")
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(?::[0-9]{1,5})?")
_SIZE_LIMIT = 2**63  # torch.Size holds int64
_INT_BITS = 13_000
"""Largest integer value stored, in bits (about 3,900 decimal digits): JSON readers refuse longer
ones (Python's default limit on int-string conversion is 4,300 digits)."""
_NAME_LIMIT = 60_000
"""Longest tensor name (its path in the state) stored: a reader accepts names of up to 65,536
characters and chunk keys (the name, ``@`` and up to 64 offsets) of up to 65,600."""


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


TORCH_DTYPES: dict[str, torch.dtype] = {dtype_name(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
"""Every dtype of the running torch by name, from the module's namespace: a name read from a
checkpoint is looked up here, never with ``getattr(torch, name)`` (which imports submodules)."""


def _int_range(bits: int, signed: bool) -> tuple[int, int]:
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)


NUMPY_SCALARS: dict[str, tuple[str, float, float]] = {
    "bool": ("b", 0, 1),
    **{f"int{b}": ("i", *_int_range(b, True)) for b in (8, 16, 32, 64)},
    **{f"uint{b}": ("i", *_int_range(b, False)) for b in (8, 16, 32, 64)},
    "float16": ("f", -65504.0, 65504.0),
    "float32": ("f", -3.4028234663852886e38, 3.4028234663852886e38),
    "float64": ("f", -math.inf, math.inf),
}
"""The numpy scalar dtypes an ``npscalar`` node may name: kind and range of finite values."""


def dtype_from_name(name: Any, where: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``); anything else is rejected."""
    dtype = TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CorruptCheckpointError(f"{where}: unknown dtype {_short(name)}")
    return dtype


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _step(where: str, key: Any) -> str:
    text = str(key)
    return f"{where}/{text if len(text) <= 80 else text[:77] + '...'}"


def _storable_text(text: str, path: str, what: str) -> None:
    """A manifest is UTF-8 text: a string holding a lone surrogate (``"\\ud800"``, e.g. from
    ``os.fsdecode`` of undecodable bytes) cannot be stored, and is refused here, naming it, before
    anything is written (the loader's parser would refuse the manifest)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UnsafeValueError(
            f"{path!r}: {what} holds a lone surrogate ({text[err.start]!r} at position {err.start}), which UTF-8 text, "
            "and so a checkpoint's manifest, cannot hold. Store it as bytes, or clean the text "
            "(e.g. text.encode('utf-8', 'surrogateescape') gives the original bytes)."
        ) from None


def _storable_tensor(tensor: torch.Tensor, path: str) -> None:
    """The limits a reader checks on every tensor entry (docs/format.md, section 8, rule 6), applied
    before anything is written, naming the tensor: at most ``MAX_DIMS`` dimensions, and a byte size
    (each 0 counted as 1) of at most ``INT_LIMIT``."""
    if len(path) > _NAME_LIMIT:
        raise UnsafeValueError(
            f"{path[:80]!r}...: a tensor whose name (its path in the state) has {len(path)} characters; a checkpoint "
            f"holds names of at most {_NAME_LIMIT}. Use shorter keys."
        )
    shape = tensor.shape
    if len(shape) > MAX_DIMS:
        raise UnsafeValueError(
            f"{path!r}: a tensor of {len(shape)} dimensions; a checkpoint holds at most {MAX_DIMS}. Reshape it "
            "(e.g. flatten leading dimensions) before saving, and back after loading."
        )
    size = math.prod(shape)  # the product of the sizes, unless one is 0 (every tensor type has a shape)
    if size == 0:
        size = 1
        for d in shape:
            size *= d if d > 1 else 1
    size *= tensor.dtype.itemsize
    if size > INT_LIMIT:
        raise UnsafeValueError(
            f"{path!r}: a tensor of shape {list(shape)} ({dtype_name(tensor.dtype)}); a checkpoint holds shapes whose "
            f"byte size, each 0 counted as 1, is at most 2^62. Store it with another shape."
        )


def encode(value: Any, path: str, on_tensor: TensorSink, *, allow_pickle: bool = False, _level: int = 1) -> Json:
    """Typed JSON for ``value``; ``path`` names it in errors (``model/layers.0.weight``). What a
    manifest cannot hold (a lone surrogate in a string, a key or a name; a tensor beyond the format's
    limits) is refused with :class:`UnsafeValueError` naming it (a tensor's name is its path, whose
    parts are checked as keys)."""
    if _level == 1:
        _storable_text(path, path, "the name")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        _storable_text(value, path, "the string")
        return value
    if _level > MAX_DEPTH:
        raise UnsafeValueError(
            f"{path!r}: the value nests more than {MAX_DEPTH} levels deep (or holds itself); flatten it, "
            "or store it another way"
        )
    if isinstance(value, torch.Tensor):  # the common cases first (no other type checked here is a tensor
        _storable_tensor(value, path)  # or a plain dict)
        return {"$": "tensor", "ref": on_tensor(path, value)}
    if type(value) is dict:
        return _encode_dict(value, path, on_tensor, allow_pickle, _level)
    if isinstance(value, PerRank):
        # This rank's value only; the save collects every rank's into "ranks" (state/per_rank.py).
        inner = encode(value.value, path, on_tensor, allow_pickle=allow_pickle, _level=_level + 2)
        if has_per_rank(inner):
            raise UnsafeValueError(f"{path!r}: per_rank() inside per_rank(); mark the outer value only")
        return {"$": "per_rank", "ranks": [inner]}
    if type(value).__module__.startswith("numpy"):  # np.float64 is a float subclass: keep its type
        numpy = _numpy_value(value, path, on_tensor, _level)
        if numpy is not None:
            return numpy
    if isinstance(value, int):
        if value.bit_length() > _INT_BITS:
            raise UnsafeValueError(
                f"{path!r}: an integer of {value.bit_length()} bits; a checkpoint holds integers of at most "
                f"{_INT_BITS} bits (about 3,900 digits), which JSON readers accept. Store it as bytes or a str."
            )
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$": "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.Size):
        if any(not 0 <= int(d) < _SIZE_LIMIT for d in value):
            raise UnsafeValueError(f"{path!r}: torch.Size {list(value)} has a negative size, which cannot be stored")
        return {"$": "size", "v": [int(d) for d in value]}
    if isinstance(value, torch.dtype):
        return {"$": "dtype", "v": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$": "device", "v": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$": "bytes", "b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return _encode_dict(value, path, on_tensor, allow_pickle, _level)
    if isinstance(value, list):
        return [
            v  # ASCII text as it is (a list of names): encode()'s str case, without the call
            if type(v) is str and v.isascii()
            else encode(v, f"{path}/{i}", on_tensor, allow_pickle=allow_pickle, _level=_level + 1)
            for i, v in enumerate(value)
        ]
    if type(value) is tuple:
        items = [
            encode(v, f"{path}/{i}", on_tensor, allow_pickle=allow_pickle, _level=_level + 2)
            for i, v in enumerate(value)
        ]
        return {"$": "tuple", "items": items}
    if allow_pickle:
        return {"$": "pickle", "b64": base64.b64encode(pickle.dumps(value)).decode()}
    raise UnsafeValueError(
        f"{path!r}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored without "
        "pickle. Convert it to plain types (int, float, str, bool, None, list, tuple, dict, bytes, tensors), give "
        "the object state_dict()/load_state_dict(), or opt in with allow_pickle=True on both save and load."
    )


def _encode_dict(value: dict[Any, Any], path: str, on_tensor: TensorSink, allow_pickle: bool, level: int) -> Json:
    """:func:`encode` of a dict (str or int keys, each checked as the format requires)."""
    items = []
    inline = level + 3 <= MAX_DEPTH  # a tensor value is within the depth limit: encoded here, without the call
    for k, v in value.items():
        if type(k) is str:
            step = f"{path}/{k}"
            if not k.isascii():
                _storable_text(k, step, "the key")
        else:
            step = _other_key_step(k, path)
        if inline and isinstance(v, torch.Tensor):
            _storable_tensor(v, step)
            items.append([k, {"$": "tensor", "ref": on_tensor(step, v)}])
        else:
            items.append([k, encode(v, step, on_tensor, allow_pickle=allow_pickle, _level=level + 3)])
    return {"$": "dict", "items": items}


def _other_key_step(k: Any, path: str) -> str:
    """The path of the value under dict key ``k``, which is not exactly a str: a str subclass (checked
    as text) or an int (not a bool) of at most ``_INT_BITS`` bits; any other key is refused, naming it."""
    if isinstance(k, str):
        _storable_text(k, f"{path}/{k}", "the key")
        return f"{path}/{k}"
    if type(k) is bool or not isinstance(k, int):
        raise UnsafeValueError(
            f"{path!r}: dict key {k!r} of type {type(k).__name__} cannot be stored; "
            "use str or int keys (or pass allow_pickle=True to save and load)"
        )
    if k.bit_length() > _INT_BITS:
        raise UnsafeValueError(
            f"{path!r}: a dict key integer of {k.bit_length()} bits; a checkpoint holds integers of at most "
            f"{_INT_BITS} bits. Use a shorter key or a str."
        )
    return f"{path}/{k}"


def _numpy_value(value: Any, path: str, on_tensor: TensorSink, level: int) -> Json | None:
    module = type(value).__module__
    if not module.startswith("numpy"):
        return None
    import numpy as np

    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return None
        return {"$": "ndarray", "ref": on_tensor(path, torch.from_numpy(np.ascontiguousarray(value)))}
    if isinstance(value, np.generic) and str(value.dtype) in NUMPY_SCALARS:
        inner = encode(value.item(), path, on_tensor, _level=level + 1)
        return {"$": "npscalar", "dtype": str(value.dtype), "v": inner}
    return None


def decode(node: Json, where: str, resolve: TensorSource, *, allow_pickle: bool = False) -> Any:
    """The Python value of a typed JSON node; ``where`` names it in errors. The whole node is
    validated first (:func:`validate`), so nothing is built from a malformed one."""
    validate(node, where, allow_pickle=allow_pickle)
    try:
        return _build(node, resolve)
    except _NoNumpy as err:
        raise MissingPackageError(
            f"{where}: holds a numpy {err}; building it needs numpy, which this Python cannot import. Install numpy "
            "(pip install numpy) to load it: the checkpoint itself is fine"
        ) from err.__cause__


class _NoNumpy(Exception):
    """A numpy value to build, and no numpy to build it with."""


def _numpy(kind: str) -> Any:
    try:
        import numpy
    except ImportError as err:
        raise _NoNumpy(kind) from err
    return numpy


def _build(node: Json, resolve: TensorSource) -> Any:
    """The value of a validated node."""
    if not isinstance(node, (list, dict)):
        return node
    if isinstance(node, list):
        return [_build(v, resolve) for v in node]
    tag = node["$"]
    if tag == "float":
        return float(node["v"])
    if tag == "dict":
        return {key: _build(value, resolve) for key, value in node["items"]}
    if tag == "tuple":
        return tuple([_build(v, resolve) for v in node["items"]])
    if tag == "bytes":
        return base64.b64decode(node["b64"], validate=True)
    if tag == "size":
        return torch.Size(node["v"])
    if tag == "dtype":
        return TORCH_DTYPES[node["v"]]
    if tag == "device":
        return torch.device(node["v"])
    if tag == "tensor":
        return resolve(node["ref"])
    if tag == "ndarray":
        tensor = resolve(node["ref"])
        if not isinstance(tensor, torch.Tensor):
            return tensor
        _numpy("array")
        return tensor.numpy()
    if tag == "npscalar":
        return _numpy("scalar").dtype(node["dtype"]).type(_build(node["v"], resolve))
    if tag == "per_rank":  # every rank's value, by rank (a loader picks its own rank's beforehand)
        return {r: _build(v, resolve) for r, v in enumerate(node["ranks"])}
    # tag == "pickle" (validate refused it unless allowed)
    return pickle.loads(base64.b64decode(node["b64"], validate=True))


def validate(node: Json, where: str, *, allow_pickle: bool, _level: int = 1) -> None:
    """Check a typed JSON tree without building it: every tag known, every node with exactly its
    fields of the right types, every leaf well formed and in range, the nesting within
    :data:`MAX_DEPTH`, and no pickle unless allowed (nothing is unpickled here). Raises
    :class:`CorruptCheckpointError` naming the node's path."""
    if node is None or isinstance(node, (bool, int, str)):
        return
    if isinstance(node, float):
        if not math.isfinite(node):
            raise CorruptCheckpointError(f"{where}: non-finite float {node!r} outside a 'float' node")
        return
    if _level > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: value nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, list):
        for i, v in enumerate(node):
            validate(v, _step(where, i), allow_pickle=allow_pickle, _level=_level + 1)
        return
    if not isinstance(node, dict) or not isinstance(node.get("$"), str):
        raise CorruptCheckpointError(f"{where}: malformed value node {_short(node)}")
    tag = node["$"]
    if tag not in _FIELDS:
        raise CorruptCheckpointError(
            f"{where}: unknown value kind {_short(tag)}; this checkpoint needs a newer shardsafe"
        )
    if node.keys() != _FIELDS[tag]:
        missing, extra = sorted(_FIELDS[tag] - node.keys()), sorted(node.keys() - _FIELDS[tag])
        raise CorruptCheckpointError(
            f"{where}: malformed {tag!r} node: " + (f"missing {missing}" if missing else f"unexpected {extra}")
        )
    try:
        _check(tag, node, where, allow_pickle, _level)
    except (TypeError, ValueError) as err:
        raise CorruptCheckpointError(f"{where}: malformed {tag!r} node: {err}") from None


def _check(tag: str, node: dict[str, Any], where: str, allow_pickle: bool, level: int) -> None:
    """Raises ``TypeError``/``ValueError`` for a malformed field (turned into the node's error), or
    :class:`CorruptCheckpointError` from a nested node."""
    if tag in ("dict", "tuple"):
        items = node["items"]
        if not isinstance(items, list):
            raise TypeError(f"items is {_short(items)}, not a list")
        if tag == "tuple":
            for i, v in enumerate(items):
                validate(v, _step(where, i), allow_pickle=allow_pickle, _level=level + 2)
            return
        for pair in items:
            if not isinstance(pair, list) or len(pair) != 2:
                raise TypeError(f"item {_short(pair)} is not a [key, value] pair")
            key, value = pair
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"bad dict key {_short(key)}")
            validate(value, _step(where, key), allow_pickle=allow_pickle, _level=level + 3)
    elif tag == "float":
        if not isinstance(node["v"], str) or node["v"] not in _NON_FINITE:
            raise ValueError(f"bad float {_short(node['v'])}")
    elif tag in ("bytes", "pickle"):
        if not isinstance(node["b64"], str):
            raise TypeError("b64 is not text")
        try:
            base64.b64decode(node["b64"], validate=True)
        except binascii.Error as err:
            raise ValueError(f"invalid base64 ({err})") from None
        if tag == "pickle" and not allow_pickle:
            raise CorruptCheckpointError(
                f"{where}: the checkpoint holds a pickled value, and loading it would run code from whoever wrote "
                "the file. Refused; pass allow_pickle=True to load only if you trust its author."
            )
    elif tag == "size":
        dims = node["v"]
        if level + 1 > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
        if not isinstance(dims, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _SIZE_LIMIT for d in dims
        ):
            raise ValueError(f"v is {_short(dims)}, not a list of integers >= 0")
    elif tag == "dtype":
        dtype_from_name(node["v"], where)
    elif tag == "device":
        device = node["v"]
        if not isinstance(device, str) or not _DEVICE.fullmatch(device):
            raise ValueError(f"bad device {_short(device)}")
        try:
            torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"bad device {device!r} ({err})") from None
    elif tag in ("tensor", "ndarray"):
        if not isinstance(node["ref"], str) or not node["ref"]:
            raise TypeError(f"bad tensor reference {_short(node['ref'])}")
    elif tag == "per_rank":
        ranks = node["ranks"]
        if not isinstance(ranks, list) or not ranks:
            raise TypeError("'ranks' must be a non-empty list, one value per saving rank")
        for r, v in enumerate(ranks):
            validate(v, f"{where}@rank{r}", allow_pickle=allow_pickle, _level=level + 2)
            if has_per_rank(v):
                raise ValueError("a per_rank node inside a per_rank node")
    else:  # npscalar
        _check_npscalar(node, where, level)


def _check_npscalar(node: dict[str, Any], where: str, level: int) -> None:
    name, v = node["dtype"], node["v"]
    if not isinstance(name, str) or name not in NUMPY_SCALARS:
        raise ValueError(f"npscalar dtype {_short(name)} is not one of {sorted(NUMPY_SCALARS)}")
    kind, lo, hi = NUMPY_SCALARS[name]
    if kind == "b":
        ok = isinstance(v, bool)
    elif kind == "i":
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
    elif isinstance(v, dict):
        validate(v, where, allow_pickle=False, _level=level + 1)
        ok = v["$"] == "float"
    else:
        ok = isinstance(v, float) and lo <= v <= hi
    if not ok:
        raise ValueError(f"value {_short(v)} is not a {name} npscalar")
