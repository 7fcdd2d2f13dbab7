"""Replication of node-local shares between ranks over TCP sockets (docs/tiers.md, "Transport").

Every rank with a local tier runs one :class:`ReplicaServer` (a listening socket and one daemon thread);
its address travels to the other ranks in the local tier's agreements (through the rendezvous store,
never the training group). A connection carries one request, a JSON line, then raw file bytes:

- ``push``: the sender's committed share of a step (``files``: ``[relative name, size]``); the server
  answers whether it accepts the request, then, once accepted, the sender sends the bytes, and the server
  writes them into ``.incoming-...`` in its own node folder, verifies every byte
  (:func:`shardsafe.verify`), renames it to ``replica-of-rank-R`` (replacing an older copy) and answers
  ``{"ok": true}``; anything else answers ``{"ok": false, "error": ...}`` and leaves nothing behind;
- ``pull``: the server sends the replica of rank R's share of a step that it holds (an answer line
  with ``files``, then the bytes); the puller stores and verifies it the same way, as its own share.

Every request carries the server's token (32 random hex digits, made when the server starts and
published with its address through the rendezvous store, which only the job's ranks reach); a request
without it is refused before anything is read or written, so nothing else on the network can write
into a node folder, nor read a share out of it.

Every socket operation has a timeout (the remaining time of the caller's deadline, or
``SHARDSAFE_TIER_SOCKET_SECONDS`` on the server side); memory is bounded by one 1 MiB block per
connection. The server serves one connection at a time (with ``replicas=1`` each server has one
sender)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Callable
from typing import Any

from shardsafe import knobs
from shardsafe.deadline import Deadline
from shardsafe.engine import api
from shardsafe.errors import CheckpointError
from shardsafe.manager.tiers import remove_entry, replica_name, share_name, step_name

logger = logging.getLogger(__name__)

BLOCK = 1 << 20


def files_of(path: str) -> list[list[Any]]:
    """``[relative name, size]`` of every file of the committed checkpoint folder ``path``."""
    out: list[list[Any]] = []
    for base, _dirs, names in os.walk(path):
        for n in sorted(names):
            full = os.path.join(base, n)
            out.append([os.path.relpath(full, path), os.path.getsize(full)])
    return out


def _send_files(sock: socket.socket, path: str, files: list[list[Any]]) -> None:
    for rel, size in files:
        with open(os.path.join(path, rel), "rb") as f:
            left = size
            while left > 0:
                block = f.read(min(BLOCK, left))
                if not block:
                    raise CheckpointError(f"{os.path.join(path, rel)} shrank while it was sent")
                sock.sendall(block)
                left -= len(block)


def _read_line(sock: socket.socket, limit: int = 1 << 22) -> dict[str, Any]:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        part = sock.recv(1)
        if not part:
            raise CheckpointError("replica connection closed before its header ended")
        buf += part
        if len(buf) > limit:
            raise CheckpointError("replica header too long")
    doc = json.loads(buf.decode())
    if not isinstance(doc, dict):
        raise CheckpointError(f"replica header is not an object: {doc!r:.200}")
    return doc


def _send_line(sock: socket.socket, doc: dict[str, Any]) -> None:
    sock.sendall(json.dumps(doc).encode() + b"\n")


def receive_checkpoint(
    sock: socket.socket, folder: str, step: int, final_name: str, owner: int, files: list[list[Any]]
) -> str:
    """Write ``files`` read from ``sock`` into a fresh ``.incoming-`` folder of ``folder``/step, verify
    every byte, then rename it to ``final_name`` (replacing what is there). Returns the final path;
    on any failure nothing of the transfer remains."""
    where = os.path.join(folder, step_name(step))
    os.makedirs(where, exist_ok=True)
    kind = "replica-of-rank" if final_name.startswith("replica") else "rank"
    number = final_name.rsplit("-", 1)[1]
    tmp = os.path.join(where, f".incoming-{kind}-{number}-to-{owner:05d}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    try:
        for rel, size in files:
            if not isinstance(rel, str) or rel.startswith(("/", "..")) or ".." in rel.split(os.sep):
                raise CheckpointError(f"replica file name {rel!r} leaves its folder")
            if not isinstance(size, int) or size < 0:
                raise CheckpointError(f"replica file {rel!r} has size {size!r}")
            target = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                left = size
                while left > 0:
                    block = sock.recv(min(BLOCK, left))
                    if not block:
                        raise CheckpointError(f"replica connection closed in {rel!r} with {left} bytes to go")
                    f.write(block)
                    left -= len(block)
                f.flush()
                os.fsync(f.fileno())
        api.verify(tmp)  # every byte, against the manifest's checksums
        final = os.path.join(where, final_name)
        if os.path.lexists(final):
            remove_entry(final)
            os.makedirs(where, exist_ok=True)
        os.rename(tmp, final)
        fd = os.open(where, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ReplicaServer:
    """(each rank with a local tier) Receives replicas into ``folder`` and serves the ones it holds."""

    def __init__(self, folder: str, rank: int, host: str) -> None:
        self.folder = folder
        self.rank = rank
        self._sock = socket.create_server(("", 0))
        self._sock.settimeout(0.5)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.token = secrets.token_hex(16)  # what a request must carry (published with the address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"shardsafe-replica-{rank}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting and end the thread (it finishes the request it serves, within ``timeout``)."""
        self._stop.set()
        self._thread.join(timeout)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as err:
                if not self._stop.is_set():
                    logger.error("shardsafe: replica server of rank %d stopped: %s", self.rank, err)
                return
            with conn:
                conn.settimeout(knobs.tier_socket_seconds())
                try:
                    self._handle(conn)
                except Exception as err:  # answered to the peer when the connection still works; logged
                    logger.warning("shardsafe: replica request to rank %d failed: %s", self.rank, err)
                    try:
                        _send_line(conn, {"ok": False, "error": f"{type(err).__name__}: {err}"})
                    except OSError:
                        pass

    def _handle(self, conn: socket.socket) -> None:
        head = _read_line(conn)
        token = head.get("token")
        if not isinstance(token, str) or not secrets.compare_digest(token.encode(), self.token.encode()):
            raise CheckpointError(
                f"replica request to rank {self.rank} without this server's token refused (a request from outside "
                "the job, or from another job's rank)"
            )
        op, step, rank = head.get("op"), head.get("step"), head.get("rank")
        if not isinstance(step, int) or not isinstance(rank, int):
            raise CheckpointError(f"bad replica request {head!r:.200}")
        if op == "push":
            _send_line(conn, {"ok": True})  # accepted: the sender sends the bytes now
            receive_checkpoint(conn, self.folder, step, replica_name(rank), self.rank, head["files"])
            _send_line(conn, {"ok": True})
        elif op == "pull":
            path = os.path.join(self.folder, step_name(step), replica_name(rank))
            files = files_of(path) if os.path.isdir(path) else None
            if not files:
                raise CheckpointError(f"rank {self.rank} holds no replica of rank {rank}'s share of step {step}")
            _send_line(conn, {"ok": True, "files": files})
            _send_files(conn, path, files)
        else:
            raise CheckpointError(f"unknown replica request {op!r}")


