"""Replicated tensors that differ between ranks: found before the commit, refused (or logged).

A tensor that is not sharded (a plain or DDP module's parameters and buffers, optimizer state, a
replicated DTensor, a large plain tensor) is taken as the same on every rank and written once, by one
rank (engine/plan.py). When the ranks' copies differ (no DDP wrapper, replicas that drifted apart), the
checkpoint would hold each tensor from whichever rank wrote it: tied weights split, an optimizer state
from another rank than its parameter. torch.distributed.checkpoint mixes them silently.

So every rank digests its replicated tensors (:func:`digests`, at the start of the save, on the
caller's thread before the call returns, so an asynchronous save digests what it copies) and sends the digests in its
``WriteReport``; rank 0 compares them before the commit (:func:`check`, called by
``engine/commit.py:build_manifest``), and every rank raises the same refusal, or rank 0 logs it.

**Cost.** A rank reads today only the bytes it writes. Hashing every replicated byte on every rank
would read the whole model on each of them, so each tensor is digested by a sample: the whole tensor up
to 4 x ``SHARDSAFE_REPLICA_SAMPLE_BYTES`` (256 KiB), else 16 evenly spaced windows adding up to the
sample (64 KiB), the first and last bytes included (``bench/replicas.py`` measures the cost against the
save without it). Replicas that differ because they were never synchronised, or drifted, differ almost everywhere
and are found; a difference confined to bytes outside the windows is not (a larger sample finds more).
Module buffers are told apart: DDP broadcasts them at each forward and BatchNorm then updates them
from each rank's batch, so they differ by design; they are logged (INFO), never refused.

**Size.** The digests of a rank's message do not grow with the tensors: the replicated tensors, in the
state's order, are cut into at most :data:`BUCKETS` runs (each named by its tensors), one digest each.

``SHARDSAFE_REPLICA_CHECK``: ``refuse`` (default), ``warn`` (rank 0 logs a WARNING and the save
commits) or ``off`` (nothing is digested). Skipped for ``staging="background"``, whose copies run while
the caller's tensors change (a rank does not copy what it does not write).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xxhash

from shardsafe import knobs
from shardsafe.errors import InconsistentRanksError
from shardsafe.format.datafile import tensor_bytes
from shardsafe.state.flatten import FlatState, TensorItem

logger = logging.getLogger(__name__)

BUCKETS = 64
"""The most digests a rank sends for its parameters and other replicated tensors (its buffers: as many
again)."""
WINDOWS = 16


def _buckets(flat: FlatState) -> list[tuple[str, list[TensorItem]]]:
    """(every rank, the same from the same structure) The replicated tensors cut into runs: ``("tensor",
    items)`` for parameters and other tensors, then ``("buffer", items)`` for module buffers."""
    buffers = {(b.device, b.data_ptr()) for b in flat.buffers if b.device.type != "meta"}
    kinds: dict[str, list[TensorItem]] = {"tensor": [], "buffer": []}
    for item in flat.items:
        if item.replicated and item.local.device.type != "meta":
            key = (item.local.device, item.local.data_ptr())
            kinds["buffer" if key in buffers else "tensor"].append(item)
    out: list[tuple[str, list[TensorItem]]] = []
    for kind, items in kinds.items():
        n = min(BUCKETS, len(items))
        out += [(kind, items[i * len(items) // n : (i + 1) * len(items) // n]) for i in range(n)]
    return out


def _windows(nbytes: int, sample: int) -> list[tuple[int, int]]:
    """The byte ranges of a tensor of ``nbytes`` that are digested: all of it up to 4 x ``sample`` (one
    read of that size costs less than many small ones), else :data:`WINDOWS` evenly spaced windows adding
    up to ``sample``, the first at the start and the last at the end."""
    if nbytes <= 4 * sample:
        return [(0, nbytes)]
    width = max(1, sample // WINDOWS)
    return [
        (k * (nbytes - width) // (WINDOWS - 1), k * (nbytes - width) // (WINDOWS - 1) + width) for k in range(WINDOWS)
    ]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its device (a copy only when ``t`` is not contiguous or is a
    lazy conjugate/negative view)."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)


def digests(flat: FlatState) -> list[str]:
    """(every rank, before the save's call returns) One digest per run of :func:`_buckets`; empty with
    ``SHARDSAFE_REPLICA_CHECK=off``. CPU tensors are read in place; an accelerator's windows are gathered
    on its device and copied to the host once per device."""
    if knobs.replica_check() == "off":
        return []
    sample = knobs.replica_sample_bytes()
    runs: list[list[memoryview | tuple[torch.device, int, int]]] = []
    on_device: dict[torch.device, list[torch.Tensor]] = {}
    filled: dict[torch.device, int] = {}
    for _, items in _buckets(flat):
        run: list[memoryview | tuple[torch.device, int, int]] = []
        for item in items:
            if item.local.device.type == "cpu":
                try:
                    memory = tensor_bytes(item.local)  # in place: the common case, checked by tensor_bytes
                except ValueError:  # not contiguous, or a lazy conjugate/negative view
                    memory = tensor_bytes(_flat_bytes(item.local))
                run += [memory[a:b] for a, b in _windows(len(memory), sample)]
                continue
            raw = _flat_bytes(item.local)
            for a, b in _windows(raw.numel(), sample):
                start = filled.get(raw.device, 0)
                on_device.setdefault(raw.device, []).append(raw[a:b])
                filled[raw.device] = start + b - a
                run.append((raw.device, start, start + b - a))
        runs.append(run)
    host = {device: tensor_bytes(torch.cat(parts).cpu()) for device, parts in on_device.items()}
    out = []
    for run in runs:
        h = xxhash.xxh3_64()
        for piece in run:
            if isinstance(piece, memoryview):
                h.update(piece)
            else:
                device, a, b = piece
                h.update(host[device][a:b])
        out.append(h.hexdigest())
    return out


def _names(items: Sequence[TensorItem], most: int = 4) -> str:
    shown = ", ".join(repr(i.name) for i in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _groups(per_rank: dict[int, str]) -> str:
    """``2 different values, held by ranks [0, 2] | [1, 3]`` (the largest group first, at most 8)."""
    by: dict[str, list[int]] = {}
    for rank in sorted(per_rank):
        by.setdefault(per_rank[rank], []).append(rank)
    groups = sorted(by.values(), key=lambda ranks: (-len(ranks), ranks))
    shown = " | ".join(str(ranks) for ranks in groups[:8]) + (" | ..." if len(groups) > 8 else "")
    return f"{len(groups)} different values, held by ranks {shown}"


def check(path: str, flat: FlatState, reported: dict[int, list[str]]) -> None:
    """(rank 0, every report in, before the commit) Compare the ranks' digests; for a replicated tensor
    whose copies differ, raise the refusal every rank raises (``refuse``), or log it (``warn``; module
    buffers always: INFO)."""
    if knobs.replica_check() == "off" or len(reported) < 2:
        return
    buckets = _buckets(flat)
    if any(len(d) != len(buckets) for d in reported.values()):  # a rank with the check off, or a background save
        return
    tensors: list[str] = []
    buffers: list[str] = []
    for i, (kind, items) in enumerate(buckets):
        per_rank = {r: d[i] for r, d in reported.items()}
        if len(set(per_rank.values())) > 1:
            (buffers if kind == "buffer" else tensors).append(f"{_names(items)}: {_groups(per_rank)}")
    if buffers:
        logger.info(
            "shardsafe: save of %s: module buffers differ between ranks (DDP's BatchNorm statistics do): %s; the "
            "checkpoint holds each from the rank that wrote it",
            path,
            "; ".join(buffers),
        )
    if not tensors:
        return
    message = (
        f"save of {path!r}: tensors that should be the same on every rank differ between ranks: "
        f"{' | '.join(tensors[:8])}{' | ...' if len(tensors) > 8 else ''}. A tensor that is not sharded is saved "
        "once, by one rank, so the checkpoint would mix the ranks' values. Wrap the model in "
        "DistributedDataParallel (or shard it with FSDP) so the replicas stay equal, or mark values that "
        "differ by design with shardsafe.per_rank(...). SHARDSAFE_REPLICA_CHECK=warn saves anyway (each tensor "
        "from one rank), =off skips the check (docs/faults.md)."
    )
    if knobs.replica_check() == "warn":
        logger.warning("shardsafe: %s", message.replace("differ between ranks", "differ between ranks (saved anyway)"))
        return
    raise InconsistentRanksError(message)
