"""One publication transaction and one delete gate, checked on the source (ast).

- Every removal goes through the gate (``catalog/unlink.py``): outside it, no call removes a file or a
  folder itself (``os.unlink``, ``os.remove``, ``os.rmdir``, ``shutil.rmtree``, a storage's
  ``unlink_names`` / ``remove_dir_if_empty`` / ``rm`` / ``rm_file`` / ``rmdir``), except in the storage
  backends (the primitives the gate calls, and a writer discarding the one file it created) and where a
  reason is written below. Nothing removes recursively (``shutil.rmtree``).
- Every step that makes something visible (``os.rename``, ``os.replace``, ``os.link``, an fsspec ``mv``)
  lives in the publication transaction (``catalog/publish.py``) or in the storage backends it drives
  (a checkpoint's publish, the delete rule's tombstone), except where a reason is written below."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "shardsafe"

REMOVALS = {"os.unlink", "os.remove", "os.rmdir", "os.removedirs", "shutil.rmtree"}
REMOVAL_METHODS = {"unlink_names", "remove_dir_if_empty", "rm", "rm_file", "rmdir"}
PUBLISHES = {"os.rename", "os.replace", "os.link"}
PUBLISH_METHODS = {"mv"}

GATE = {"catalog/unlink.py"}
PUBLICATION = {"catalog/publish.py"}
BACKENDS = "storage/"

# (file, call) -> why it is not the gate's or the publication's (none left: every writer and deleter,
# the local tier and the integrations included, goes through them).
ALLOWED_REMOVALS: dict[tuple[str, str], str] = {}
ALLOWED_PUBLISHES: dict[tuple[str, str], str] = {}


def _calls(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if isinstance(f.value, ast.Name) and f"{f.value.id}.{f.attr}" in REMOVALS | PUBLISHES:
            found.append((node.lineno, f"{f.value.id}.{f.attr}"))
        elif f.attr in REMOVAL_METHODS | PUBLISH_METHODS:
            found.append((node.lineno, f".{f.attr}"))
    return found


def _sites() -> list[tuple[str, int, str]]:
    return [
        (path.relative_to(PKG).as_posix(), line, call)
        for path in sorted(PKG.rglob("*.py"))
        for line, call in _calls(path.read_text())
    ]


def _is_removal(call: str) -> bool:
    return call in REMOVALS or call.lstrip(".") in REMOVAL_METHODS


def test_every_removal_goes_through_the_gate() -> None:
    bad = [
        f"{rel}:{line}: {call}"
        for rel, line, call in _sites()
        if _is_removal(call)
        and rel not in GATE
        and not rel.startswith(BACKENDS)
        and (rel, call) not in ALLOWED_REMOVALS
    ]
    assert not bad, "removals outside the gate (use shardsafe.catalog.unlink / catalog.delete):\n" + "\n".join(bad)


def test_nothing_removes_recursively() -> None:
    recursive = [f"{rel}:{line}" for rel, line, call in _sites() if call == "shutil.rmtree"]
    assert not recursive, recursive


def test_every_publish_step_is_the_publication_transactions() -> None:
    bad = [
        f"{rel}:{line}: {call}"
        for rel, line, call in _sites()
        if not _is_removal(call)
        and rel not in PUBLICATION
        and not rel.startswith(BACKENDS)
        and (rel, call) not in ALLOWED_PUBLISHES
    ]
    assert not bad, "publish steps outside catalog/publish.py and the storage backends:\n" + "\n".join(bad)


def test_the_allowances_are_still_needed() -> None:
    """An allowance whose call is gone must go too (the list says what is left to move, no more)."""
    present = {(rel, call) for rel, _, call in _sites()}
    stale = (set(ALLOWED_REMOVALS) | set(ALLOWED_PUBLISHES)) - present
    assert not stale, f"remove these allowances, their calls are gone: {sorted(stale)}"
