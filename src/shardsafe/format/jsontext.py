"""Strict, bounded JSON: how every JSON document of a checkpoint (``MANIFEST.json``, safetensors
headers) is parsed (docs/format.md, section 8).

- UTF-8 only: no byte-order mark, no UTF-16/32 (``json.loads`` on bytes would guess those), no lone
  surrogate escapes (``"\\ud800"``), which no UTF-8 text can hold;
- no ``NaN``/``Infinity`` literals, no number that overflows to an infinite float (``1e400``);
- nesting depth capped, measured on the raw text before parsing (in linear time, vectorised), so
  that neither the parser nor any recursive walk over the result can exhaust the stack.

Every refusal is a :class:`CorruptCheckpointError` naming the document.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from shardsafe.errors import CorruptCheckpointError

_NOT_BRACKET = bytes(range(256)).translate(None, b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # minus 1: +1 opens, -1 closes
_BLOCK = 1 << 24
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def nesting_depth(data: bytes, limit: int) -> int | None:
    """The nesting depth of arrays and objects in the JSON text ``data`` (UTF-8) if it is at most
    ``limit``, else ``None``. Linear and vectorised, no recursion and no Python loop per character:
    escapes are dropped, then the strings (between the quotes left), then every byte but brackets;
    the brackets become +1/-1 steps whose running sums are taken block by block. For text that is not
    valid JSON it bounds how deep a parser gets before it fails (an unmatched closing bracket stops it)."""
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = b"".join(unescaped.split(b'"')[::2]).translate(_STEPS, _NOT_BRACKET)
    depth = peak = 0
    for start in range(0, len(skeleton), _BLOCK):
        steps = torch.frombuffer(bytearray(skeleton[start : start + _BLOCK]), dtype=torch.uint8).to(torch.int32) - 1
        running = torch.cumsum(steps, 0, dtype=torch.int32) + depth
        peak = max(peak, int(running.max()))
        if peak > limit:
            return None
        if int(running.min()) < 0:
            return peak
        depth = int(running[-1])
    return peak


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed (non-finite floats are typed values)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is too large for a float")
    return value


def parse(raw: bytes | bytearray | memoryview, where: str, what: str, *, max_depth: int) -> Any:
    """The JSON value in ``raw`` (``what`` names the document in errors, ``where`` its path)."""
    data = bytes(raw)
    if data.startswith(b"\xef\xbb\xbf"):
        raise CorruptCheckpointError(f"{where}: {what} starts with a byte-order mark; it must be plain UTF-8")
    if b"\0" in data:  # never in JSON text; what UTF-16 or UTF-32 looks like as bytes
        raise CorruptCheckpointError(f"{where}: {what} holds NUL bytes; it must be UTF-8 JSON, not UTF-16/32")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorruptCheckpointError(f"{where}: {what} is not UTF-8 text ({err})") from None
    if nesting_depth(data, max_depth) is None:
        raise CorruptCheckpointError(
            f"{where}: {what} is nested more than {max_depth} levels deep (or is not JSON at all)"
        )
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as err:
        raise CorruptCheckpointError(f"{where}: {what} is not valid JSON ({err})") from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise CorruptCheckpointError(f"{where}: {what} holds a lone surrogate escape, not UTF-8 text") from None
    return value
