"""The only path to the rendezvous store: shardsafe's own connections, every request bounded.

A store request can hang: a ``TCPStore`` client waits for the answer with no bound but the socket's,
and when the store's host is frozen (SIGSTOP, a swapping node) or a network path black-holes, that is
forever. So every request runs on a :class:`~shardsafe.workers.Lane` and the caller waits only until
the request's deadline; a quick request (anything but a wait for a key to appear) that gets no answer
within ``SHARDSAFE_DEAD_AFTER`` seconds means the store is lost (:class:`RankDeadError` with
``store_lost``). A frozen store host is then noticed within the operation's deadline plus
``SHARDSAFE_ERROR_REPORT_SECONDS``, and no thread of shardsafe keeps the process from exiting.

Connections (one :class:`StoreClient` per process and store, made on first use): shardsafe never
shares the process group's client, whose lock a user's or NCCL's blocking ``get`` may hold for minutes
(once per process it asks it for the namespace of its keys, see :meth:`StoreClient._open`). It opens
two clients of its own to the ``TCPStore`` behind it (through any ``PrefixStore``\\ s): ``quick`` for
requests the store answers at once (``set``, ``add``, ``append``, ``compare_set``, ``check``, and
``get`` of a key known to exist) and ``waits`` for requests that block until a key appears. Any other
store (``FileStore``, ``HashStore``) is used as it is.

Requests that need no answer (``set``, ``append``, ``delete``) are *posted*: queued on the lane, in
order with the requests after them, and not waited for. :class:`Tally` counts requests per operation
(docs/architecture.md quotes the counts; a test keeps them)."""

from __future__ import annotations

import atexit
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from shardsafe import knobs
from shardsafe.deadline import Deadline
from shardsafe.errors import CheckpointError, ClosedError, RankDeadError
from shardsafe.workers import Lane, expired, shut_down, wait_for

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Tally:
    """Requests one operation made, by kind: ``waited`` (the caller waits for the answer) and
    ``posted`` (queued, not waited for)."""

    def __init__(self) -> None:
        self.waited: Counter[str] = Counter()
        self.posted: Counter[str] = Counter()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"waited": dict(self.waited), "posted": dict(self.posted)}


def _tcp_address(store: Store) -> tuple[str, int] | None:
    """Host and port of the ``TCPStore`` under ``store`` (through any ``PrefixStore``\\ s), else None."""
    inner: Any = store
    for _ in range(64):  # a chain of prefixes is short; a bound rather than trusting the loop
        if isinstance(inner, PrefixStore):
            inner = inner.underlying_store
            continue
        break
    if isinstance(inner, TCPStore):
        return str(inner.host), int(inner.port)
    return None


NAMESPACE_KEY = "shardsafe/namespace"


def _connect(address: tuple[str, int], namespace: str) -> Store:
    """A new client of the ``TCPStore`` at ``address``, its keys under ``shardsafe/<namespace>/``."""
    raw = TCPStore(address[0], address[1], is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300))
    return PrefixStore(f"shardsafe/{namespace}", raw)


class _Connection:
    """One client of the store and the lane its requests run on."""

    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.lane = Lane(name)


