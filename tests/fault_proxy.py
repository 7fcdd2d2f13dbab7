"""A fault-injecting HTTP proxy between an S3 client (s3fs/aiobotocore) and the moto server: the
hostile network of the object-storage tests.

It listens on ``127.0.0.1`` (port 0: the OS picks), reads each HTTP/1.1 request whole (a
``Content-Length`` body, or a chunked one relayed as it came; ``Expect: 100-continue`` is answered
here), and by the first :class:`Rule` that matches its method and path it:

- ``pass``: forwards it and relays the reply (no rule matched does the same);
- ``hold``: keeps it and never answers; :meth:`FaultProxy.release` delivers it to the server later
  (after the client timed out and did something else), exactly as it was sent;
- ``delay``: forwards it ``seconds`` later, and relays the reply if the client is still there;
- ``duplicate``: forwards it twice and relays the reply to ``reply`` (``"first"`` or ``"second"``);
- ``after``: holds it until a request matching ``trigger`` has been carried out, then forwards it
  (a reordering: B reaches the server before A, though A was sent first);
- ``lose``: forwards it, then closes the client's connection without a reply;
- ``error``: answers an S3 error (``status``, ``code``; by default ``500 InternalError``) without
  forwarding;
- ``forward_error``: forwards it, then answers such an error instead of the server's reply (what a
  store answers the later copy of a request it carried out already: ``404 NoSuchUpload`` to a
  repeated multipart completion);
- ``blackhole``: reads it and never answers, nor closes (until the proxy stops);
- ``strip``: forwards it without the headers named in ``headers`` (case-insensitive) and relays the
  reply: a store that ignores them (``If-Match``, ``If-None-Match``: one without conditional writes).

A rule acts on ``times`` matching requests (``None``: all) after ``skip`` ones, and, with ``window``,
only within that many seconds of its first action; with ``spread``, once it acted, on every request.
Every reply closes the connection (``Connection: close``), so the client never reuses one the proxy
is about to drop.

:class:`FaultProxy` runs its event loop on a daemon thread, stops in :meth:`stop` (the fixture's
teardown) and at the latest after ``lifetime`` seconds; every wait in it has a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import threading
import time
from dataclasses import dataclass, field
from typing import Any

ACTIONS = frozenset(
    {"pass", "hold", "delay", "duplicate", "after", "lose", "error", "forward_error", "blackhole", "strip"}
)
UPSTREAM_TIMEOUT = 30.0
"""Seconds a forwarded request may take at the server (it is on the loopback interface)."""
HEAD_LIMIT = 64 * 1024

_REASONS = {
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


@dataclass
class Rule:
    """Which requests to hit (``method``: exact or ``*``; ``path``: a glob on the path without its
    query; ``query``: a substring the query must hold; ``body``: bytes the body must hold) and what to
    do (see the module docstring)."""

    action: str
    method: str = "*"
    path: str = "*"
    query: str | None = None
    body: bytes | None = None
    times: int | None = 1
    skip: int = 0
    window: float | None = None
    seconds: float = 0.0
    """``delay``: how long the request is held before it is forwarded."""
    status: int = 500
    """``error``, ``forward_error``: the HTTP status answered."""
    code: str = "InternalError"
    """``error``, ``forward_error``: the S3 error code answered."""
    reply: str = "first"
    """``duplicate``: which of the two replies the client gets."""
    trigger: Rule | None = None
    """``after``: the request that must be carried out first (matched as a rule is; its action unused)."""
    max_hold: float = 60.0
    """``after``: forwarded anyway once held this long."""
    headers: tuple[str, ...] = ()
    """``strip``: the request headers removed before it is forwarded."""
    spread: bool = False
    """Once this rule acted, it acts on every later request, whatever its method and path (an
    endpoint that goes dark mid-save)."""
    seen: int = 0
    acted: int = 0
    first_at: float | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; one of {sorted(ACTIONS)}")
        if self.action == "after" and self.trigger is None:
            raise ValueError("an 'after' rule needs trigger=Rule(...)")

    def matches(self, method: str, target: str) -> bool:
        path, _, query = target.partition("?")
        return (
            (self.method == "*" or self.method == method)
            and fnmatch.fnmatchcase(path, self.path)
            and (self.query is None or self.query in query)
        )

    def take(self, method: str, target: str, now: float, body: bytes = b"") -> bool:
        """Whether this rule acts on this request (counting it)."""
        if not self.matches(method, target) or (self.body is not None and self.body not in body):
            return False
        self.seen += 1
        if self.seen <= self.skip:
            return False
        if self.times is not None and self.acted >= self.times:
            return False
        if self.window is not None and self.first_at is not None and now - self.first_at > self.window:
            return False
        if self.first_at is None:
            self.first_at = now
        self.acted += 1
        return True


@dataclass
class Request:
    """One request as the client sent it (``head`` + ``body``, relayed unchanged but for the
    ``Connection`` and ``Expect`` headers)."""

    method: str
    target: str
    head: bytes
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    def raw(self) -> bytes:
        return self.head + self.body


@dataclass
class Reply:
    status: int
    raw: bytes


class FaultProxy:
    """See the module docstring. ``with FaultProxy(port) as proxy: proxy.endpoint_url``."""

    def __init__(self, upstream_port: int, *, upstream_host: str = "127.0.0.1", lifetime: float = 600.0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.lifetime = lifetime
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str]] = []
        """``(method, target, action)`` of every request, in the order they arrived."""
        self.held: list[Request] = []
        """Requests a ``hold`` rule kept, for :meth:`release`."""
        self.port = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._waiting: list[tuple[Rule, asyncio.Future[None]]] = []
        self._clients: set[asyncio.StreamWriter] = set()

    # -- control (from the test's thread) -------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, action: str, method: str = "*", path: str = "*", **kw: Any) -> Rule:
        """Add a rule (after the ones there already: the first match wins); returns it."""
        rule = Rule(action, method, path, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule: from now on every request passes."""
        with self._lock:
            self.rules.clear()

    def requests(self, method: str = "*", path: str = "*") -> list[tuple[str, str, str]]:
        """The logged requests matching ``method`` and ``path`` (as a rule matches)."""
        probe = Rule("pass", method, path)
        with self._lock:
            return [entry for entry in self.log if probe.matches(entry[0], entry[1])]

    def release(self, request: Request, timeout: float = UPSTREAM_TIMEOUT) -> Reply:
        """Deliver a held request to the server now (its client has long given up); the reply."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._forward(request), self._loop)
        return future.result(timeout + 5.0)

    def start(self) -> FaultProxy:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
                self.port = self._server.sockets[0].getsockname()[1]
                loop.call_later(self.lifetime, loop.stop)
            except BaseException as err:
                errors.append(err)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                self._shutdown(loop)

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10.0) or errors:
            raise RuntimeError(f"the fault proxy did not start: {errors}")
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10.0)
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the event loop -------------------------------------------------------------------------

    def _shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._clients):
            w.transport.abort()
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0))
        loop.close()

    def _rule_for(self, method: str, target: str, body: bytes) -> Rule | None:
        now = time.monotonic()
        with self._lock:
            for rule in self.rules:
                if rule.spread and rule.acted:
                    rule.acted += 1
                    return rule
            for rule in self.rules:
                if rule.take(method, target, now, body):
                    return rule
        return None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            request = await self._read_request(reader, writer)
            if request is None:
                return
            rule = self._rule_for(request.method, request.target, request.body)
            action = "pass" if rule is None else rule.action
            with self._lock:
                self.log.append((request.method, request.target, action))
            reply = await self._act(rule, request, reader)
            if reply is not None:
                writer.write(reply.raw)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away: what it sent (if anything) was handled or dropped
        finally:
            self._clients.discard(writer)
            writer.close()

    async def _act(self, rule: Rule | None, request: Request, reader: asyncio.StreamReader) -> Reply | None:
        if rule is None or rule.action == "pass":
            reply = await self._forward(request)
            self._carried_out(request)
            return reply
        if rule.action == "error":
            return _error_reply(rule.status, rule.code)
        if rule.action == "strip":
            drop = {h.lower() for h in rule.headers}
            lines = request.head.decode("latin-1").split("\r\n")
            kept = [ln for ln in lines if ln.partition(":")[0].strip().lower() not in drop]
            stripped = Request(request.method, request.target, "\r\n".join(kept).encode("latin-1"), request.body)
            reply = await self._forward(stripped)
            self._carried_out(request)
            return reply
        if rule.action == "forward_error":
            await self._forward(request)
            self._carried_out(request)
            return _error_reply(rule.status, rule.code)
        if rule.action == "lose":
            await self._forward(request)
            self._carried_out(request)
            return None
        if rule.action == "duplicate":
            first = await self._forward(request)
            self._carried_out(request)
            second = await self._forward(request)
            return first if rule.reply == "first" else second
        if rule.action == "delay":
            await asyncio.sleep(rule.seconds)
            reply = await self._forward(request)
            self._carried_out(request)
            return reply
        if rule.action == "after":
            assert rule.trigger is not None
            gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((rule.trigger, gate))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(gate), rule.max_hold)
            reply = await self._forward(request)
            self._carried_out(request)
            return reply
        if rule.action == "hold":
            with self._lock:
                self.held.append(request)
        # hold, blackhole: never answer; wait until the client gives up (or the proxy stops)
        await _until_closed(reader)
        return None

    def _carried_out(self, request: Request) -> None:
        """A request reached the server: release the ``after`` requests waiting for one like it."""
        for trigger, gate in list(self._waiting):
            if trigger.matches(request.method, request.target) and not gate.done():
                gate.set_result(None)
                self._waiting.remove((trigger, gate))

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        if len(head) > HEAD_LIMIT:
            raise ConnectionError("request head too large")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        kept: list[str] = [lines[0]]
        for line in lines[1:]:
            if not line:
                continue
            name, _, value = line.partition(":")
            key = name.strip().lower()
            headers[key] = value.strip()
            if key in ("connection", "expect", "keep-alive"):
                continue
            kept.append(line)
        kept.append("Connection: close")
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await _read_chunked(reader)
        else:
            body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
        raw_head = ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1")
        return Request(method, target, raw_head, body, headers)

    async def _forward(self, request: Request) -> Reply:
        """Send ``request`` to the server on a connection of its own; its whole reply (the server
        closes the connection after it: the request says ``Connection: close``)."""

        async def exchange() -> bytes:
            reader, writer = await asyncio.open_connection(*self.upstream)
            try:
                writer.write(request.raw())
                await writer.drain()
                return await reader.read()
            finally:
                writer.close()

        raw = await asyncio.wait_for(exchange(), UPSTREAM_TIMEOUT)
        return _relayable(raw)


def _relayable(raw: bytes) -> Reply:
    """The server's reply with ``Connection: close`` (the proxy closes every client connection)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1]) if lines and lines[0].startswith("HTTP/") else 502
    kept = [ln for ln in lines if ln.partition(":")[0].strip().lower() not in ("connection", "keep-alive")]
    kept.append("Connection: close")
    return Reply(status, ("\r\n".join(kept)).encode("latin-1") + sep + body)


def _error_reply(status: int, code: str) -> Reply:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected by the fault '
        "proxy</Message><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: fault-proxy\r\nConnection: close\r\n\r\n"
    )
    return Reply(status, head.encode("latin-1") + body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body (aws-chunked included), relayed as it came: the chunks, the last one, trailers."""
    out = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        out += line
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            break
        out += await reader.readexactly(size + 2)
    while True:  # trailers, up to the empty line
        line = await reader.readuntil(b"\r\n")
        out += line
        if line == b"\r\n":
            return bytes(out)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Wait until the client closes its side (it timed out), reading nothing it might still send."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while await reader.read(65536):
            pass
