"""Internal tunables, in one place: each is a :class:`Knob`, read from ``SHARDSAFE_<NAME>`` at every
call (so a test or a user may change it at any time), else its default; none is public API. The table
in docs/knobs.md is :func:`markdown` (a test keeps the two the same)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from shardsafe.errors import InvalidArgumentError

ALL: list[Knob] = []
"""Every knob, in the order of docs/knobs.md."""


class Knob:
    """A positive, finite number from ``SHARDSAFE_<name>``, else ``default`` (a number, or a function of other
    knobs). Call a :class:`Real` or a :class:`Whole` to read it."""

    def __init__(self, section: str, name: str, default: float | str | Callable[[], float], doc: str) -> None:
        self.env = f"SHARDSAFE_{name}"
        self.default = default
        self.section = section
        self.__doc__ = doc
        ALL.append(self)

    def value(self) -> float:
        raw = os.environ.get(self.env)
        if raw is None or raw == "":
            return self.default() if callable(self.default) else float(self.default)  # a Choice reads its own
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{self.env}={raw!r} is not a number; unset it or give seconds/bytes") from None
        if not 0 < value < math.inf:  # nan and inf too: a deadline of either never passes
            raise InvalidArgumentError(f"{self.env}={raw!r} must be a positive, finite number")
        return value


class Real(Knob):
    """Seconds or a fraction."""

    def __call__(self) -> float:
        return self.value()


class Whole(Knob):
    """A count or a size in bytes (at least 1)."""

    def __call__(self) -> int:
        return max(1, int(self.value()))


class Choice(Knob):
    """One of a few words (the first is the default)."""

    def __init__(self, section: str, name: str, choices: tuple[str, ...], doc: str) -> None:
        super().__init__(section, name, choices[0], doc)
        self.choices = choices

    def __call__(self) -> str:
        raw = os.environ.get(self.env, "").strip().lower()
        if raw == "":
            return self.choices[0]
        if raw not in self.choices:
            raise InvalidArgumentError(
                f"{self.env}={raw!r} is not one of {', '.join(self.choices)}; unset it or pick one"
            )
        return raw


def markdown() -> str:
    """The table of docs/knobs.md: every knob, its default and what it does, by section."""
    lines: list[str] = []
    section = None
    for knob in ALL:
        if knob.section != section:
            section = knob.section
            lines += ["", f"### {knob.section}", "", "| variable | default | what it does |", "| --- | --- | --- |"]
        doc = " ".join((knob.__doc__ or "").split()).replace("``", "`")
        lines.append(f"| `{knob.env}` | {_shown(knob)} | {doc} |")
    return "\n".join(lines[1:]) + "\n"


def _shown(knob: Knob) -> str:
    if callable(knob.default):
        return "see text"
    if isinstance(knob, Choice):
        return f"`{knob.choices[0]}` (or " + ", ".join(f"`{c}`" for c in knob.choices[1:]) + ")"
    value = knob.default
    assert not isinstance(value, str)
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if knob.env.endswith("BYTES") and value >= size and value % size == 0:
            return f"{int(value) // size} {unit}"
    return f"{value:g}" + (
        " s" if isinstance(knob, Real) and knob.env.endswith(("SECONDS", "TIMEOUT", "WAIT", "AFTER", "DELAY")) else ""
    )


_WAITS = "Waits and liveness (docs/faults.md)"

arrive_timeout = Real(
    _WAITS,
    "TIMEOUT",
    300.0,
    "Seconds to wait for every rank to reach a save/load (rendezvous) or a runtime barrier.",
)
io_timeout = Real(
    _WAITS,
    "IO_TIMEOUT",
    lambda: max(1800.0, arrive_timeout()),
    "Seconds to wait for the slowest rank's writes/reads and the commit (default: 1800 s, or "
    "``SHARDSAFE_TIMEOUT`` where that is longer). Large states need long.",
)
stall_fraction = Real(
    _WAITS,
    "STALL_FRACTION",
    0.25,
    "After this fraction of a deadline, a waiting rank logs once what it waits for (WARNING).",
)
arrival_stall_seconds = Real(
    _WAITS,
    "ARRIVAL_STALL_SECONDS",
    30.0,
    "While waiting for every rank to arrive at a call (its first agreement), a rank logs once after this long "
    "(or ``SHARDSAFE_STALL_FRACTION`` of the arrival deadline, if sooner) the ranks not there yet and when the "
    "call fails: a save guarded by ``if rank == 0:`` is named in seconds, not at the deadline.",
)
poll_seconds = Real(
    _WAITS,
    "POLL_SECONDS",
    0.5,
    "How often a waiting rank wakes up to check the clock, the store's health and stall state.",
)
wait_margin_seconds = Real(
    _WAITS,
    "WAIT_MARGIN_SECONDS",
    60.0,
    "Added to the bound of an operation's own waits where a caller waits for that operation from outside "
    "(``SaveHandle.wait()`` without a timeout, draining saves at exit, an upload's parts).",
)
heartbeat_seconds = Real(
    _WAITS,
    "HEARTBEAT_SECONDS",
    1.0,
    "While in a save or load, each rank ticks a store counter this often (and so checks that the store answers).",
)
dead_after = Real(
    _WAITS,
    "DEAD_AFTER",
    20.0,
    "A rank that joined an operation and has not ticked for this long is declared dead; a store that answers no "
    "request for this long is declared lost.",
)
error_report_seconds = Real(
    _WAITS,
    "ERROR_REPORT_SECONDS",
    5.0,
    "A rank that fails, or gives up at its deadline, may spend this long more telling the other ranks (store "
    "requests on the error path), so a call ends within its ``timeout`` plus this, even when the store's host "
    "is frozen.",
)

_SAVING = "Saving"

max_inflight_saves = Whole(
    _SAVING,
    "MAX_INFLIGHT_SAVES",
    1,
    "Asynchronous saves that may be in flight at once per process; a new save first waits until fewer are. Staging "
    "memory is at most this many times this rank's share.",
)
full_save_every = Whole(
    _SAVING,
    "FULL_SAVE_EVERY",
    10,
    "A ``CheckpointManager(incremental=True)`` writes every this-many-th save in full (the others refer to the "
    "newest checkpoint for unchanged data), so old data is not kept for reference forever.",
)
leftover_age_seconds = Real(
    _SAVING,
    "LEFTOVER_AGE_SECONDS",
    3600.0,
    "A save that commits over a checkpoint also removes the data files there that no manifest lists and no save in "
    "flight may still be writing (what another writer's failed save left), once unchanged for this long. Keep it "
    "above the longest save. A ``CheckpointManager`` uses its own ``leftover_age`` for its cleanup.",
)
checksum_block_bytes = Whole(
    _SAVING,
    "CHECKSUM_BLOCK_BYTES",
    8 * 1024 * 1024,
    "Checksums are kept per block of a chunk, so a partial read can be verified on its own.",
)
write_piece_bytes = Whole(
    _SAVING,
    "WRITE_PIECE_BYTES",
    8 * 1024 * 1024,
    "Bytes per write() call on the save path (hashing runs per piece, while memory is hot); also the slot size of "
    "the staging pool.",
)
staging_pool_bytes = Whole(
    _SAVING,
    "STAGING_POOL_BYTES",
    256 * 1024 * 1024,
    "Host memory of the pool a synchronous save streams accelerator tensors through (page-locked, allocated once, "
    "reused): the most extra host memory such a save holds, whatever the state's size.",
)
split_replicated_bytes = Whole(
    _SAVING,
    "SPLIT_REPLICATED_BYTES",
    32 * 1024 * 1024,
    "A replicated tensor larger than this is split into row ranges written by several ranks.",
)
per_rank_digest_bytes = Whole(
    _SAVING,
    "PER_RANK_DIGEST_BYTES",
    1024 * 1024,
    "At save, plain tensors of values and stateful objects up to this size are compared between ranks by their "
    "bytes (larger ones by dtype and shape only: assumed equal unless wrapped in ``shardsafe.per_rank``); those "
    "that differ are kept per rank.",
)
replica_check = Choice(
    _SAVING,
    "REPLICA_CHECK",
    ("refuse", "warn", "off"),
    "Tensors saved once for all ranks (not sharded) are compared between ranks by a digest of a sample of their "
    "bytes before the commit: ``refuse`` fails the save on every rank naming the tensors and ranks that differ, "
    "``warn`` logs it and commits (each tensor from the rank that wrote it), ``off`` compares nothing. Module "
    "buffers that differ (DDP's BatchNorm statistics) are only logged (docs/faults.md).",
)
replica_sample_bytes = Whole(
    _SAVING,
    "REPLICA_SAMPLE_BYTES",
    64 * 1024,
    "Bytes of each replicated tensor that ``SHARDSAFE_REPLICA_CHECK`` digests on every rank: all of a tensor "
    "up to 4 times this size, else 16 evenly spaced windows adding up to it.",
)
local_gather_below_bytes = Whole(
    _SAVING,
    "LOCAL_GATHER_BELOW_BYTES",
    256 * 1024,
    "Local disk: pieces smaller than this are gathered into one buffer and written together.",
)
local_gather_bytes = Whole(
    _SAVING,
    "LOCAL_GATHER_BYTES",
    4 * 1024 * 1024,
    "Local disk: a gather buffer is written once it holds this many bytes.",
)


_READING = "Reading"

io_threads = Whole(_READING, "IO_THREADS", 4, "Threads per rank for reading on load.")
max_manifest_bytes = Whole(
    _READING,
    "MAX_MANIFEST_BYTES",
    256 * 1024 * 1024,
    "Largest ``MANIFEST.json`` a reader reads (a file larger than this is refused before reading).",
)
export_slab_bytes = Whole(
    _READING,
    "EXPORT_SLAB_BYTES",
    64 * 1024 * 1024,
    "Export: bytes read, converted and written at a time (two such buffers are in use at once).",
)


_REMOTE = "Object stores"

remote_read_threads = Whole(
    _REMOTE,
    "REMOTE_READ_THREADS",
    4,
    "Object stores: ranged GETs in flight at once for one rank's reads of one file.",
)
remote_part_bytes = Whole(
    _REMOTE,
    "REMOTE_PART_BYTES",
    16 * 1024 * 1024,
    "Object stores: bytes per multipart-upload part (doubled every 1,000 parts).",
)
remote_upload_threads = Whole(
    _REMOTE,
    "REMOTE_UPLOAD_THREADS",
    4,
    "Object stores: parts uploaded concurrently per data file.",
)
remote_retry_seconds = Real(
    _REMOTE,
    "REMOTE_RETRY_SECONDS",
    120.0,
    "Object stores: how long a request keeps being retried on transient errors.",
)
remote_retry_first_delay = Real(
    _REMOTE,
    "REMOTE_RETRY_FIRST_DELAY",
    0.1,
    "Object stores: seconds slept before the first retry of a request (doubled after each failure).",
)
remote_retry_max_delay = Real(
    _REMOTE,
    "REMOTE_RETRY_MAX_DELAY",
    5.0,
    "Object stores: the longest sleep between two attempts at a request.",
)


_PROGRESS = "Progress (docs/progress.md)"

progress_interval = Real(
    _PROGRESS,
    "PROGRESS_INTERVAL",
    2.0,
    "Seconds between progress reports of a save or load: each rank publishes its byte counts to the store at most "
    "this often, and rank 0 calls ``progress=`` and logs an INFO line this often.",
)
progress_final_wait = Real(
    _PROGRESS,
    "PROGRESS_FINAL_WAIT",
    5.0,
    "How long rank 0 waits, at the end of a save or load, for the ``progress=`` callback to take the final record "
    "(a slower callback gets it later, from its own thread; the operation returns).",
)


_TIERS = "Node-local tier (docs/tiers.md)"

tier_socket_seconds = Real(
    _TIERS,
    "TIER_SOCKET_SECONDS",
    60.0,
    "A replica server's bound on a connection's token and request line, in all, and then on each socket operation "
    "of the request (a client that stalls this long is dropped and its transfer discarded); the sender's side is "
    "bounded by the manager's ``timeout``.",
)
