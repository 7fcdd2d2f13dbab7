"""Replication of node-local shares between ranks over TCP sockets (docs/tiers.md, "Transport").

Every rank with a local tier runs one :class:`ReplicaServer` (a listening socket on the interface the
job's traffic uses, an accepting thread and a thread per connection); its address travels to the other
ranks in the local tier's agreements (through the rendezvous store, never the training group). A
connection carries one request: the server's token and a newline, a JSON line, then raw file bytes:

- ``push``: the sender's committed share of a save (``run``, ``step``, ``save``, ``rank``, its
  ``metadata``, ``files``: ``[name, size]``); the server answers whether it accepts the request, then,
  once accepted, the sender sends the bytes, and the server writes them into ``.incoming-...`` in the
  save's step folder of its own node folder, verifies every byte (:func:`shardsafe.verify`) and that the
  copy's metadata is the request's, renames it to ``replica-of-rank-R`` and answers ``{"ok": true}``;
  anything else answers ``{"ok": false, "error": ...}`` and leaves nothing behind;
- ``pull``: the server sends a copy it holds (``run``, ``step``, ``save`` and the entry's ``name``: a
  share or a replica, whichever rank 0's plan named), an answer line with ``files`` then the bytes; the
  puller stores and verifies it the same way, as its own share.

The token (32 random hex digits, made when the server starts and published with its address through
the rendezvous store, which only the job's ranks reach) comes first, in a fixed number of bytes: the
server compares it before it reads anything else, so a request without it is refused on its first 33
bytes, and nothing else on the network can write into a node folder, nor read a share out of it.

Nothing a client does holds the server: each connection is served on its own thread, and the token and
the request line (at most :data:`LINE_LIMIT` bytes) must arrive within ``SHARDSAFE_TIER_SOCKET_SECONDS``
in all, else the connection is dropped; at most :data:`HANDSHAKES` connections are read from before
their token checked (one more is closed at once). Once a request is accepted, every socket operation of
it is bounded by that knob (the server) or by the caller's deadline (the sender and the puller); memory
is bounded by one 1 MiB block per connection."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from shardsafe import knobs
from shardsafe.catalog.names import transfer_file
from shardsafe.catalog.publish import CopyPublication
from shardsafe.deadline import Deadline
from shardsafe.engine import api
from shardsafe.errors import CheckpointTimeoutError, InvalidArgumentError, LocalTierError, UnsafePathError
from shardsafe.manager.tiers import (
    REPLICA_RE,
    RUN_ID,
    SAVE_ID,
    SHARE_RE,
    real_dir,
    remove_entry,
    replica_name,
    share_name,
    step_folder,
)

logger = logging.getLogger(__name__)

BLOCK = 1 << 20
LINE_LIMIT = 1 << 16
"""The longest request or answer line read, in bytes (a share's file list fits many times over)."""
TOKEN_CHARS = 32
HANDSHAKES = 32
"""Connections a server reads a token from at once; more are closed as they come."""


class _Stream:
    """A connected socket read through a buffer: exact reads and bounded lines, every receive and send
    bounded by ``until`` (an absolute ``time.monotonic()``) and by ``each`` seconds."""

    def __init__(self, sock: socket.socket, until: float, each: float) -> None:
        self.sock = sock
        self.until = until
        self.each = each
        self.buf = bytearray()

    def _bound(self) -> None:
        left = self.until - time.monotonic()
        if left <= 0:
            raise CheckpointTimeoutError("the replica connection's deadline passed")
        self.sock.settimeout(min(left, self.each))

    def _recv(self, n: int) -> bytes:
        self._bound()
        part = self.sock.recv(n)
        if not part:
            raise LocalTierError("the replica connection was closed by the other side")
        return part

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self.buf += self._recv(n - len(self.buf))
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def line(self) -> dict[str, Any]:
        """The next JSON-object line, at most :data:`LINE_LIMIT` bytes."""
        while (end := self.buf.find(b"\n")) < 0:
            if len(self.buf) > LINE_LIMIT:
                raise LocalTierError(f"replica request line longer than {LINE_LIMIT} bytes refused")
            self.buf += self._recv(LINE_LIMIT + 1 - len(self.buf))
        if end > LINE_LIMIT:
            raise LocalTierError(f"replica request line longer than {LINE_LIMIT} bytes refused")
        raw = bytes(self.buf[:end])
        del self.buf[: end + 1]
        try:
            doc = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError) as err:
            raise LocalTierError(f"replica request line is not JSON ({err})") from None
        if not isinstance(doc, dict):
            raise LocalTierError(f"replica request line is not an object: {doc!r:.200}")
        return doc

    def into(self, f: BinaryIO, size: int, what: str) -> None:
        """Copy the next ``size`` bytes into ``f``."""
        left = size
        if self.buf:
            take = bytes(self.buf[:left])
            del self.buf[: len(take)]
            f.write(take)
            left -= len(take)
        while left > 0:
            self._bound()
            block = self.sock.recv(min(BLOCK, left))
            if not block:
                raise LocalTierError(f"replica connection closed in {what!r} with {left} bytes to go")
            f.write(block)
            left -= len(block)

    def send(self, data: bytes) -> None:
        self._bound()
        self.sock.sendall(data)

    def send_line(self, doc: dict[str, Any]) -> None:
        self.send(json.dumps(doc).encode() + b"\n")


