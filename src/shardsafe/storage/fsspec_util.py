"""Helpers of the fsspec backend (:mod:`shardsafe.storage.remote`): importing fsspec lazily, telling
fsspec's local filesystem apart, reading an entry's modification time, checking plain names."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from shardsafe.errors import InvalidArgumentError


def import_fsspec() -> Any:
    try:
        import fsspec
    except ImportError as err:
        raise ImportError(
            "paths with a scheme (s3://, memory://, ...) need fsspec: pip install 'shardsafe[remote]', "
            "or 'shardsafe[s3]' for S3"
        ) from err
    return fsspec


def local_dir(fs: Any, path: str) -> str | None:
    """``path`` when ``fs`` is fsspec's local filesystem (so ``os`` calls apply), else None."""
    from fsspec.implementations.local import LocalFileSystem

    return path if isinstance(fs, LocalFileSystem) else None


def mtime_of(entry: Mapping[str, Any]) -> float | None:
    """Modification time of an fsspec ``info``/``ls`` entry; filesystems name and type it differently."""
    for key in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value = entry.get(key)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")


def check_name(name: str, base: str) -> None:
    if not _plain(name):
        raise InvalidArgumentError(f"{name!r} is not a plain file name inside {base} (no '/', '..' or empty names)")
