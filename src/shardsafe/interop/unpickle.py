"""Unpickling the pickles of ``torch.save`` files (and of the items of a DCP folder) as hostile input.

Weights-only reading (the default) runs this module's own unpickler: the opcodes of pickle protocols
2 to 4 that ``torch.save`` writes, and as the only callables those that rebuild tensors, containers and
plain values, each with its arguments checked. torch's own ``weights_only`` allowlist would call
``bytearray(2**40)``, ``torch.Tensor(2**40)`` or chain ``_codecs.encode`` into gigabytes; here those are
refused before anything is allocated. Nothing named by the file is imported or called. With
``allow_pickle`` the standard unpickler runs (code chosen by the file's author runs: trusted files only).
Either way, storages come from ``persistent_load``: records the caller has already checked.

Two failures are told apart: :class:`_Refused` for a well-formed pickle that asks for what weights-only
reading does not do (a global outside the list, an opcode of protocol 0 or 5), which full unpickling
could read; :class:`_Malformed` for anything else (damage, or a crafted file). Every other exception of
the unpickling is reported as :class:`_Malformed`.
"""

from __future__ import annotations

import _compat_pickle
import importlib.util
import io
import math
import pickle
import pickletools
import re
import struct
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from shardsafe.format.values import MAX_DIMS  # the format's own limit on a tensor's (or a torch.Size's) dimensions

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

PersistentLoad = Callable[[Any], Any]


class _Malformed(Exception):
    """The pickle is damaged or does not describe what it claims. Private: the importer's readers
    (``torchread``, ``dcpread``) raise it to the caller as :class:`~shardsafe.errors.CorruptCheckpointError`."""


