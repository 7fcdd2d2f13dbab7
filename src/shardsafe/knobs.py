"""Internal tunables, in one place. Each has a default and an environment override
(``SHARDSAFE_<NAME>``); none is public API."""

from __future__ import annotations

import os

from shardsafe.errors import InvalidArgumentError


def _float(name: str, default: float) -> float:
    raw = os.environ.get(f"SHARDSAFE_{name}")
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"SHARDSAFE_{name}={raw!r} is not a number; unset it or give seconds/bytes"
        ) from None
    if value <= 0:
        raise InvalidArgumentError(f"SHARDSAFE_{name}={raw!r} must be positive")
    return value


def arrive_timeout() -> float:
    """Seconds to wait for every rank to reach a save/load (rendezvous) or a runtime barrier."""
    return _float("TIMEOUT", 300.0)


def io_timeout() -> float:
    """Seconds to wait for the slowest rank's writes/reads and the commit. Large states need long."""
    return _float("IO_TIMEOUT", max(1800.0, arrive_timeout()))


def stall_fraction() -> float:
    """After this fraction of a deadline, a waiting rank logs once what it waits for (WARNING)."""
    return _float("STALL_FRACTION", 0.25)


def poll_seconds() -> float:
    """How often a waiting rank wakes up to check the clock and stall state."""
    return _float("POLL_SECONDS", 0.5)


def wait_margin_seconds() -> float:
    """Added to the bound of an operation's own waits where a caller waits for that operation from
    outside (``SaveHandle.wait()`` without a timeout, draining saves at exit, an upload's parts)."""
    return _float("WAIT_MARGIN_SECONDS", 60.0)


def max_inflight_saves() -> int:
    """Asynchronous saves that may be in flight at once per process; a new save first waits until
    fewer are. Staging memory is at most this many times this rank's share."""
    return max(1, int(_float("MAX_INFLIGHT_SAVES", 1)))


def heartbeat_seconds() -> float:
    """While in a save or load, each rank ticks a store counter this often."""
    return _float("HEARTBEAT_SECONDS", 1.0)


def dead_after() -> float:
    """A rank that joined an operation and has not ticked for this long is declared dead."""
    return _float("DEAD_AFTER", 20.0)


def store_connect_wait() -> float:
    """How long an operation waits for shardsafe's own store connection (opened in the background on
    first use) before it uses the process group's shared client for this operation instead."""
    return _float("STORE_CONNECT_WAIT", 0.5)


def full_save_every() -> int:
    """A ``CheckpointManager(incremental=True)`` writes every this-many-th save in full (the others
    refer to the newest checkpoint for unchanged data), so old data is not kept for reference forever."""
    return max(1, int(_float("FULL_SAVE_EVERY", 10)))


def checksum_block_bytes() -> int:
    """Checksums are kept per block of a chunk, so a partial read can be verified on its own."""
    return int(_float("CHECKSUM_BLOCK_BYTES", 8 * 1024 * 1024))


def write_piece_bytes() -> int:
    """Bytes per write() call on the save path (hashing runs per piece, while memory is hot); also the
    slot size of the staging pool."""
    return int(_float("WRITE_PIECE_BYTES", 8 * 1024 * 1024))


def staging_pool_bytes() -> int:
    """Host memory of the pool a synchronous save streams accelerator tensors through (page-locked,
    allocated once, reused): the most extra host memory such a save holds, whatever the state's size."""
    return int(_float("STAGING_POOL_BYTES", 256 * 1024 * 1024))


def split_replicated_bytes() -> int:
    """A replicated tensor larger than this is split into row ranges written by several ranks."""
    return int(_float("SPLIT_REPLICATED_BYTES", 32 * 1024 * 1024))


def io_threads() -> int:
    """Threads per rank for reading on load."""
    return int(_float("IO_THREADS", 4))


def remote_read_threads() -> int:
    """Object stores: ranged GETs in flight at once for one rank's reads of one file."""
    return max(1, int(_float("REMOTE_READ_THREADS", 4)))


def remote_retry_first_delay() -> float:
    """Object stores: seconds slept before the first retry of a request (doubled after each failure)."""
    return _float("REMOTE_RETRY_FIRST_DELAY", 0.1)


def remote_retry_max_delay() -> float:
    """Object stores: the longest sleep between two attempts at a request."""
    return _float("REMOTE_RETRY_MAX_DELAY", 5.0)


def local_gather_below_bytes() -> int:
    """Local disk: pieces smaller than this are gathered into one buffer and written together."""
    return int(_float("LOCAL_GATHER_BELOW_BYTES", 256 * 1024))


def local_gather_bytes() -> int:
    """Local disk: a gather buffer is written once it holds this many bytes."""
    return int(_float("LOCAL_GATHER_BYTES", 4 * 1024 * 1024))


def first_poll_seconds() -> float:
    """A rank waiting on the store first looks again after this long, then doubles the pause up to
    :func:`poll_seconds`."""
    return _float("FIRST_POLL_SECONDS", 0.002)


def remote_part_bytes() -> int:
    """Object stores: bytes per multipart-upload part (doubled every 1,000 parts)."""
    return int(_float("REMOTE_PART_BYTES", 16 * 1024 * 1024))


def remote_upload_threads() -> int:
    """Object stores: parts uploaded concurrently per data file."""
    return max(1, int(_float("REMOTE_UPLOAD_THREADS", 4)))


def remote_retry_seconds() -> float:
    """Object stores: how long a request keeps being retried on transient errors."""
    return _float("REMOTE_RETRY_SECONDS", 120.0)


def per_rank_digest_bytes() -> int:
    """At save, plain tensors of values and stateful objects up to this size are compared between
    ranks by their bytes (larger ones by dtype and shape only: assumed equal unless wrapped in
    ``shardsafe.per_rank``); those that differ are kept per rank."""
    return int(_float("PER_RANK_DIGEST_BYTES", 1024 * 1024))


def export_slab_bytes() -> int:
    """Export: bytes read, converted and written at a time (two such buffers are in use at once)."""
    return int(_float("EXPORT_SLAB_BYTES", 64 * 1024 * 1024))


def max_manifest_bytes() -> int:
    """Largest ``MANIFEST.json`` a reader reads (a file larger than this is refused before reading)."""
    return int(_float("MAX_MANIFEST_BYTES", 256 * 1024 * 1024))


def progress_interval() -> float:
    """Seconds between progress reports of a save or load: each rank publishes its byte counts to the
    store at most this often, and rank 0 calls ``progress=`` and logs an INFO line this often."""
    return _float("PROGRESS_INTERVAL", 2.0)


def progress_final_wait() -> float:
    """How long rank 0 waits, at the end of a save or load, for the ``progress=`` callback to take the
    final record (a slower callback gets it later, from its own thread; the operation returns)."""
    return _float("PROGRESS_FINAL_WAIT", 5.0)
