"""Helpers of the fsspec backend (:mod:`shardsafe.storage.remote`): importing fsspec lazily, the S3
client's own timeouts and retries under a call's timeout, telling fsspec's local filesystem apart,
reading an entry's modification time, checking plain names."""

from __future__ import annotations

import datetime
import math
import os
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


S3_ATTEMPTS = 2
"""Attempts botocore makes at one request (its ``standard`` retry mode), and s3fs' loop around it:
the retry loop that backs off until the deadline is shardsafe's own (:mod:`shardsafe.storage.retry`)."""
_S3FS_TIMEOUTS = {"connect_timeout": 5.0, "read_timeout": 15.0}
"""s3fs' own defaults, kept where a call's timeout allows them."""


def s3_client_options(options: Mapping[str, Any], seconds: float | None) -> dict[str, Any]:
    """``options`` (an s3fs filesystem's) with botocore's budget bounded by a call's ``seconds``: its
    connect and read timeouts at most a quarter of them (s3fs' 5 and 15 s where those are shorter), and
    :data:`S3_ATTEMPTS` attempts per request; s3fs' loop around botocore makes at most as many (see
    :func:`bound_s3_retries`). So one request ends on its own within about ``seconds`` (attempts
    times timeouts, and botocore's short backoffs), even one a deadline abandoned. What the caller set
    in ``config_kwargs`` stays, and so do retries configured through ``AWS_MAX_ATTEMPTS`` /
    ``AWS_RETRY_MODE``. ``seconds=None`` (or infinite): the timeouts stay s3fs'."""
    config = dict(options.get("config_kwargs") or {})
    if seconds is not None and math.isfinite(seconds):
        for name, default in _S3FS_TIMEOUTS.items():
            config.setdefault(name, min(default, seconds / (2 * S3_ATTEMPTS)))
    if "retries" not in config and not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        config["retries"] = {"total_max_attempts": S3_ATTEMPTS, "mode": "standard"}
    return {**options, "config_kwargs": config}


def bound_s3_retries(fs: Any) -> None:
    """At most :data:`S3_ATTEMPTS` attempts in s3fs' own retry loop (5 by default; a class attribute
    that no option sets) of the filesystem ``fs``, which :func:`s3_client_options` configured."""
    if getattr(fs, "retries", 0) > S3_ATTEMPTS:
        fs.retries = S3_ATTEMPTS


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
