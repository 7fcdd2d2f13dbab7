"""shardsafe's own store client comes from ``Store.clone()``, which torch 2.6 and 2.7 do not have: there
shardsafe shares the process group's client, as designed, and says so at DEBUG, not with a WARNING on
every rank at every save. Runs on the torch installed (with a real TCPStore: cloned where torch has
``clone``, shared where it has not) and with a store that has no ``clone`` whatever the torch."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from shardsafe.coord.connection import Connection, preferred

LOGGER = "shardsafe.coord.connection"


class _NoClone:
    """A store of a torch without ``Store.clone`` (as far as the connection can tell)."""


def test_a_store_without_clone_is_shared_with_a_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    conn = Connection(_NoClone(), "127.0.0.1:1")  # type: ignore[arg-type]
    assert conn.store(wait=10.0) is None  # no own client: the caller shares the group's
    records = [r for r in caplog.records if r.name == LOGGER]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    assert any(r.levelno == logging.DEBUG and "clone" in r.getMessage() for r in records), records


def test_a_real_tcp_store_on_this_torch(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    chosen = preferred(store, identity=987654)
    if hasattr(store, "clone"):  # torch >= 2.8: a connection of its own
        assert chosen is not store
        chosen.set("shardsafe-test", b"1")
        assert store.get("shardsafe-test") == b"1"
    else:  # torch 2.6, 2.7: the group's client
        assert chosen is store
    assert not [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def test_a_clone_that_fails_is_still_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Where torch has ``clone`` and it fails (the store's host unreachable), that is worth a WARNING."""

    class _Broken:
        def clone(self) -> None:
            raise RuntimeError("connection refused")

    conn = Connection(_Broken(), "127.0.0.1:1")  # type: ignore[arg-type]
    assert conn.store(wait=10.0) is None
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "connection refused" in warnings[0], warnings
