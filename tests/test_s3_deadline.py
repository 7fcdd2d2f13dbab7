"""S3 calls bounded by the operation's deadline: a black-holed endpoint (127.0.0.1, a listening socket
that accepts connections and never answers) makes ``save`` fail within ``timeout`` + 15 s, instead of
waiting out botocore's own timeouts and retries (minutes)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

import shardsafe

pytest.importorskip("s3fs", reason="s3fs is needed for the S3 tests (requirements-dev.txt)")

SLACK = 15.0
"""The bound the issue promises: a call ends within its timeout plus this (a deadline property, not a
timing benchmark; the bound is generous)."""


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An endpoint URL whose TCP connects succeed (the kernel's backlog) and whose requests are never
    answered."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _opts(endpoint: str) -> dict[str, object]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def test_save_to_a_black_holed_endpoint_fails_within_its_timeout(black_hole: str) -> None:
    timeout = 3.0
    start = time.monotonic()
    with pytest.raises(shardsafe.CheckpointError):
        shardsafe.save(
            "s3://bucket/run/step-1", {"w": torch.ones(4)}, storage_options=_opts(black_hole), timeout=timeout
        )
    elapsed = time.monotonic() - start
    assert elapsed < timeout + SLACK, f"save took {elapsed:.1f}s with timeout={timeout}"


def test_load_from_a_black_holed_endpoint_fails_within_its_timeout(black_hole: str) -> None:
    timeout = 3.0
    start = time.monotonic()
    with pytest.raises(shardsafe.CheckpointError):
        shardsafe.load(
            "s3://bucket/run/step-1", {"w": torch.ones(4)}, storage_options=_opts(black_hole), timeout=timeout
        )
    elapsed = time.monotonic() - start
    assert elapsed < timeout + SLACK, f"load took {elapsed:.1f}s with timeout={timeout}"
