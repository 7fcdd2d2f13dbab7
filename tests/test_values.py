"""Typed JSON (docs/format.md, section 4): every supported kind round-trips exactly through real JSON,
anything else is refused at save naming its key path, unknown tags are rejected on load, and pickle is
used only when both the saver and the loader opt in."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardsafe
from shardsafe.errors import CorruptCheckpointError, UnsafeValueError
from shardsafe.format.values import decode, encode
from shardsafe.format.walk import tensor_refs


class _Tensors:
    """A tensor sink/source pair standing in for the data files."""

    def __init__(self) -> None:
        self.store: dict[str, torch.Tensor] = {}

    def sink(self, path: str, tensor: torch.Tensor) -> str:
        self.store[path] = tensor.clone()
        return path

    def source(self, ref: str) -> torch.Tensor:
        return self.store[ref]


def round_trip(value: Any, *, allow_pickle: bool = False) -> Any:
    tensors = _Tensors()
    node = encode(value, "v", tensors.sink, allow_pickle=allow_pickle)
    text = json.dumps(node, allow_nan=False)  # what the manifest writer does: strict JSON only
    return decode(json.loads(text), "v", tensors.source, allow_pickle=allow_pickle)


def same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, nan equal to nan and -0.0 distinct from 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, np.generic):
        nans = a.dtype.kind == "f" and bool(np.isnan(a)) and bool(np.isnan(b))
        return a.dtype == b.dtype and (nans or bool(a == b))
    return bool(a == b)


SUPPORTED: dict[str, Any] = {
    "int": 3,
    "negative big int": -(2**80),
    "zero": 0,
    "float": 0.1,
    "integral float": 2.0,
    "tiny float": 5e-324,
    "nan": float("nan"),
    "inf": float("inf"),
    "-inf": float("-inf"),
    "-0.0": -0.0,
    "str": 'héllo \u2603 "quoted" \n',
    "empty str": "",
    "true": True,
    "false": False,
    "none": None,
    "list": [1, 2.5, "x", None],
    "empty list": [],
    "tuple": (1, (2, 3), []),
    "empty tuple": (),
    "dict str keys": {"a": 1, "b": {"c": [1, 2]}},
    "dict int keys": {0: "zero", -5: "minus five", 10**20: "big"},
    "dict mixed keys": {1: "int one", "1": "str one"},
    "empty dict": {},
    "nested": {"lr": [0.1, (0.9, 0.999)], "hist": [{"loss": float("nan")}, {"loss": 1.5}]},
    "bytes": b"\x00\xffbinary",
    "empty bytes": b"",
    "torch.Size": torch.Size([2, 3]),
    "empty torch.Size": torch.Size([]),
    "dtype": torch.bfloat16,
    "device cpu": torch.device("cpu"),
    "device cuda:1": torch.device("cuda", 1),
    "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "np int64": np.int64(-7),
    "np int8": np.int8(5),
    "np uint32": np.uint32(4_000_000_000),
    "np float32": np.float32(0.25),
    "np float32 nan": np.float32("nan"),
    "np float16": np.float16(-1.5),
    "np bool": np.bool_(True),
    "np array": np.arange(6, dtype=np.float64).reshape(3, 2),
    "np array int16": np.array([1, -2], dtype=np.int16),
}


@pytest.mark.parametrize("name", list(SUPPORTED))
def test_round_trip(name: str) -> None:
    value = SUPPORTED[name]
    assert same(round_trip(value), value)


def test_round_trip_all_at_once() -> None:
    assert same(round_trip(dict(SUPPORTED)), dict(SUPPORTED))


def test_bytearray_comes_back_as_bytes() -> None:
    assert same(round_trip(bytearray(b"ab")), b"ab")


def test_list_and_tuple_stay_distinct() -> None:
    assert same(round_trip([1, (2,)]), [1, (2,)])
    assert same(round_trip(((1,), [2])), ((1,), [2]))


def test_encoding_is_the_documented_typed_json() -> None:
    tensors = _Tensors()
    value = {"lr": 0.1, "betas": (0.9, 0.999), "best": float("inf"), 3: b"\x00", "w": torch.ones(1)}
    node = encode(value, "sched", tensors.sink)
    assert node == {
        "$": "dict",
        "items": [
            ["lr", 0.1],
            ["betas", {"$": "tuple", "items": [0.9, 0.999]}],
            ["best", {"$": "float", "v": "inf"}],
            [3, {"$": "bytes", "b64": "AA=="}],
            ["w", {"$": "tensor", "ref": "sched/w"}],
        ],
    }
    assert tensor_refs(node) == ["sched/w"]
    assert json.dumps(encode(1.0, "x", tensors.sink)) == "1.0"  # a float stays a float in JSON
    assert encode(np.float32(0.5), "x", tensors.sink) == {"$": "npscalar", "dtype": "float32", "v": 0.5}


def test_round_trip_through_a_checkpoint(tmp_path: Path) -> None:
    """Plain values of the state come back from load(state=None) and replace the values of a state."""
    values = {k: v for k, v in SUPPORTED.items() if not isinstance(v, (torch.Tensor, np.ndarray))}
    state: dict[str, Any] = {"values": values, "arr": SUPPORTED["np array"], "t": SUPPORTED["tensor"]}
    shardsafe.save(tmp_path / "ck", state, metadata={"note": (1, float("nan"))})
    out = shardsafe.load(tmp_path / "ck")
    assert same(out["values"], values)
    assert same(out["arr"], SUPPORTED["np array"])
    assert same(out["t"], SUPPORTED["tensor"])
    target: dict[str, Any] = {"values": None}
    rest = shardsafe.load(tmp_path / "ck", target)
    assert same(target["values"], values) and sorted(rest) == ["arr", "t"]
    assert same(shardsafe.inspect(tmp_path / "ck").metadata, {"note": (1, float("nan"))})


class _Custom:
    pass


@pytest.mark.parametrize(
    ("value", "path", "type_name"),
    [
        ({"things": {1, 2}}, "'cfg/things'", "set"),
        ({"fn": [0, lambda x: x]}, "'cfg/fn/1'", "function"),
        ({"obj": _Custom()}, "'cfg/obj'", "_Custom"),
        ({"c": 1 + 2j}, "'cfg/c'", "complex"),
        ({"np": np.array([object()], dtype=object)}, "'cfg/np'", "ndarray"),
    ],
)
def test_unsafe_values_refused_naming_the_key(tmp_path: Path, value: Any, path: str, type_name: str) -> None:
    with pytest.raises(UnsafeValueError, match=type_name) as err:
        encode(value, "cfg", _Tensors().sink)
    assert path in str(err.value) and "allow_pickle=True" in str(err.value)
    # Through save: refused before anything is committed, nothing left behind.
    with pytest.raises(UnsafeValueError) as err:
        shardsafe.save(tmp_path / "ck", {"cfg": value})
    assert path in str(err.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key", [(1, 2), 1.5, True, None])
def test_dict_with_unsupported_keys_refused(key: Any) -> None:
    with pytest.raises(UnsafeValueError, match="dict key") as err:
        encode({"outer": {key: 1}}, "cfg", _Tensors().sink)
    assert "'cfg/outer'" in str(err.value)


def test_named_tuple_refused() -> None:
    from collections import namedtuple

    point = namedtuple("point", "x y")
    with pytest.raises(UnsafeValueError, match="point"):
        encode(point(1, 2), "p", _Tensors().sink)


@pytest.mark.parametrize(
    ("node", "match"),
    [
        ({"$": "evil", "v": 1}, "unknown value kind 'evil'"),
        ({"$": "Pickle", "b64": ""}, "unknown value kind"),
        ({"not": "tagged"}, "malformed value node"),
        ({"$": 3}, "malformed value node"),
        ({"$": "float", "v": "1.5"}, "malformed 'float' node"),
        ({"$": "float"}, "malformed 'float' node"),
        ({"$": "dict", "items": [[True, 1]]}, "malformed 'dict' node"),
        ({"$": "dict", "items": [[[1], 1]]}, "malformed 'dict' node"),
        ({"$": "bytes", "b64": "not base64!"}, "malformed 'bytes' node"),
        ({"$": "dtype", "v": "os.system"}, "unknown dtype"),
        ({"$": "dtype", "v": "Tensor"}, "unknown dtype"),
        ({"$": "size", "v": ["x"]}, "malformed 'size' node"),
        ([1, {"$": "evil"}], r"v/1: unknown value kind"),
        ({"$": "dict", "items": [["a", {"$": "tuple", "items": [{"$": "evil"}]}]]}, r"v/a/0: unknown value kind"),
    ],
)
def test_unknown_or_malformed_nodes_rejected(node: Any, match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        decode(node, "v", _Tensors().source)


def test_pickle_only_when_both_sides_opt_in(tmp_path: Path) -> None:
    value = {"ids": {3, 1, 2}, "obj": frozenset({"a"})}
    tensors = _Tensors()
    node = encode(value, "v", tensors.sink, allow_pickle=True)
    assert [v["$"] for _, v in node["items"]] == ["pickle", "pickle"]
    with pytest.raises(CorruptCheckpointError, match="pickled value") as err:
        decode(node, "v", tensors.source)
    assert "v/ids" in str(err.value)
    assert decode(node, "v", tensors.source, allow_pickle=True) == value

    shardsafe.save(tmp_path / "ck", {"cfg": value, "step": 3}, allow_pickle=True)
    with pytest.raises(CorruptCheckpointError, match="allow_pickle=True"):
        shardsafe.load(tmp_path / "ck")
    assert shardsafe.load(tmp_path / "ck", allow_pickle=True)["cfg"] == value


def test_numpy_float64_keeps_its_type() -> None:
    assert same(round_trip(np.float64(0.5)), np.float64(0.5))


def test_malformed_device_rejected() -> None:
    with pytest.raises(CorruptCheckpointError, match="malformed 'device' node"):
        decode({"$": "device", "v": "nonsense"}, "v", _Tensors().source)


def test_refused_pickle_modifies_nothing(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "ck", {"cfg": {"ids": {1, 2}}, "step": 3}, allow_pickle=True)
    target: dict[str, Any] = {"step": 0}
    with pytest.raises(CorruptCheckpointError, match="cfg/ids"):
        shardsafe.load(tmp_path / "ck", target)
    assert target == {"step": 0}