class _Refused(Exception):
    """A well-formed pickle asks for something weights-only reading does not do: ``name`` is the global
    it names (``None`` for an opcode). Private: ``torchread`` turns it into
    :class:`~shardsafe.errors.UnsafeValueError` or :class:`~shardsafe.errors.CorruptCheckpointError`."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


# ------------------------------------------------------------------------------- checked callables


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) > MAX_DIMS:
        raise _Malformed(f"{what} is not a sequence of at most {MAX_DIMS} integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in value):
        raise _Malformed(f"{what} {list(value)[:8]} holds other than non-negative integers")
    return tuple(value)


def view(storage: Any, offset: Any, size: Any, stride: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``size`` elements of ``storage`` from ``offset`` with ``stride``, after checking that every one
    lies inside the storage (a view allocates nothing; what it would take to write is the caller's)."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise _Malformed(f"a tensor is rebuilt from {type(storage).__name__}, not from a storage")
    dtype = storage.dtype if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise _Malformed(f"a tensor's dtype is {type(dtype).__name__}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise _Malformed(f"a tensor's storage offset is {offset!r}")
    sizes, strides = _ints(size, "a tensor's size"), _ints(stride, "a tensor's stride")
    if len(sizes) != len(strides):
        raise _Malformed(f"a tensor has {len(sizes)} sizes but {len(strides)} strides")
    elements = storage._untyped_storage.nbytes() // dtype.itemsize
    if math.prod(sizes) > 0:
        last = offset + sum((n - 1) * s for n, s in zip(sizes, strides, strict=True))
        if last >= elements:
            raise _Malformed(
                f"a tensor of size {list(sizes)} and strides {list(strides)} from offset {offset} reaches element "
                f"{last} of a storage of {elements}"
            )
    elif offset > elements:
        raise _Malformed(f"an empty tensor starts at element {offset} of a storage of {elements}")
    out = torch.empty((0,), dtype=dtype)
    return out.set_(storage._untyped_storage, offset, sizes, strides)


def _grad(t: torch.Tensor, requires_grad: Any) -> torch.Tensor:
    if not isinstance(requires_grad, bool):
        raise _Malformed(f"requires_grad is {requires_grad!r}")
    if requires_grad:
        t.requires_grad_(True)  # a RuntimeError for integer tensors: reported as _Malformed
    return t


def _metadata(t: torch.Tensor, metadata: Any) -> torch.Tensor:
    if metadata:
        if not (isinstance(metadata, dict) and all(isinstance(v, bool) for v in metadata.values())):
            raise _Malformed(f"tensor metadata {metadata!r} is not a dict of flags")
        torch._utils.set_tensor_metadata(t, metadata)  # type: ignore[no-untyped-call]
    return t


def _hooks(hooks: Any) -> None:
    if hooks is not None and not (isinstance(hooks, dict) and not hooks):
        raise _Malformed("a tensor carries backward hooks (torch.save never writes them)")


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> torch.Tensor:
    return view(storage, offset, size, stride)


def _rebuild_tensor_v2(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, metadata: Any = None
) -> torch.Tensor:
    _hooks(hooks)
    return _metadata(_grad(view(storage, offset, size, stride), requires_grad), metadata)


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, metadata: Any = None
) -> torch.Tensor:
    _hooks(hooks)
    return _metadata(_grad(view(storage, offset, size, stride, dtype), requires_grad), metadata)


def _parameter(data: Any, requires_grad: Any = True, *rest: Any) -> torch.nn.Parameter:
    if not isinstance(data, torch.Tensor) or not isinstance(requires_grad, bool):
        raise _Malformed("a Parameter is rebuilt from other than a tensor")
    return torch.nn.Parameter(data, requires_grad=requires_grad and data.is_floating_point())


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> torch.nn.Parameter:
    _hooks(hooks)
    return _parameter(data, requires_grad)


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, hooks: Any, state: Any) -> torch.nn.Parameter:
    _hooks(hooks)  # ``state``: Python attributes set on the parameter; not part of its value
    return _parameter(data, requires_grad)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> torch.Tensor:
    """A tensor with Python attributes (``state``, left out: not part of its value), or a Parameter."""
    parameter = isinstance(new_type, _Call) and new_type.fn is _parameter
    if not isinstance(func, _Call) or not isinstance(args, tuple) or not (parameter or new_type is torch.Tensor):
        raise _Malformed("a tensor subclass is rebuilt from other than a tensor rebuild")
    out = func(*args)
    if not isinstance(out, torch.Tensor):
        raise _Malformed("a tensor subclass is rebuilt from other than a tensor")
    return _parameter(out, out.requires_grad) if parameter else out


def _ordered_dict(*args: Any) -> OrderedDict[Any, Any]:
    if args and not (len(args) == 1 and isinstance(args[0], list) and all(_pair(x) for x in args[0])):
        raise _Malformed("OrderedDict() is called with other than a list of pairs")
    return OrderedDict(*args)


def _counter(*args: Any) -> Counter[Any]:
    if args and not (len(args) == 1 and isinstance(args[0], dict)):
        raise _Malformed("Counter() is called with other than a dict")
    return Counter(*args)


def _pair(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2


def _set(*args: Any) -> set[Any]:
    if args and not (len(args) == 1 and isinstance(args[0], (list, tuple))):
        raise _Malformed("set() is called with other than a list")
    return set(*args)


def _frozenset(*args: Any) -> frozenset[Any]:
    return frozenset(_set(*args))


def _bytearray(*args: Any) -> bytearray:
    if args and not (len(args) == 1 and isinstance(args[0], (bytes, bytearray))):
        raise _Malformed("bytearray() is called with other than bytes (a count would allocate that many bytes)")
    return bytearray(*args)


def _bytes(*args: Any) -> bytes:
    if args:
        raise _Malformed("bytes() is called with arguments (protocol 2 writes only the empty bytes so)")
    return b""


def _complex(*args: Any) -> complex:
    if len(args) > 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        raise _Malformed("complex() is called with other than two numbers")
    return complex(*args)


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``bytes`` as protocol 2 pickles them: ``_codecs.encode(text, 'latin1')``, and nothing else (a
    codec chain would grow without bound)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Malformed("_codecs.encode is called with other than text and 'latin1'")
    return text.encode("latin1")


def _size(*args: Any) -> torch.Size:
    return torch.Size(_ints(args[0] if args else (), "torch.Size"))


def _device(*args: Any) -> torch.device:
    if not (1 <= len(args) <= 2 and isinstance(args[0], str) and len(args[0]) < 64):
        raise _Malformed("torch.device is called with other than a device name")
    return torch.device(*args)


class _Call:
    """A global the pickle may call (REDUCE, NEWOBJ), with its arguments checked by ``fn``."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name, self.fn = name, fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __repr__(self) -> str:
        return self.name


def _globals() -> dict[str, Any]:
    calls: dict[str, Callable[..., Any]] = {
        "collections.OrderedDict": _ordered_dict,
        "collections.Counter": _counter,
        "builtins.set": _set,
        "builtins.frozenset": _frozenset,
        "builtins.bytearray": _bytearray,
        "builtins.bytes": _bytes,
        "builtins.complex": _complex,
        "_codecs.encode": _encode,
        "torch.Size": _size,
        "torch.device": _device,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.nn.parameter.Parameter": _parameter,
    }
    out: dict[str, Any] = {name: _Call(name, fn) for name, fn in calls.items()}
    out["torch.Tensor"] = torch.Tensor  # a value, never called: a type _rebuild_from_type_v2 names
    for dtype in list(vars(torch).values()):  # vars(): no lazy attribute is touched
        if isinstance(dtype, torch.dtype):
            out[str(dtype)] = dtype
    for cls in torch._storage_classes:
        name = getattr(cls, "__name__", "")
        if name.endswith("Storage") and name not in ("TypedStorage", "UntypedStorage"):
            out[f"torch.{name}"] = torch.serialization.StorageType(name)  # type: ignore[no-untyped-call]
    out["torch.storage.UntypedStorage"] = out["torch.UntypedStorage"] = torch.UntypedStorage
    return out


