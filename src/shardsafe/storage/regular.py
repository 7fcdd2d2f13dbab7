"""Opening a checkpoint's files for reading, on a local disk, in bounded time.

A checkpoint comes from somewhere else, so any of its names may be something other than a file: a
FIFO (opening it blocks until a writer comes), a device (``/dev/zero`` streams forever), a directory,
a symlink loop, or a symlink to a file outside the checkpoint. Only regular files are opened, and
symlinks are followed only while they stay inside the checkpoint's directory (the directory holding
the name; the directory itself may be reached through a symlink). The file is examined with ``stat``
before it is opened, opened with ``O_NONBLOCK`` (so that a FIFO swapped in between cannot block
either) and examined again with ``fstat``. Anything else raises :class:`CorruptCheckpointError`
naming the path; a missing file stays a ``FileNotFoundError``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import TypeVar

from shardsafe.errors import CorruptCheckpointError

T = TypeVar("T")

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def no_loop(path: str, look: Callable[[], T]) -> T:
    """``look()`` (a stat of ``path``), a symlink loop there raising :class:`CorruptCheckpointError`."""
    try:
        return look()
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CorruptCheckpointError(f"{path} is a symlink loop, not a file") from None
        raise


def stat_regular(path: str) -> os.stat_result:
    """``os.stat`` of ``path``, which must be a regular file inside its own directory."""
    st = no_loop(path, lambda: os.stat(path))
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(
            f"{path} is not a regular file ({_kind(st.st_mode)}); a checkpoint's files are plain files"
        )
    if os.path.islink(path):
        real = os.path.realpath(path)
        home = os.path.realpath(os.path.dirname(os.path.abspath(path)))
        if not real.startswith(home.rstrip(os.sep) + os.sep):
            raise CorruptCheckpointError(
                f"{path} is a symlink to {real}, outside the checkpoint; a checkpoint reads nothing outside itself"
            )
    return st


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, a regular file inside its own directory (see the module
    docstring). The caller closes it."""
    before = stat_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise CorruptCheckpointError(f"{path} changed into {_kind(now.st_mode)} while being opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_whole(path: str, limit: int, knob: str) -> bytes:
    """The content of the regular file ``path``, refused when larger than ``limit`` bytes (``knob``
    names the setting that raises it)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes, more than the {limit} allowed; if it is genuine, raise {knob}"
            )
        chunks = []
        total = 0
        while total <= limit:
            piece = os.read(fd, min(limit + 1 - total, 1 << 20))
            if not piece:
                break
            chunks.append(piece)
            total += len(piece)
        if total > limit:
            raise CorruptCheckpointError(f"{path}: grew past {limit} bytes while being read; raise {knob} if genuine")
        return b"".join(chunks)
    finally:
        os.close(fd)