def files_of(path: str) -> list[list[Any]]:
    """``[name, size]`` of every file of the committed checkpoint folder ``path``: plain regular files
    (a link, a FIFO, a folder in it raises :class:`CheckpointError`: a share holds none)."""
    out: list[list[Any]] = []
    for n in sorted(os.listdir(path)):
        st = os.lstat(os.path.join(path, n))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{os.path.join(path, n)} is not a regular file; a local-tier share holds only files")
        out.append([n, st.st_size])
    return out


def _open_file(path: str) -> int:
    """A read-only descriptor of the regular file ``path``, never through a link, never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file; a local-tier share holds only files")
    return fd


def _send_files(stream: _Stream, path: str, files: list[list[Any]]) -> None:
    for name, size in files:
        with os.fdopen(_open_file(os.path.join(path, name)), "rb") as f:
            left = size
            while left > 0:
                block = f.read(min(BLOCK, left))
                if not block:
                    raise LocalTierError(f"{os.path.join(path, name)} shrank while it was sent")
                stream.send(block)
                left -= len(block)


def _check_files(files: Any) -> list[tuple[str, int]]:
    """A request's ``files``: the names of a share's files (its manifest, data files: the catalog's grammar)
    with sizes; else :class:`CheckpointError`, before anything is written."""
    if not isinstance(files, list):
        raise LocalTierError(f"replica file list {files!r:.200} is not a list")
    out: list[tuple[str, int]] = []
    for item in files:
        if not (isinstance(item, list) and len(item) == 2):
            raise LocalTierError(f"replica file entry {item!r:.200} is not [name, size]")
        name, size = item
        if not transfer_file(name):
            raise LocalTierError(
                f"replica file name {name!r:.200} is not a file of a local-tier share (MANIFEST.json and data "
                "files only); nothing is written"
            )
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise LocalTierError(f"replica file {name!r} has size {size!r}")
        out.append((name, size))
    if len({n for n, _ in out}) != len(out):
        raise LocalTierError("replica file list names a file twice")
    return out


def receive_checkpoint(
    stream: _Stream, where: str, final_name: str, files: Any, expect: dict[str, Any], deadline: Deadline
) -> str:
    """Write ``files`` read from ``stream`` into a fresh ``.incoming-`` folder of the step folder ``where``
    through the publication transaction (:class:`~shardsafe.catalog.publish.CopyPublication`: its manifest
    under a temporary name until every file is in), verify every byte and that its metadata is ``expect``,
    then rename it to ``final_name`` (replacing a copy of this run there), the check by ``deadline`` (the
    puller's; on the server, ``SHARDSAFE_IO_TIMEOUT``, while the sender waits by its own). Returns the final
    path; on any failure nothing of the transfer remains (removed through the delete gate)."""
    listed = _check_files(files)
    if not real_dir(where):
        raise UnsafePathError(f"{where} is a symbolic link or not a folder; nothing is written through a link")
    copy = CopyPublication(where, final_name)
    copy.hide()
    try:
        for name, size in listed:
            f = copy.create(name)
            try:
                stream.into(f, size, name)
            except BaseException:
                f.close()
                raise
            copy.seal(f)
        api.verify(copy.hidden, timeout=max(deadline.remaining(), 0.001))  # every byte, against the checksums
        meta = api.inspect(copy.hidden).metadata
        if meta != expect:
            raise LocalTierError(f"the copy received in {copy.hidden} records {meta!r:.300}, not {expect!r:.300}")
        final = copy.final
        if os.path.lexists(final) and not remove_entry(final, str(expect.get("run"))):
            raise LocalTierError(f"{final} belongs to another run and stays; the copy cannot take its place")
        return copy.publish()
    except BaseException:
        _discard(copy)
        raise


def _discard(copy: CopyPublication) -> None:
    """Remove a transfer's own folder through the gate: the files it wrote there, then the folder (nothing
    recursive, nothing through a link). A failure is logged with the path: the transfer's error is raised."""
    try:
        if not copy.abandon():
            logger.error("shardsafe: the failed transfer's folder %s holds files it did not write; left", copy.hidden)
    except (OSError, ValueError) as err:
        logger.error(
            "shardsafe: could not remove the failed transfer's folder %s: %s; remove it by hand", copy.hidden, err
        )


class ReplicaServer:
    """(each rank with a local tier) Receives replicas into ``folder`` and serves the ones it holds,
    listening on ``host`` (the address it announces) only."""

    def __init__(self, folder: str, rank: int, host: str) -> None:
        self.folder = folder
        self.rank = rank
        try:
            self._sock = socket.create_server((host, 0))
        except OSError as err:
            raise InvalidArgumentError(
                f"rank {rank}: the local tier's replica server cannot listen on {host!r} ({err}); set "
                "SHARDSAFE_TIER_HOST to an address of this machine that the other nodes reach"
            ) from err
        self._sock.settimeout(0.5)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self.token = secrets.token_hex(TOKEN_CHARS // 2)  # what a request must carry (published with the address)
        self._stop = threading.Event()
        self._handshakes = threading.BoundedSemaphore(HANDSHAKES)
        self._lock = threading.Lock()
        self._live: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._serve, name=f"shardsafe-replica-{rank}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting and end the threads (each finishes the request it serves, within ``timeout``
        in all)."""
        until = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout)
        with self._lock:
            live = list(self._live)
        for t in live:
            t.join(max(0.0, until - time.monotonic()))
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
            if not self._handshakes.acquire(blocking=False):
                logger.warning(
                    "shardsafe: replica server of rank %d: %d connections are still to send their token; one "
                    "more is closed",
                    self.rank,
                    HANDSHAKES,
                )
                conn.close()
                continue
            t = threading.Thread(target=self._connection, args=(conn,), name=f"shardsafe-replica-{self.rank}-conn")
            t.daemon = True
            with self._lock:
                self._live.add(t)
            t.start()

    def _connection(self, conn: socket.socket) -> None:
        """One connection, on its own thread: the token and request line within the socket knob's
        seconds in all, then the request."""
        seconds = knobs.tier_socket_seconds()
        stream = _Stream(conn, time.monotonic() + seconds, seconds)
        held = [True]

        def authenticated() -> None:
            held[0] = False
            self._handshakes.release()
            stream.until = math.inf  # the job's own rank: each operation bounded by ``each``

        try:
            with conn:
                try:
                    self._handle(stream, authenticated)
                except Exception as err:  # answered to the peer when the connection still works; logged
                    logger.warning("shardsafe: replica request to rank %d failed: %s", self.rank, err)
                    try:
                        stream.until = time.monotonic() + min(seconds, 5.0)
                        stream.send_line({"ok": False, "error": f"{type(err).__name__}: {err}"})
                    except OSError:
                        pass
        finally:
            if held[0]:
                self._handshakes.release()
            with self._lock:
                self._live.discard(threading.current_thread())

    def _handle(self, stream: _Stream, authenticated: Callable[[], None]) -> None:
        token = stream.exact(TOKEN_CHARS + 1)
        if token[-1:] != b"\n" or not secrets.compare_digest(token[:-1], self.token.encode()):
            raise LocalTierError(
                f"replica request to rank {self.rank} without this server's token refused (a request from outside "
                "the job, or from another job's rank)"
            )
        authenticated()
        head = stream.line()
        op, run, step, save = head.get("op"), head.get("run"), head.get("step"), head.get("save")
        if not (
            isinstance(run, str)
            and RUN_ID.match(run)
            and isinstance(step, int)
            and not isinstance(step, bool)
            and 0 <= step < 10**12
            and isinstance(save, str)
            and SAVE_ID.match(save)
        ):
            raise LocalTierError(f"bad replica request {head!r:.200}")
        if op == "push":
            rank, meta = head.get("rank"), head.get("metadata")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 10**6:
                raise LocalTierError(f"bad replica request {head!r:.200}")
            want = {"step": step, "rank": rank, "run": run, "save": save}
            if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in want.items()):
                raise LocalTierError(f"replica request's metadata {meta!r:.200} is not its share's {want!r}")
            _check_files(head.get("files"))
            where = step_folder(self.folder, run, step, save, create=True)
            stream.send_line({"ok": True})  # accepted: the sender sends the bytes now
            deadline = Deadline.after(knobs.io_timeout(), "io")  # the check of the copy: as a verify's default
            receive_checkpoint(stream, where, replica_name(rank), head["files"], meta, deadline)
            stream.send_line({"ok": True})
        elif op == "pull":
            name = head.get("name")
            if not isinstance(name, str) or not (SHARE_RE.match(name) or REPLICA_RE.match(name)):
                raise LocalTierError(f"bad replica request {head!r:.200}")
            path = os.path.join(step_folder(self.folder, run, step, save), name)
            files = files_of(path) if real_dir(path) and os.path.lexists(os.path.join(path, "MANIFEST.json")) else None
            if not files:
                raise LocalTierError(f"rank {self.rank} holds no committed copy at {path}")
            stream.send_line({"ok": True, "files": files})
            _send_files(stream, path, files)
        else:
            raise LocalTierError(f"unknown replica request {op!r}")


def _bounded(address: str, token: str, what: str, deadline: Deadline, fn: Callable[[_Stream], Any]) -> Any:
    """Connect to ``address``, send ``token``, run ``fn`` on the connection, all before ``deadline``."""
    try:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=max(deadline.remaining(), 0.001)) as sock:
            stream = _Stream(sock, time.monotonic() + deadline.remaining(), math.inf)
            stream.send(token.encode()[:TOKEN_CHARS].ljust(TOKEN_CHARS, b"0") + b"\n")
            return fn(stream)
    except (OSError, ValueError) as err:
        raise (CheckpointTimeoutError if isinstance(err, TimeoutError) else LocalTierError)(
            f"{what} with the replica server at {address} failed ({type(err).__name__}: {err}); is that rank "
            "alive and its node reachable? (deadline: the manager's timeout)"
        ) from err


def push(address: str, token: str, path: str, meta: dict[str, Any], deadline: Deadline) -> None:
    """(the sender) Send its committed share ``path``, whose metadata is ``meta`` (run, step, save,
    rank...), to the server at ``address`` (whose ``token`` it carries); returns once the receiver
    verified and renamed it. Raises :class:`CheckpointError`."""
    files = files_of(path)
    rank = meta["rank"]
    head = {"op": "push", "run": meta["run"], "step": meta["step"], "save": meta["save"], "rank": rank}

    def run(stream: _Stream) -> None:
        stream.send_line({**head, "metadata": meta, "files": files})
        answer = stream.line()  # the request accepted (or refused) before any byte is sent
        if answer.get("ok") is not True:
            raise LocalTierError(f"rank {rank}: replicating {path} was refused by the receiver: {answer.get('error')}")
        _send_files(stream, path, files)
        answer = stream.line()
        if answer.get("ok") is not True:
            raise LocalTierError(f"rank {rank}: replicating {path} failed at the receiver: {answer.get('error')}")

    _bounded(address, token, f"rank {rank}: pushing the replica of {path}", deadline, run)


def pull(address: str, token: str, name: str, where: str, meta: dict[str, Any], deadline: Deadline) -> str:
    """(rank ``meta["rank"]``) Fetch the copy ``name`` (a share or a replica) of its share of save
    ``meta["save"]`` from the server at ``address`` (whose ``token`` it carries) into its own step folder
    ``where``, as its share (every byte verified, and its metadata ``meta``). Returns the share's path."""
    rank, step = meta["rank"], meta["step"]
    head = {"op": "pull", "run": meta["run"], "step": step, "save": meta["save"], "name": name}

    def run(stream: _Stream) -> str:
        stream.send_line(head)
        answer = stream.line()
        if answer.get("ok") is not True:
            raise LocalTierError(f"rank {rank}: fetching its share of step {step} failed: {answer.get('error')}")
        return receive_checkpoint(stream, where, share_name(rank), answer.get("files"), meta, deadline)

    result: str = _bounded(address, token, f"rank {rank}: pulling its share of step {step}", deadline, run)
    return result


def store_host(store: Any) -> str | None:
    """The host of the rendezvous store ``store`` (a ``TCPStore``, maybe inside ``PrefixStore``\\ s), else
    ``None``."""
    for _ in range(8):
        if store is None:
            return None
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return None


def own_host(store: Any = None) -> str:
    """The address other nodes reach this one at, where its replica server listens: ``SHARDSAFE_TIER_HOST``,
    else the address of the interface that routes to the rendezvous store's host (``store``), else to
    ``MASTER_ADDR`` (no packet is sent), else 127.0.0.1 (a store on this machine: one node)."""
    given = os.environ.get("SHARDSAFE_TIER_HOST")
    if given:
        return given
    for target, port in ((store_host(store), 29500), (os.environ.get("MASTER_ADDR"), 29500)):
        if target and target not in ("localhost", "127.0.0.1", "::1"):
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((target, int(os.environ.get("MASTER_PORT", port))))
                    return str(s.getsockname()[0])
            except (OSError, ValueError):
                continue
    return "127.0.0.1"