_GLOBALS: dict[str, Any] = {}


def _allowed() -> dict[str, Any]:
    if not _GLOBALS:  # built on first use, not when shardsafe is imported
        _GLOBALS.update(_globals())
    return _GLOBALS


def storage_dtype(storage_type: Any) -> torch.dtype:
    """The dtype a persistent id's storage type stands for (``torch.FloatStorage`` -> float32)."""
    if storage_type is torch.UntypedStorage:
        return torch.uint8
    dtype = getattr(storage_type, "dtype", None) if isinstance(storage_type, torch.serialization.StorageType) else None
    if not isinstance(dtype, torch.dtype):
        raise _Malformed(f"a storage's type is {storage_type!r}, not a torch storage type")
    return dtype


# ------------------------------------------------------------------------------- the unpickler


class Bounded:
    """A seekable file whose ``read(n)`` never asks for more than is left: a length a damaged pickle
    declares (4 GiB) would otherwise be allocated by the buffered reader before it finds the end."""

    def __init__(self, f: Any) -> None:
        self.f = f
        here = f.tell()
        self.end = f.seek(0, 2)
        f.seek(here)

    def read(self, n: int = -1) -> bytes:
        left = self.end - self.f.tell()
        data: bytes = self.f.read(left if n is None or n < 0 else min(n, left))
        return data

    def readline(self, limit: int = -1) -> bytes:
        line: bytes = self.f.readline(limit)
        return line

    def tell(self) -> int:
        return int(self.f.tell())

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self.f.seek(offset, whence))


class _Reader:
    """``read``/``readline`` over a file or bytes that raise :class:`_Malformed` when the data ends early."""

    def __init__(self, f: Any) -> None:
        self.f = Bounded(f)

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise _Malformed("the pickle ends early")
        return data

    def line(self) -> str:
        data: bytes = self.f.readline(512)
        if not data.endswith(b"\n"):
            raise _Malformed("a global's name is not a line of text")
        return data[:-1].decode("utf-8")


def _global(module: str, name: str) -> Any:
    if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2 names, as pickle itself maps them
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    full = f"{module}.{name}"
    allowed = _allowed()
    if full in allowed:
        return allowed[full]
    if _NAME.fullmatch(module) and _NAME.fullmatch(name):
        raise _Refused(f"global {full}", full)
    raise _Malformed(f"a global named {full[:80]!r}")


_OPS = {op.code.encode("latin1"): op for op in pickletools.opcodes}


def load_restricted(f: Any, persistent_load: PersistentLoad) -> Any:
    """The object the pickle at ``f``'s position describes, built by the checked callables only;
    ``f`` is left just after the pickle's STOP."""
    try:
        return _Unpickler(_Reader(f), persistent_load).load()
    except (_Malformed, _Refused):
        raise
    except RecursionError as err:
        raise _Malformed("the pickle nests too deeply") from err
    except Exception as err:  # a stack, memo or type error: what damage or crafting gives
        raise _Malformed(f"{type(err).__name__}: {str(err)[:200]}") from err


