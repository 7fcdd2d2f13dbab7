"""The I/O pipelines in both directions, exercised on CPU (a CPU source goes through the same staging
code as an accelerator one when routed through the pool).

Saves: one pipeline for sync and async saves; a synchronous save that copies holds at most the pool;
the bytes on disk do not depend on the route (direct, pool of any slot size, slab). Loads: every block
is verified in a bounce buffer before it reaches the caller's tensor; reader threads are finished (or,
hung past the deadline, fenced off from the caller's tensors) before ``load`` returns or raises.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardsafe
from shardsafe import CorruptCheckpointError
from shardsafe.deadline import Deadline
from shardsafe.engine import hostmem, staging
from shardsafe.engine.read import plan_reads, read_manifest, run_tasks
from shardsafe.storage.local import LocalStorage

BLOCK = 4096  # checksum block for these tests


def _manifest(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((path / "MANIFEST.json").read_text())
    return doc


def _chunk(path: Path, tensor: str) -> dict[str, Any]:
    (c,) = _manifest(path)["tensors"][tensor]["chunks"]
    return dict(c)


def _data_files(path: Path) -> dict[str, bytes]:
    return {p.name.split("-")[1]: p.read_bytes() for p in sorted(path.glob("data-*"))}


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shardsafe-read")]


def _state(seed: int = 0) -> dict[str, Any]:
    """Sizes that cut across checksum blocks and pool slots in every way: a tensor larger than the pool,
    odd byte counts, empty and 0-d tensors, 1- and 2-byte dtypes, a non-contiguous one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * 2**18 + 5, generator=g),  # 3 MiB + 20 bytes: larger than the 1 MiB pool
        "odd": torch.randint(0, 255, (12_345,), dtype=torch.uint8, generator=g),
        "half": torch.randn(777, 3, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.25),
        "mask": torch.rand(5000, generator=g) > 0.5,
        "strided": torch.randn(64, 48, generator=g).t(),
        "step": 9,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and v.shape == b[k].shape and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


class _CpuAllocations(TorchDispatchMode):
    """Records the bytes of every tensor an operator creates (copies like ``.cpu()`` included)."""

    CREATE = ("empty.memory_format", "empty_strided.default", "clone.default", "_to_copy.default")

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if str(func).removeprefix("aten.") in self.CREATE:
            self.sizes.append(out.untyped_storage().nbytes())
        return out


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> int:
    """A 1 MiB pool of 256 KiB slots (slot and checksum block boundaries do not line up), with CPU
    sources of synchronous saves routed through it as accelerator sources are."""
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", str(BLOCK + 8))
    monkeypatch.setenv("SHARDSAFE_STAGING_POOL_BYTES", str(2**20))
    monkeypatch.setenv("SHARDSAFE_WRITE_PIECE_BYTES", str(2**18))
    monkeypatch.setattr(staging, "copy_cpu_sources", True)
    staging.free_idle()
    yield 2**20
    staging.free_idle()


# ------------------------------------------------------------------------------------------- saves


