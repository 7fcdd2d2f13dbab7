"""The replica server (manager/replica.py) against clients that are not the job's: a client that
connects and stalls, one that sends an endless line, one without the token; and where it listens.

A slow or silent client must not hold the server: a push of the job's own rank, started while it
stalls, completes within its deadline (before, the server read the stalled client's request a byte at
a time, one connection at a time, and the push waited for the server's whole socket timeout)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.deadline import Deadline
from shardsafe.manager import replica


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SHARDSAFE_TIER_SOCKET_SECONDS", "600")  # longer than any deadline below
    s = replica.ReplicaServer(str(tmp_path / "node"), 0, "127.0.0.1")
    yield s
    s.close()


META = {"step": 3, "rank": 1, "world_size": 2, "run": "0123456789abcdef", "save": "1700000000abcdef0123"}


def _share(tmp_path: Path) -> str:
    path = str(tmp_path / "share")
    shardsafe.save(path, {"w": torch.arange(8.0)}, metadata=META)
    return path


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _push(server: replica.ReplicaServer, share: str, seconds: float) -> None:
    """A push of the job's own rank, bounded by ``seconds``; raises what push raises."""
    replica.push(server.address, server.token, share, META, Deadline.after(seconds, "io"))


def test_a_stalled_client_does_not_hold_the_server(server: replica.ReplicaServer, tmp_path: Path) -> None:
    share = _share(tmp_path)
    stalled = [_connect(server.address) for _ in range(3)]
    try:
        for s in stalled:
            s.sendall(b"{")  # a request that never ends
        dripping = _connect(server.address)
        stop = threading.Event()

        def drip() -> None:  # one byte a second: every single receive succeeds, the request never ends
            while not stop.is_set():
                try:
                    dripping.sendall(b" ")
                except OSError:
                    return
                time.sleep(1)

        t = threading.Thread(target=drip, daemon=True)
        t.start()
        time.sleep(0.5)
        _push(server, share, 20)
        stop.set()
    finally:
        for s in stalled:
            s.close()


def _answer_after(server: replica.ReplicaServer, data: bytes) -> bytes:
    """Send ``data`` (a request that never ends its line), then read the server's answer."""
    s = _connect(server.address)
    s.settimeout(20)
    try:
        s.sendall(data)
        return s.recv(4096)
    finally:
        s.close()


def test_an_endless_request_line_is_cut_short(server: replica.ReplicaServer) -> None:
    """1 MiB of a line that never ends is refused at once, with or without the token (before, the server
    read on, a byte at a time, up to 4 MiB, and the client waited for an answer that never came)."""
    assert b'"ok": false' in _answer_after(server, b"x" * (1 << 20))
    answer = _answer_after(server, server.token.encode() + b"\n" + b"x" * (1 << 20))
    assert b'"ok": false' in answer and b"long" in answer, answer


def test_a_request_without_the_token_is_refused_before_its_line_is_read(server: replica.ReplicaServer) -> None:
    s = _connect(server.address)
    s.settimeout(20)
    s.sendall(b"0" * 32 + b"\n")  # a wrong token, then nothing: refused on the token alone
    answer = s.recv(4096)
    s.close()
    assert b"token" in answer and b'"ok": false' in answer, answer


def test_the_server_listens_on_the_jobs_interface_only(tmp_path: Path) -> None:
    s = replica.ReplicaServer(str(tmp_path / "node"), 0, "127.0.0.1")
    try:
        assert s._sock.getsockname()[0] == "127.0.0.1", s._sock.getsockname()
    finally:
        s.close()


def test_the_announced_address_follows_the_rendezvous_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``MASTER_ADDR`` (a ``tcp://`` init method, a store given to ``init_process_group``), the
    address is the one of the interface that routes to the store's host, found inside ``PrefixStore``\\ s
    (before, it was 127.0.0.1: other nodes could not reach it); ``SHARDSAFE_TIER_HOST`` decides first."""

    class Tcp:
        def __init__(self, host: str) -> None:
            self.host = host

    class Prefix:
        def __init__(self, under: object) -> None:
            self.underlying_store = under

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("SHARDSAFE_TIER_HOST", raising=False)
    assert replica.store_host(Prefix(Prefix(Tcp("10.1.2.3")))) == "10.1.2.3"
    assert replica.store_host(Prefix(None)) is None
    assert replica.own_host(Prefix(Tcp("127.0.0.1"))) == "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.1", 9))  # no packet is sent: the route's local address
            mine = s.getsockname()[0]
    except OSError:
        pytest.skip("this machine has no route off loopback")
    assert replica.own_host(Prefix(Prefix(Tcp("10.255.255.1")))) == mine
    monkeypatch.setenv("SHARDSAFE_TIER_HOST", "192.0.2.7")
    assert replica.own_host(Prefix(Tcp("10.255.255.1"))) == "192.0.2.7"