class _Unpickler:
    def __init__(self, r: _Reader, persistent_load: PersistentLoad) -> None:
        self.r, self.persistent_load = r, persistent_load
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}

    def pop_mark(self) -> list[Any]:
        items, self.stack = self.stack, self.marks.pop()
        return items

    def load(self) -> Any:  # one branch per opcode, as pickle's own loop
        r, memo = self.r, self.memo
        while True:
            code = r.read(1)
            if code == b".":  # STOP
                return self.stack.pop()
            if code == b"\x80":  # PROTO
                if r.read(1)[0] > 5:
                    raise _Malformed("an unknown pickle protocol")
            elif code == b"\x95":  # FRAME: the length of what follows; read as it comes
                r.read(8)
            elif code == b"}":
                self.stack.append({})
            elif code == b"]":
                self.stack.append([])
            elif code == b")":
                self.stack.append(())
            elif code == b"\x8f":  # EMPTY_SET
                self.stack.append(set())
            elif code == b"N":
                self.stack.append(None)
            elif code == b"\x88":
                self.stack.append(True)
            elif code == b"\x89":
                self.stack.append(False)
            elif code == b"J":
                self.stack.append(struct.unpack("<i", r.read(4))[0])
            elif code == b"K":
                self.stack.append(r.read(1)[0])
            elif code == b"M":
                self.stack.append(struct.unpack("<H", r.read(2))[0])
            elif code == b"\x8a":  # LONG1
                self.stack.append(pickle.decode_long(r.read(r.read(1)[0])))  # type: ignore[attr-defined]
            elif code == b"G":
                self.stack.append(struct.unpack(">d", r.read(8))[0])
            elif code == b"X":  # BINUNICODE
                self.stack.append(r.read(struct.unpack("<I", r.read(4))[0]).decode("utf-8"))
            elif code in (b"\x8c", b"U"):  # SHORT_BINUNICODE, SHORT_BINSTRING (Python 2 str)
                self.stack.append(r.read(r.read(1)[0]).decode("utf-8"))
            elif code == b"C":  # SHORT_BINBYTES
                self.stack.append(r.read(r.read(1)[0]))
            elif code == b"B":  # BINBYTES
                self.stack.append(r.read(struct.unpack("<I", r.read(4))[0]))
            elif code == b"(":
                self.marks.append(self.stack)
                self.stack = []
            elif code == b"t":
                self.pop_mark_into_tuple()
            elif code == b"\x85":
                self.stack[-1] = (self.stack[-1],)
            elif code == b"\x86":
                self.stack[-2:] = [(self.stack[-2], self.stack[-1])]
            elif code == b"\x87":
                self.stack[-3:] = [(self.stack[-3], self.stack[-2], self.stack[-1])]
            elif code == b"a":
                item = self.stack.pop()
                self._list().append(item)
            elif code == b"e":
                items = self.pop_mark()
                self._list().extend(items)
            elif code == b"s":
                value, key = self.stack.pop(), self.stack.pop()
                self._dict()[key] = value
            elif code == b"u":
                items = self.pop_mark()
                if len(items) % 2:
                    raise _Malformed("SETITEMS with an odd number of items")
                target = self._dict()
                for i in range(0, len(items), 2):
                    target[items[i]] = items[i + 1]
            elif code == b"\x90":  # ADDITEMS
                items = self.pop_mark()
                if not isinstance(self.stack[-1], set):
                    raise _Malformed("ADDITEMS to other than a set")
                self.stack[-1].update(items)
            elif code in (b"q", b"r", b"\x94"):  # BINPUT, LONG_BINPUT, MEMOIZE
                index = r.read(1)[0] if code == b"q" else len(memo)
                if code == b"r":
                    index = struct.unpack("<I", r.read(4))[0]
                memo[index] = self.stack[-1]
            elif code in (b"h", b"j"):  # BINGET, LONG_BINGET
                index = r.read(1)[0] if code == b"h" else struct.unpack("<I", r.read(4))[0]
                if index not in memo:
                    raise _Malformed(f"memo entry {index} is read before it is written")
                self.stack.append(memo[index])
            elif code == b"c":  # GLOBAL
                module = r.line()
                self.stack.append(_global(module, r.line()))
            elif code == b"\x93":  # STACK_GLOBAL
                name, module = self.stack.pop(), self.stack.pop()
                if not (isinstance(module, str) and isinstance(name, str)):
                    raise _Malformed("STACK_GLOBAL of other than two names")
                self.stack.append(_global(module, name))
            elif code in (b"R", b"\x81"):  # REDUCE, NEWOBJ
                args, fn = self.stack.pop(), self.stack[-1]
                if not isinstance(fn, _Call) or not isinstance(args, tuple):
                    raise _Malformed(f"a call of {type(fn).__name__} (only tensor and container rebuilds are called)")
                self.stack[-1] = fn(*args)
            elif code == b"b":  # BUILD: attributes of an OrderedDict (a state dict's _metadata)
                state, inst = self.stack.pop(), self.stack[-1]
                if not (isinstance(inst, OrderedDict) and isinstance(state, dict)):
                    raise _Malformed(f"BUILD of a {type(inst).__name__}")
                if not all(isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in state):
                    raise _Malformed("BUILD with attribute names that are not plain names")
                inst.__dict__.update(state)
            elif code == b"Q":  # BINPERSID
                self.stack.append(self.persistent_load(self.stack.pop()))
            elif code in _OPS:  # a real opcode this reader does not run (protocol 0 text, protocol 5 buffers)
                raise _Refused(f"pickle opcode {_OPS[code].name} (protocol {_OPS[code].proto})")
            else:
                raise _Malformed(f"byte {code!r} is no pickle opcode")

    def pop_mark_into_tuple(self) -> None:
        items = self.pop_mark()
        self.stack.append(tuple(items))

    def _list(self) -> list[Any]:
        if type(self.stack[-1]) is not list:
            raise _Malformed(f"APPEND to a {type(self.stack[-1]).__name__}")
        return self.stack[-1]  # type: ignore[no-any-return]

    def _dict(self) -> dict[Any, Any]:
        if type(self.stack[-1]) not in (dict, OrderedDict, Counter):
            raise _Malformed(f"SETITEM on a {type(self.stack[-1]).__name__}")
        return self.stack[-1]  # type: ignore[no-any-return]


