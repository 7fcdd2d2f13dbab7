"""The CUDA paths of the I/O pipelines (skipped without a GPU; the same code runs on CPU in
tests/test_pipeline.py). Run on a GPU machine: ``pytest tests/test_gpu.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CorruptCheckpointError
from shardsafe.engine import hostmem, staging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

POOL = 4 * 2**20


@pytest.fixture(autouse=True)
def _fresh_staging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SHARDSAFE_STAGING_POOL_BYTES", str(POOL))
    monkeypatch.setenv("SHARDSAFE_WRITE_PIECE_BYTES", str(2**20))
    monkeypatch.setenv("SHARDSAFE_CHECKSUM_BLOCK_BYTES", str(3 * 2**19))  # slots and blocks do not line up
    staging.free_idle()
    yield
    staging.free_idle()


def _state(device: str = "cuda") -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "big": torch.rand(5 * POOL // 4 + 3, generator=g, device=device),  # larger than the pool
        "half": torch.rand(1000, 7, generator=g, device=device).to(torch.bfloat16),
        "strided": torch.rand(300, 200, generator=g, device=device).t(),
        "scalar": torch.tensor(1.5, device=device),
        "step": 3,
    }


def _nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def test_sync_save_from_cuda_holds_at_most_the_pool(tmp_path: Path) -> None:
    state = _state()
    assert _nbytes(state) > 4 * POOL
    held, pinned = hostmem.held_bytes(), hostmem.pinned_bytes()
    hostmem.reset_peak()
    shardsafe.save(tmp_path / "c", state)
    assert hostmem.peak_bytes() - held == POOL and hostmem.pinned_peak_bytes() - pinned == POOL
    loaded = shardsafe.load(tmp_path / "c")
    for k, v in state.items():
        assert torch.equal(loaded[k], v.cpu()) if isinstance(v, torch.Tensor) else loaded[k] == v


def test_async_save_from_cuda_pins_exactly_the_share_and_snapshots(tmp_path: Path) -> None:
    state = _state()
    want = {k: v.cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pinned = hostmem.pinned_bytes()
    hostmem.reset_peak()
    handle = shardsafe.async_save(tmp_path / "c", state)
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)  # at once, on the current stream: must not reach the checkpoint
    handle.wait()
    assert hostmem.pinned_peak_bytes() - pinned == _nbytes(state)  # one slab, no power-of-two rounding
    loaded = shardsafe.load(tmp_path / "c")
    for k, v in want.items():
        assert torch.equal(loaded[k], v), k


def test_copies_wait_for_the_producing_stream(tmp_path: Path) -> None:
    """A tensor still being written on the caller's (non-default) stream is saved with its final value."""
    side = torch.cuda.Stream()
    x = torch.zeros(2**20, device="cuda")
    for how in ("save", "async_save"):
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # keeps the stream busy well past the save's start
            x.fill_(7.0)
            if how == "save":
                shardsafe.save(tmp_path / how, {"x": x})
            else:
                shardsafe.async_save(tmp_path / how, {"x": x}).wait()
        assert torch.equal(shardsafe.load(tmp_path / how)["x"], torch.full((2**20,), 7.0)), how


def test_load_into_cuda_tensors_in_place(tmp_path: Path) -> None:
    state = _state()
    shardsafe.save(tmp_path / "c", state)
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in dest.items() if isinstance(v, torch.Tensor)}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the caller's stream waits for the copies before load returns
        shardsafe.load(tmp_path / "c", dest)
        sums = {k: v.float().sum() for k, v in dest.items() if isinstance(v, torch.Tensor)}
    torch.cuda.synchronize()
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert dest[k].data_ptr() == ptrs[k] and torch.equal(dest[k], v), k
            assert torch.equal(sums[k], v.float().sum()), k


def test_corrupt_block_never_reaches_the_gpu_tensor(tmp_path: Path) -> None:
    x = torch.arange(4 * 3 * 2**17, dtype=torch.float32, device="cuda")  # four checksum blocks
    shardsafe.save(tmp_path / "c", {"x": x})
    (data,) = tmp_path.joinpath("c").glob("data-*")
    raw = bytearray(data.read_bytes())
    raw[-(3 * 2**19) - 10] ^= 0xFF  # in the third block
    data.write_bytes(bytes(raw))
    dest = torch.full_like(x, -1.0)
    with pytest.raises(CorruptCheckpointError):
        shardsafe.load(tmp_path / "c", {"x": dest})
    block = 3 * 2**17
    assert torch.equal(dest[2 * block : 3 * block].cpu(), torch.full((block,), -1.0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_device_than_the_current_one(tmp_path: Path) -> None:
    torch.cuda.set_device(0)
    x = torch.zeros(2**20, device="cuda:1")
    with torch.cuda.stream(torch.cuda.Stream(device="cuda:1")):
        torch.cuda._sleep(200_000_000)
        x.fill_(5.0)  # queued on a stream of cuda:1; the current device stays 0
        shardsafe.async_save(tmp_path / "c", {"x": x}).wait()
    dest = {"x": torch.zeros(2**20, device="cuda:1")}
    shardsafe.load(tmp_path / "c", dest)
    assert torch.equal(dest["x"].cpu(), torch.full((2**20,), 5.0))
