"""Every ``<file>.py:<name>`` reference in the docs, the README, the tests and the sources names a file of the
repository and something defined there (a function, a class, a method as ``Class.method``, a module
constant): the walks of docs/architecture.md and the docstrings that point at code stay true. That the
walks' hops are called, in their order, and the figures measured from a trace: tests/test_doc_trace.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "shardsafe"
_REF = re.compile(r"((?:[a-z_]+/)*[a-z_]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


def _defined(path: Path, dotted: str) -> bool:
    nodes: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found: ast.stmt | None = None
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part:
                found = n
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = n
        if found is None:
            return False
        nodes = getattr(found, "body", [])
    return True


def _references() -> list[tuple[str, str, str]]:
    pages = [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("tests/*.py"), *SRC.rglob("*.py")]
    return [(str(p.relative_to(ROOT)), m[1], m[2]) for p in pages for m in _REF.finditer(p.read_text())]


def test_every_code_reference_names_something_that_exists() -> None:
    refs = _references()
    assert len(refs) > 50  # the walks of docs/architecture.md alone hold more
    bad = []
    for page, file, name in refs:
        path = SRC / file if (SRC / file).exists() else ROOT / file
        if not path.exists():
            bad.append(f"{page}: {file}:{name}: no such file")
        elif not _defined(path, name):
            bad.append(f"{page}: {file}:{name}: not defined there")
    assert not bad, "stale references:\n" + "\n".join(bad)