def check_stream(f: Any, what: str = "the pickle") -> None:
    """Before the standard unpickler reads the pickle at ``f``'s position (which ``f`` is left past):
    it is complete, opcode by opcode, and its memo indices grow as a pickler writes them. A damaged
    index (``LONG_BINPUT`` 2**31) would make the standard unpickler allocate a memo that large."""
    puts = 0
    try:
        for op, arg, _ in pickletools.genops(Bounded(f)):  # type: ignore[arg-type]
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                if not isinstance(arg, int) or not 0 <= arg <= puts + 1024:
                    raise _Malformed(f"{what} stores memo entry {arg!r} after {puts} entries")
                puts += 1
            elif op.name == "MEMOIZE":
                puts += 1
    except _Malformed:
        raise
    except Exception as err:  # what genops says of a cut or damaged pickle
        raise _Malformed(f"{what} is not a complete pickle ({type(err).__name__}: {str(err)[:200]})") from err


_CHECKED_REBUILDS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
}
"""Full unpickling too rebuilds tensors with the checked views: torch's own ``_rebuild_tensor*`` call
``set_``, which enlarges a storage that is too small for the view (gigabytes asked for by a file of a few
hundred bytes)."""


def load_full(f: Any, persistent_load: PersistentLoad) -> Any:
    """Full unpickling (``allow_pickle``): what ``torch.load(weights_only=False)`` does, storages from
    ``persistent_load`` and tensors rebuilt by the checked views, after :func:`check_stream`. Runs code
    the file names. A global whose module this Python cannot import raises that ``ImportError`` (a
    package missing here, not damage)."""
    start = f.tell()
    check_stream(f)
    f.seek(start)

    class Full(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            checked = _CHECKED_REBUILDS.get((module, name))
            if checked is not None:
                return checked
            if "Storage" in name and module in ("torch", "torch.storage"):
                try:
                    return torch.serialization.StorageType(name)  # type: ignore[no-untyped-call]
                except KeyError:
                    pass
            return super().find_class("torch._tensor" if module == "torch.tensor" else module, name)

        def persistent_load(self, pid: Any) -> Any:
            return persistent_load(pid)

    try:
        return Full(Bounded(f), encoding="utf-8").load()
    except (_Malformed, _Refused, ImportError):
        raise
    except RecursionError as err:
        raise _Malformed("the pickle nests too deeply") from err
    except Exception as err:
        raise _Malformed(f"{type(err).__name__}: {str(err)[:200]}") from err


class _Null(io.StringIO):
    def write(self, s: str) -> int:
        return len(s)


_NULL = _Null()


def installed(name: str) -> bool:
    """Whether the top-level package of the global ``name`` is installed here (found, not imported)."""
    top = name.split(".", 1)[0]
    if top in sys.modules:
        return sys.modules[top] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


def exists(name: str) -> bool:
    """Whether the global ``module.attr`` could be found by full unpickling here, told without importing
    anything (a module not imported yet: whether its top-level package is installed)."""
    module, _, attr = name.rpartition(".")
    loaded = sys.modules.get(module)
    if loaded is not None:
        return hasattr(loaded, attr)
    parts = module.split(".")
    known = next((k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in sys.modules), 0)
    try:  # the first part not imported yet: found (not run) by its loaded parent, or as a top-level name
        return importlib.util.find_spec(".".join(parts[: known + 1])) is not None
    except (ImportError, ValueError):
        return False


def well_formed(f: Any, end: int | None = None) -> bool:
    """Whether the pickle at ``f``'s position is complete, with a consistent stack and memo (and ends at
    ``end``, when given): a refusal of a damaged pickle is reported as damage, never as a reason to
    unpickle it fully."""

    try:
        f = Bounded(f)
        pickletools.dis(f, out=_NULL)
        return end is None or f.tell() == end
    except Exception:
        return False