def test_sync_save_through_the_pool_holds_at_most_the_pool(tmp_path: Path, small_pool: int) -> None:
    state = _state()
    source = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert source > 3 * small_pool
    held = hostmem.held_bytes()  # buffers of earlier operations that the garbage collector has yet to free
    hostmem.reset_peak()
    with _CpuAllocations() as allocs:
        shardsafe.save(tmp_path / "pooled", state)
    # every byte went through the pool, and nothing else of any size was allocated on the host
    assert hostmem.peak_bytes() - held == small_pool
    big = [n for n in allocs.sizes if n > 64 * 1024]
    assert sum(big) <= small_pool, big
    loaded = shardsafe.load(tmp_path / "pooled")
    _same({k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, loaded)


def test_route_does_not_change_a_byte(tmp_path: Path, small_pool: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct from memory, through a small pool with slots that split checksum blocks, and through an
    async slab: the data files are identical, byte for byte (the format does not depend on the route)."""
    state = _state(3)
    shardsafe.save(tmp_path / "pooled", state)
    shardsafe.async_save(tmp_path / "slab", state).wait()
    monkeypatch.setattr(staging, "copy_cpu_sources", False)
    shardsafe.save(tmp_path / "direct", state)
    direct = _data_files(tmp_path / "direct")
    assert direct == _data_files(tmp_path / "pooled") == _data_files(tmp_path / "slab")
    chunks = [
        {
            t: [{k: v for k, v in c.items() if k != "file"} for c in e["chunks"]]
            for t, e in _manifest(tmp_path / n)["tensors"].items()
        }
        for n in ("direct", "pooled", "slab")
    ]
    assert chunks[0] == chunks[1] == chunks[2]  # offsets, byte ranges and checksums


@contextmanager
def _calls(names: list[str]) -> Iterator[list[str]]:
    """Record which of the pipeline functions ``names`` (attributes of ``staging``) run."""
    seen: list[str] = []
    saved = {n: getattr(staging, n) for n in names}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return saved[name](*args, **kwargs)

        return call

    for n in names:
        setattr(staging, n, spy(n))
    try:
        yield seen
    finally:
        for n, fn in saved.items():
            setattr(staging, n, fn)


def test_sync_and_async_save_run_one_pipeline(tmp_path: Path, small_pool: int) -> None:
    """A synchronous save is an asynchronous one plus wait: the same staging functions move the bytes
    (the sync one through the bounded pool, the async one into one slab holding its share)."""
    names = ["stage", "copy_piece", "record_done", "wait_done", "windows"]
    state = _state(1)
    with _calls(names) as sync_calls:
        shardsafe.save(tmp_path / "sync", state)
    staging.free_idle()
    held = hostmem.held_bytes()
    hostmem.reset_peak()
    before = hostmem.allocations()
    with _calls(names) as async_calls:
        shardsafe.async_save(tmp_path / "async", state).wait()
    assert set(sync_calls) == set(async_calls) == set(names)
    share = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert hostmem.allocations() == before + 1  # one slab for the whole share
    assert hostmem.peak_bytes() - held == share
    assert _data_files(tmp_path / "sync") == _data_files(tmp_path / "async")


# ------------------------------------------------------------------------------------------- loads


@pytest.fixture
def four_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", str(BLOCK))
    path = tmp_path / "c"
    shardsafe.save(path, {"w": torch.arange(4 * BLOCK // 4, dtype=torch.float32), "v": torch.ones(BLOCK // 4)})
    return path


def test_corrupt_block_never_lands_in_the_destination(four_blocks: Path) -> None:
    c = _chunk(four_blocks, "w")
    file = four_blocks / c["file"]
    raw = bytearray(file.read_bytes())
    raw[c["begin"] + 2 * BLOCK + 100] ^= 0xFF  # the third of four blocks
    file.write_bytes(bytes(raw))
    dest = torch.full((4 * BLOCK // 4,), -7.0)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        shardsafe.load(four_blocks, {"w": dest})
    block = BLOCK // 4
    assert torch.equal(dest[2 * block : 3 * block], torch.full((block,), -7.0))  # not one corrupt byte
    assert not _reader_threads()


def test_reader_threads_finish_before_load_raises(four_blocks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read fails at once (a corrupt block of ``v``) while another is slow: ``load`` raises only once
    no reader thread is left, so nothing changes the caller's tensors after it raised."""
    v = _chunk(four_blocks, "v")
    file = four_blocks / v["file"]
    raw = bytearray(file.read_bytes())
    raw[v["begin"] + 5] ^= 0xFF
    file.write_bytes(bytes(raw))
    real = LocalStorage.read_into

    def slow(self: LocalStorage, path: str, offset: int, out: memoryview) -> None:
        if offset < v["begin"]:
            time.sleep(0.3)  # the reads of "w"
        real(self, path, offset, out)

    monkeypatch.setattr(LocalStorage, "read_into", slow)
    w = torch.full((4 * BLOCK // 4,), -7.0)
    with pytest.raises(CorruptCheckpointError, match="tensor 'v'"):
        shardsafe.load(four_blocks, {"w": w, "v": torch.zeros(BLOCK // 4)})
    assert not _reader_threads()
    after = w.clone()
    time.sleep(0.8)  # more than two slow reads
    assert torch.equal(w, after)  # no thread wrote into it after load raised


def test_read_hung_past_the_deadline_never_writes_afterwards(
    four_blocks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = LocalStorage.read_into

    def hung(self: LocalStorage, path: str, offset: int, out: memoryview) -> None:
        release.wait(30)
        real(self, path, offset, out)

    monkeypatch.setattr(LocalStorage, "read_into", hung)
    w = torch.full((4 * BLOCK // 4,), -7.0)
    try:
        with pytest.raises(shardsafe.CheckpointError, match=r"reads did not finish within 1s"):
            shardsafe.load(four_blocks, {"w": w}, timeout=1)
    finally:
        release.set()
    for t in _reader_threads():  # the abandoned reads now complete...
        t.join(10)
    assert torch.equal(w, torch.full_like(w, -7.0))  # ...into a bounce buffer, never into the tensor


def test_column_ranges_strided_and_0d_destinations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Destinations that cannot take a block's bytes directly (a column range, as when resharding along
    dim 1; a non-contiguous view; a 0-d tensor) go through the same verified reads."""
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", "100")
    full = torch.arange(30 * 7, dtype=torch.float32).reshape(30, 7)
    shardsafe.save(tmp_path / "c", {"m": full, "s": torch.tensor(2.5)})
    m = torch.zeros(7, 30).t()  # non-contiguous
    s = torch.zeros(())
    shardsafe.load(tmp_path / "c", {"m": m, "s": s})
    assert torch.equal(m, full) and s.item() == 2.5
    storage = LocalStorage()
    manifest = read_manifest(storage, str(tmp_path / "c"))
    cols = torch.zeros(30, 3)
    tasks = plan_reads("m", manifest.tensors["m"], cols, (0, 2))
    deadline = Deadline.after(60, "io")
    assert run_tasks(storage, str(tmp_path / "c"), manifest, tasks, lambda: None, deadline) == full.numel() * 4
    assert torch.equal(cols, full[:, 2:5])
