"""The floors: what the disk and the memory bus allow for the same bytes, with no library in the way.

- ``write``: every rank writes its share of the state (replicated: 1/world of the bytes, as a library
  that deduplicates writes; sharded: its own shards) straight from tensor memory with large ``os.write``
  calls, then ``fdatasync``; ``write_dd`` is the same byte count written by one ``dd ... conv=fdatasync``.
- ``read``: every rank reads the bytes it needs (replicated: all of them; sharded: its own) into an
  existing buffer; ``read_dd`` is one ``dd`` reading the byte count once. Cold when the session is cold.
- ``copy_state`` / ``copy_share``: ``copy_`` of the rank's whole local state / of its share into an
  existing, pre-faulted buffer: the least an asynchronous save must block for.
- ``checksum``: xxh3-64 over the rank's share, in the pieces shardsafe hashes while writing.
"""

from __future__ import annotations

import os
import subprocess

import torch
import xxhash

from bench.contenders import Contender
from bench.measure import Ctx
from bench.state import BenchState

_PIECE = 16 << 20  # bytes per write()/read() call, as dd bs=16M
_HASH_PIECE = 8 << 20


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def share_views(state: BenchState, rank: int, world: int) -> list[torch.Tensor]:
    """uint8 views of the bytes this rank writes: its own shards (sharded), or its 1/world byte range of
    the state's tensors in a fixed order (replicated). The views share memory with the state."""
    tensors = [_bytes_of(t) for t in state.local_tensors().values()]
    if state.kind == "sharded":
        return tensors
    total = sum(t.numel() for t in tensors)
    lo, hi = rank * total // world, (rank + 1) * total // world
    out, offset = [], 0
    for t in tensors:
        a, b = max(lo, offset), min(hi, offset + t.numel())
        if a < b:
            out.append(t[a - offset : b - offset])
        offset += t.numel()
    return out


def _write(path: str, views: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for v in views:
            mv = v.numpy().data
            for i in range(0, len(mv), _PIECE):
                os.write(fd, mv[i : i + _PIECE])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _read_into(paths: list[str], buf: torch.Tensor) -> int:
    mv, offset = buf.numpy().data, 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(mv[offset : offset + _PIECE])
                if not n:
                    break
                offset += n
    return offset


def _dd(*args: str) -> None:
    subprocess.run(["dd", *args, "status=none"], check=True)


class Floors(Contender):
    name = "floor"

    def __init__(self, state: BenchState) -> None:
        super().__init__(state)
        self._buf: torch.Tensor | None = None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        # Allocated and faulted in once, so no measurement pays for fresh pages.
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.zeros(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]

    def rep(self, ctx: Ctx) -> None:
        st, rank, world = self.state, ctx.rank, ctx.world
        share = share_views(st, rank, world)
        local = [_bytes_of(t) for t in st.local_tensors().values()]
        need = st.global_bytes if st.kind == "replicated" else sum(v.numel() for v in share)
        buf = self._buffer(max(need, sum(v.numel() for v in local)))

        d = ctx.path("write")
        if rank == 0:
            os.makedirs(d)
        ctx.barrier()
        ctx.measure("write", lambda: _write(os.path.join(d, f"part-{rank}"), share), files=d)
        parts = [os.path.join(d, f"part-{r}") for r in range(world)] if st.kind == "replicated" else []
        mine = parts or [os.path.join(d, f"part-{rank}")]
        got = ctx.measure("read", lambda: _read_into(mine, buf), load=True)
        if got != need:
            raise AssertionError(f"floor read {got} bytes from {mine}, expected {need}")
        ctx.remove(d)

        f = ctx.path("dd")

        def write_dd() -> None:
            if rank == 0:
                _dd(
                    "if=/dev/zero",
                    f"of={f}",
                    "bs=16M",
                    f"count={st.global_bytes}",
                    "iflag=count_bytes",
                    "conv=fdatasync",
                )

        def read_dd() -> None:
            if rank == 0:
                _dd(f"if={f}", "of=/dev/null", "bs=16M")

        ctx.measure("write_dd", write_dd, files=f)
        ctx.measure("read_dd", read_dd, load=True)
        ctx.remove(f)

        def copy(views: list[torch.Tensor]) -> None:
            offset = 0
            for v in views:
                buf[offset : offset + v.numel()].copy_(v)
                offset += v.numel()

        ctx.measure("copy_state", lambda: copy(local))
        ctx.measure("copy_share", lambda: copy(share))

        def checksum() -> None:
            for v in share:
                mv = v.numpy().data
                for i in range(0, len(mv), _HASH_PIECE):
                    xxhash.xxh3_64_intdigest(mv[i : i + _HASH_PIECE])

        ctx.measure("checksum", checksum)
