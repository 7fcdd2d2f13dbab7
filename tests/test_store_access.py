"""``coord/`` is the only code that talks to the rendezvous store, checked on the source (ast): outside
``src/shardsafe/coord/`` no module makes a store request (a call of a request method on a
:class:`~shardsafe.coord.client.StoreClient` or a torch ``Store``), nor imports the store client.

A request is a call ``<receiver>.<method>(...)`` where ``<method>`` is a request of either class and the
receiver is named like one (its last name holds ``client`` or ``store``: ``op.client``, ``keys.client``,
``store``, ``self._store``), or is a call of ``client_for``/``_get_default_store``. Every cross-rank
exchange goes through the protocol engine (``coord/operation.py``) instead: a declared round, the
commitment, the per-rank counters."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch.distributed as dist

from shardsafe.coord.client import StoreClient

PKG = Path(__file__).resolve().parent.parent / "src" / "shardsafe"
COORD = PKG / "coord"

_REQUESTS = {
    name
    for cls in (StoreClient, dist.Store)
    for name in dir(cls)
    if not name.startswith("_") and callable(getattr(cls, name)) and name not in {"reset", "close"}
}
_RECEIVER = re.compile(r"client|store", re.IGNORECASE)
_MAKERS = {"client_for", "_get_default_store"}


def _last_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _last_name(node.func)
    return ""


def store_requests(source: str) -> list[tuple[int, str]]:
    """(line, what) of every store request and every import of the store client in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _REQUESTS:
            receiver = node.func.value
            name = _last_name(receiver)
            if _RECEIVER.search(name) or name in _MAKERS:
                found.append((node.lineno, f"{ast.unparse(receiver)}.{node.func.attr}(...)"))
        elif isinstance(node, ast.ImportFrom) and node.module == "shardsafe.coord.client":
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import) and any(a.name == "shardsafe.coord.client" for a in node.names):
            found.append((node.lineno, "import shardsafe.coord.client"))
    return found


def test_the_check_sees_the_forms_a_request_takes() -> None:
    """The checker itself: each line below is a store request (or the client's import), in the forms
    the code before the protocol engine used (engine/commit.py, progress/keys.py)."""
    source = "\n".join(
        [
            "settled = op.client.compare_set(self.decision, text, bound, op.tally)",
            "raw = op.client.wait_value(r.outcome, deadline, tally=op.tally)",
            "client = op.client",
            "raw = list(client.multi_get(keys, bound))",
            "keys.client.get(keys.key('stop_at'), keys.deadline())",
            "store.set('k', 'v')",
            "self._owned_store.add('n', 1)",
            "dist.distributed_c10d._get_default_store().check(['k'])",
            "from shardsafe.coord.client import client_for",
            "x = storage.read_bytes(path)",  # not the store: a storage
            "op.agree(ROUND, mine, decide)",  # the engine
        ]
    )
    lines = sorted(line for line, _ in store_requests(source))
    assert lines == [1, 2, 4, 5, 6, 7, 8, 9], store_requests(source)


def test_no_store_request_outside_coord() -> None:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if COORD in path.parents:
            continue
        for line, what in store_requests(path.read_text()):
            bad.append(f"{path.relative_to(PKG)}:{line}: {what}")
    assert not bad, (
        "store requests outside coord/ (declare a round and let the protocol engine, coord/operation.py, make "
        "them):\n" + "\n".join(bad)
    )