class StoreClient:
    """(per process and store) Bounded requests to the store; see the module docstring.

    Its lanes (the threads requests run on) live only while some call of this process uses the client:
    an operation calls :meth:`acquire` when it begins and :meth:`release` when it ends, and the last
    release waits for the posted requests and ends the lanes. The connections themselves (no thread) are
    kept for the next call."""

    def __init__(self, shared: Store, where: str, address: tuple[str, int] | None = None) -> None:
        self.where = where
        self._shared = shared
        self._address = address
        self._namespace: str | None = None
        self._lock = threading.Lock()
        self._quick: _Connection | None = None
        self._waits: _Connection | None = None
        self._idle: dict[str, Store] = {}  # connections kept between calls, by lane ("quick", "waits")
        self._users = 0
        self.lost: RankDeadError | None = None
        """Set when a quick request got no answer within ``SHARDSAFE_DEAD_AFTER``: every request of the
        operations in progress fails at once after that (:meth:`reset` clears it for the next one)."""

    # ------------------------------------------------------------------------------ connections

    def _connection(self, which: str, deadline: Deadline) -> _Connection:
        with self._lock:
            conn = self._quick if which == "quick" else self._waits
            if conn is not None and not conn.lane.wedged:
                return conn
            if conn is not None:
                conn.lane.close()
            kept = self._idle.pop(which, None) if conn is None else None
        if kept is not None:
            fresh = _Connection(kept, f"store-{which}")
        else:
            fresh = _Connection(self._connect(which, deadline), f"store-{which}")
        with self._lock:
            if which == "quick":
                self._quick = fresh
            else:
                self._waits = fresh
        return fresh

    def _connect(self, which: str, deadline: Deadline) -> Store:
        # Connecting is a request too (a frozen host accepts nothing): bounded like one.
        lane = Lane(f"store-connect-{which}")
        try:
            return lane.call(
                "connecting to the rendezvous store",
                self.where,
                self._open,
                deadline.within(knobs.dead_after(), "store"),
                on_expiry=lambda: self._lost_error("connecting to it", knobs.dead_after()),
            )
        except (RankDeadError, ClosedError):
            raise
        except Exception as err:
            raise RankDeadError(
                f"could not connect to the rendezvous store {self.where} ({type(err).__name__}: {err}). The process "
                "hosting it (rank 0 or the launcher) has most likely died; restart the job, it resumes from the last "
                "committed checkpoint.",
                store_lost=True,
            ) from err
        finally:
            lane.close()

    def _open(self) -> Store:
        """(a lane) A new client of the store: for a ``TCPStore``, a connection of its own to the same host
        and port, its keys under a namespace all ranks of this rendezvous share (agreed once through the
        process group's client: one ``compare_set``, so a restarted job, whose launcher prefixes its keys
        anew, gets a new one). ``Store.clone`` would keep the prefixes, but when many ranks clone at once
        some wait seconds for it; a plain client connects at once. Any other store is used as it is."""
        if self._address is None:
            return self._shared
        if self._namespace is None:
            mine = uuid.uuid4().hex[:16]
            self._namespace = self._shared.compare_set(NAMESPACE_KEY, "", mine).decode()
        return _connect(self._address, self._namespace)

    def reset(self) -> None:
        """(an operation starting) Forget that the store was lost: try it again."""
        self.lost = None

    def acquire(self) -> None:
        """(a call starting to use the client: an operation's begin) Keep the lanes until the matching
        :meth:`release`."""
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """(the call that acquired the client, as it ends) The last release waits for the posted requests
        (at most ``SHARDSAFE_ERROR_REPORT_SECONDS``) and ends the lanes; the connections are kept for the
        next call, unless a request is stuck on them."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users:
                return
        self.close(Deadline.after(knobs.error_report_seconds(), "report"))

    @contextmanager
    def session(self) -> Iterator[StoreClient]:
        """:meth:`acquire` for the ``with`` body, :meth:`release` after it."""
        self.acquire()
        try:
            yield self
        finally:
            self.release()

    def close(self, drain: Deadline | None = None) -> None:
        """End the lanes (waiting for their posted requests until ``drain``); keep the connections that
        nothing is stuck on."""
        with self._lock:
            conns = [(w, c) for w, c in (("quick", self._quick), ("waits", self._waits)) if c is not None]
            self._quick = self._waits = None
        for which, conn in conns:
            conn.lane.close(drain)
            if not conn.lane.wedged:
                with self._lock:
                    self._idle.setdefault(which, conn.store)

    # ---------------------------------------------------------------------------------- requests

    def _lost_error(self, what: str, seconds: float) -> RankDeadError:
        return RankDeadError(
            f"the rendezvous store {self.where} did not answer {what} within {seconds:.0f}s: the process hosting it "
            "(rank 0 or the launcher) is frozen, overloaded or gone, or the network to it is down. Restart the job; "
            "it resumes from the last committed checkpoint.",
            store_lost=True,
        )

    def _gone(self, what: str, err: BaseException) -> RankDeadError:
        return RankDeadError(
            f"lost the rendezvous store {self.where} during {what} ({type(err).__name__}: {err}). The process "
            "hosting it (rank 0 or the launcher) has most likely died; restart the job, it resumes from the last "
            "committed checkpoint.",
            store_lost=True,
        )

    def _quick_call(
        self,
        what: str,
        fn: Callable[[Store], T],
        deadline: Deadline,
        tally: Tally | None,
        reword: Callable[[RankDeadError], RankDeadError] | None = None,
    ) -> T:
        if self.lost is not None:
            raise self.lost
        if tally is not None:
            tally.waited[what.split(" ", 1)[0]] += 1
        bound = deadline.or_grace().within(knobs.dead_after(), "store")
        conn = self._connection("quick", bound)

        def expiry() -> CheckpointError:
            if bound.budget == "report":  # past the caller's deadline, no answer in the whole grace to report:
                err = self._lost_error(what, bound.seconds)  # lost for the rest of this operation, so that
                self.lost = err if reword is None else reword(err)  # the error path gets one grace, not one
                return self.lost  # per request (a frozen host ends a call within timeout + the grace)
            if bound.budget != "store":  # the caller's own deadline came first: that is all we know
                return expired(what, self.where, bound)
            err = self._lost_error(what, bound.seconds)
            self.lost = err if reword is None else reword(err)
            return self.lost

        try:
            return conn.lane.call(what, self.where, lambda: fn(conn.store), bound, on_expiry=expiry)
        except (RuntimeError, OSError) as err:
            if isinstance(err, CheckpointError):
                raise
            gone = self._gone(what, err)
            if reword is not None:
                gone = reword(gone)
                self.lost = gone
            raise gone from err

    def _post(self, what: str, fn: Callable[[Store], object], deadline: Deadline, tally: Tally | None) -> None:
        if self.lost is not None:
            raise self.lost
        if tally is not None:
            tally.posted[what.split(" ", 1)[0]] += 1
        conn = self._connection("quick", deadline.or_grace())

        def run() -> None:
            try:
                fn(conn.store)
            except Exception as err:  # the next waited request on this lane meets the same store and raises
                logger.debug("shardsafe: store request %s failed: %s", what, err)

        conn.lane.post(run)

    def set(self, key: str, value: str, deadline: Deadline, tally: Tally | None = None) -> None:
        """Posted: ``key`` = ``value``."""
        self._post(f"set {key}", lambda s: s.set(key, value), deadline, tally)

    def append(self, key: str, value: str, deadline: Deadline, tally: Tally | None = None) -> None:
        """Posted: ``value`` appended to ``key``."""
        self._post(f"append {key}", lambda s: s.append(key, value), deadline, tally)  # type: ignore[attr-defined]

    def post_add(self, key: str, deadline: Deadline, tally: Tally | None = None) -> None:
        """Posted: ``key`` incremented by one (a tick nobody waits for)."""
        self._post(f"add {key}", lambda s: s.add(key, 1), deadline, tally)

    def delete(self, key: str, deadline: Deadline, tally: Tally | None = None) -> None:
        """Posted: ``key`` deleted."""
        self._post(f"delete {key}", lambda s: s.delete_key(key), deadline, tally)

    def add(
        self,
        key: str,
        n: int,
        deadline: Deadline,
        tally: Tally | None = None,
        reword: Callable[[RankDeadError], RankDeadError] | None = None,
    ) -> int:
        """``key`` incremented by ``n``; its new value. ``reword``: the error that marks the store lost,
        if this request finds it so (the heartbeat's own wording)."""
        return int(self._quick_call(f"add {key}", lambda s: s.add(key, n), deadline, tally, reword))

    def compare_set(self, key: str, value: str, deadline: Deadline, tally: Tally | None = None) -> str:
        """Set ``key`` to ``value`` unless it is set already; the value it holds now."""
        raw: bytes = self._quick_call(f"compare_set {key}", lambda s: s.compare_set(key, "", value), deadline, tally)
        return raw.decode()

    def check(self, keys: list[str], deadline: Deadline, tally: Tally | None = None) -> bool:
        """Whether every key in ``keys`` is set."""
        return bool(self._quick_call(f"check {keys[0]}", lambda s: s.check(keys), deadline, tally))

    def get(self, key: str, deadline: Deadline, tally: Tally | None = None) -> str:
        """The value of ``key``, which must be set already (else this waits like :meth:`wait_value`)."""
        raw: bytes = self._quick_call(f"get {key}", lambda s: s.get(key), deadline, tally)
        return raw.decode()

    def multi_get(self, keys: list[str], deadline: Deadline, tally: Tally | None = None) -> list[str]:
        """The values of ``keys``, which must all be set already."""
        raw: list[bytes] = self._quick_call(f"multi_get {keys[0]}", lambda s: s.multi_get(keys), deadline, tally)
        return [r.decode() for r in raw]

    def wait_value(
        self,
        key: str,
        deadline: Deadline,
        *,
        tally: Tally | None = None,
        interrupt: Callable[[], None] | None = None,
        wake: threading.Event | None = None,
    ) -> str | None:
        """(one caller) The value of ``key`` once some rank sets it, or ``None`` at ``deadline``. While
        waiting, ``interrupt()`` runs whenever ``wake`` is set and every ``SHARDSAFE_POLL_SECONDS``; it
        may raise to end the wait (the watchdog found a rank dead or the store lost)."""
        if self.lost is not None:
            raise self.lost
        if tally is not None:
            tally.waited["get"] += 1
        conn = self._connection("waits", deadline.or_grace())
        seconds = max(deadline.remaining(), 0.001)

        def blocking(store: Store) -> bytes:
            store.set_timeout(timedelta(seconds=seconds + knobs.error_report_seconds()))
            return store.get(key)  # type: ignore[no-any-return]

        def check_lost() -> None:
            if self.lost is not None:
                raise self.lost
            if interrupt is not None:
                interrupt()

        future = conn.lane.submit(lambda: blocking(conn.store))
        try:
            raw = wait_for(future, deadline, interrupt=check_lost, wake=wake)
        except (RuntimeError, OSError) as err:  # the request's own failure: the store's, or its timeout
            if isinstance(err, CheckpointError):
                raise
            if "timeout" in str(err).lower() and deadline.expired():
                return None
            raise self._gone(f"waiting for {key}", err) from err
        except BaseException:
            if not future.done():
                conn.lane.wedged = True  # abandoned mid-wait: the next operation opens a new connection
            raise
        if raw is None:
            if not future.done():
                conn.lane.wedged = True
            return None
        return raw.decode()


_lock = threading.Lock()
_clients: dict[tuple[int, str], StoreClient] = {}


def client_for(shared: Store, identity: int) -> StoreClient:
    """(any thread) The :class:`StoreClient` of the process for the store ``shared`` of the group
    ``identity`` (connections are opened on first use, not here)."""
    address = _tcp_address(shared)
    where = f"{address[0]}:{address[1]}" if address is not None else type(shared).__name__
    key = (identity, where if address is not None else str(id(shared)))
    with _lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = StoreClient(shared, where, address)
        return client


@atexit.register
def _close_all() -> None:
    """At interpreter exit (after the saves in flight are finished, whose hook runs first): no request
    starts from now on (:func:`~shardsafe.workers.shut_down`: refused, and no connection is opened), and
    the ones still running get ``SHARDSAFE_ERROR_REPORT_SECONDS`` to return while everything is alive."""
    shut_down(knobs.error_report_seconds())
    with _lock:
        _clients.clear()
