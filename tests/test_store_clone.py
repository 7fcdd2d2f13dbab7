"""shardsafe's own clients of the store, on every torch release: plain ``TCPStore`` clients of the same
host and port (never ``Store.clone``, which torch 2.6 and 2.7 lack and which, when many ranks clone at
once, makes some wait seconds), with keys under a namespace agreed once through the process group's
client, so that every rank of a rendezvous uses the same keys and a restarted job (whose launcher
prefixes the group's keys anew) never reads an older run's."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import PrefixStore, TCPStore

from shardsafe.coord.client import StoreClient
from shardsafe.deadline import Deadline


def test_own_clients_share_a_namespace_per_rendezvous_and_never_the_groups_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="shardsafe")
    server = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=30))
    soon = Deadline.after(30, "test")
    run1 = PrefixStore("default_pg", server)  # the group's client of a first run, and of a restarted one
    run2 = PrefixStore("restart-1/default_pg", server)
    a, b = StoreClient(run1, "a", ("127.0.0.1", server.port)), StoreClient(run1, "b", ("127.0.0.1", server.port))
    c = StoreClient(run2, "c", ("127.0.0.1", server.port))
    a.set("k", "from a", soon)
    assert b.get("k", soon) == "from a"  # two ranks of one rendezvous: the same keys
    assert not c.check(["k"], soon)  # the restarted job: none of the old run's keys
    assert not run1.check(["k"])  # nothing written through, or into, the group's own key space but the namespace
    assert a._quick is not None and a._quick.store is not run1
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
