"""shardsafe's own connection to the rendezvous store.

A ``TCPStore`` client holds one lock per connection for the whole of a request, and a blocking
``get`` on a key nobody has set yet holds it until the key appears or the store's timeout (minutes)
passes. Any other thread of the process sharing that client (the user's own ``store.get``, NCCL's
lazy communicator set-up, a launcher's agent) would then stall shardsafe's heartbeat, and the other
ranks would declare this rank dead. So shardsafe talks to the store through a client of its own:

- one per process and store, cached, made by ``clone()`` of the process group's store (for a
  ``TCPStore``, possibly under ``PrefixStore``s, that is a new connection to the same host and port
  with the same prefixes); torch 2.6 and 2.7 have no ``clone()``, and there the shared client is used
  (a DEBUG line says so);
- connected on a background thread, so no caller waits on a slow connect: an operation that starts
  before it is ready (after a short bounded wait) uses the shared client, as does every operation on
  a store of another kind (``FileStore``, ``HashStore``), where clients do not block each other that way.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from shardsafe import knobs

logger = logging.getLogger(__name__)


class Connection:
    """shardsafe's own client of one store, connecting in the background."""

    def __init__(self, shared: Store, where: str) -> None:
        self.shared: Store | None = shared
        self.where = where
        self._ready = threading.Event()
        self._store: Store | None = None
        self._waited = False
        thread = threading.Thread(target=self._connect, name="shardsafe-store-connect", daemon=True)
        thread.start()

    def _connect(self) -> None:
        try:
            shared, self.shared = self.shared, None  # hold no reference to the group's store past this
            assert shared is not None
            clone = getattr(shared, "clone", None)
            if clone is None:  # torch 2.6 and 2.7 have no Store.clone: sharing the client is all there is
                logger.debug(
                    "shardsafe: this torch's store has no clone(); shardsafe shares the process group's client of %s",
                    self.where,
                )
                return
            self._store = clone()
        except Exception as err:  # reported; shardsafe then shares the process group's client
            logger.warning(
                "shardsafe: could not open its own connection to the rendezvous store %s (%s: %s); it shares "
                "the process group's client, so a thread blocked in store.get() there can delay its heartbeat",
                self.where,
                type(err).__name__,
                err,
            )
        finally:
            self._ready.set()

    def store(self, wait: float = 0.0) -> Store | None:
        """The own client once connected, else ``None``. The first call may wait up to ``wait``
        seconds for the connection; later ones never wait (a connect that hangs costs that once)."""
        if wait > 0 and not self._waited:
            self._waited = True
            self._ready.wait(wait)
        return self._store if self._ready.is_set() else None


_lock = threading.Lock()
_connections: dict[tuple[int, str, int], Connection] = {}


@atexit.register
def _close_all() -> None:
    """At interpreter exit (after the saves in flight are flushed, whose handlers run first): close
    shardsafe's own clients while everything else is still alive, rather than during module
    teardown, when the store they talk to may be half destroyed."""
    with _lock:
        _connections.clear()


def _tcp_address(store: Store) -> tuple[str, int] | None:
    """Host and port of the ``TCPStore`` under ``store`` (through any ``PrefixStore``s), else None."""
    inner: Any = store
    for _ in range(64):  # a chain of prefixes is short; a bound rather than trusting the loop
        if isinstance(inner, PrefixStore):
            inner = inner.underlying_store
            continue
        break
    if isinstance(inner, TCPStore):
        return str(inner.host), int(inner.port)
    return None


def preferred(shared: Store, identity: int) -> Store:
    """(any thread) The store client shardsafe should use for a run of requests that must stay in
    order: its own connection if it is up (after the first call's short wait), else ``shared``."""
    conn = connection_for(shared, identity)
    own = conn.store(wait=knobs.store_connect_wait()) if conn is not None else None
    return own if own is not None else shared


def connection_for(shared: Store, identity: int) -> Connection | None:
    """(any thread) The cached own connection for the store ``shared`` of the group ``identity``,
    started on first use; ``None`` when ``shared`` is not a ``TCPStore`` (then share its client)."""
    address = _tcp_address(shared)
    if address is None:
        return None
    key = (identity, *address)
    with _lock:
        conn = _connections.get(key)
        if conn is None:
            conn = _connections[key] = Connection(shared, f"{address[0]}:{address[1]}")
        return conn
