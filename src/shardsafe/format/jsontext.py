"""Strict, bounded JSON: how every JSON document of a checkpoint (``MANIFEST.json``, safetensors
headers) is parsed (docs/format.md, section 8).

- UTF-8 only: no byte-order mark, no UTF-16/32 (``json.loads`` on bytes would guess those), no lone
  surrogate escapes (``"\\ud800"``), which no UTF-8 text can hold;
- no ``NaN``/``Infinity`` literals, no number that overflows to an infinite float (``1e400``);
- nesting depth capped, measured on the raw text before parsing, so that neither the parser nor
  any recursive walk over the result can exhaust the stack.

Every refusal is a :class:`CorruptCheckpointError` naming the document.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from shardsafe.errors import CorruptCheckpointError

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_EMPTY_PAIR = re.compile(r"\[\]|\{\}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def nesting_depth(text: str, limit: int) -> int | None:
    """The nesting depth of arrays and objects in JSON ``text`` if it is at most ``limit``, else
    ``None``. Linear-time passes in C (one per level), no recursion. For text that is not valid JSON
    the answer bounds what a parser would reach before it fails."""
    skeleton = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = 0
    while skeleton:
        if depth >= limit:
            return None
        skeleton, pairs = _EMPTY_PAIR.subn("", skeleton)
        if not pairs:  # unbalanced: a parser fails, at the latest after the brackets left
            return depth + len(skeleton) if depth + len(skeleton) <= limit else None
        depth += 1
    return depth


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
    if nesting_depth(text, max_depth) is None:
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