def _connect(address: str, deadline: Deadline) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=max(deadline.remaining(), 0.001))
    return sock


def _bounded(address: str, what: str, deadline: Deadline, fn: Callable[[socket.socket], Any]) -> Any:
    try:
        with _connect(address, deadline) as sock:
            sock.settimeout(max(deadline.remaining(), 0.001))
            return fn(sock)
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"{what} with the replica server at {address} failed ({type(err).__name__}: {err}); is that rank "
            "alive and its node reachable? (deadline: the manager's timeout)"
        ) from err


def push(address: str, token: str, path: str, step: int, rank: int, deadline: Deadline) -> None:
    """(the sender) Send rank ``rank``'s committed share ``path`` of ``step`` to the server at
    ``address`` (whose ``token`` it carries); returns once the receiver verified and renamed it. Raises
    :class:`CheckpointError`."""
    files = files_of(path)

    def run(sock: socket.socket) -> None:
        _send_line(sock, {"op": "push", "token": token, "step": step, "rank": rank, "files": files})
        answer = _read_line(sock)  # the request accepted (or refused) before any byte is sent
        if answer.get("ok") is not True:
            raise CheckpointError(f"rank {rank}: replicating {path} was refused by the receiver: {answer.get('error')}")
        _send_files(sock, path, files)
        answer = _read_line(sock)
        if answer.get("ok") is not True:
            raise CheckpointError(f"rank {rank}: replicating {path} failed at the receiver: {answer.get('error')}")

    _bounded(address, f"rank {rank}: pushing the replica of {path}", deadline, run)


def pull(address: str, token: str, folder: str, step: int, rank: int, deadline: Deadline) -> str:
    """(rank ``rank``) Fetch the replica of its share of ``step`` from the server at ``address`` (whose
    ``token`` it carries) into its own ``folder`` as its share (every byte verified). Returns the
    share's path."""

    def run(sock: socket.socket) -> str:
        _send_line(sock, {"op": "pull", "token": token, "step": step, "rank": rank})
        answer = _read_line(sock)
        if answer.get("ok") is not True:
            raise CheckpointError(f"rank {rank}: fetching its share of step {step} failed: {answer.get('error')}")
        return receive_checkpoint(sock, folder, step, share_name(rank), rank, answer["files"])

    result: str = _bounded(address, f"rank {rank}: pulling its share of step {step}", deadline, run)
    return result


def own_host() -> str:
    """The address other nodes reach this one at: ``SHARDSAFE_TIER_HOST``, else the address of the
    interface that routes to ``MASTER_ADDR`` (no packet is sent), else 127.0.0.1."""
    given = os.environ.get("SHARDSAFE_TIER_HOST")
    if given:
        return given
    master = os.environ.get("MASTER_ADDR")
    if master and master not in ("localhost", "127.0.0.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
                return str(s.getsockname()[0])
        except OSError:
            pass
    return "127.0.0.1"
