"""shardsafe as it was at an earlier git revision, importable beside this one as ``shardsafe_base``.

The benchmarks that compare a change with what came before (``bench/run.py --baseline REV``,
``bench/protocol.py --baseline REV``) run both in the same processes, in the same sessions: the
baseline is the ``src/shardsafe`` tree of REV (``git archive``), its imports renamed to
``shardsafe_base`` and its store keys moved under ``shardsafe_base/`` (sharing shardsafe's, the two
would read each other's messages).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
ENV = "SHARDSAFE_BENCH_BASELINE"
"""The environment variable through which spawned ranks find the baseline's directory."""


def make_baseline(rev: str, into: Path) -> Path:
    """``src/shardsafe`` of ``rev`` as the package ``shardsafe_base`` under ``into``; returns ``into``."""
    raw = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "src/shardsafe"], check=True, capture_output=True
    ).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=raw, check=True)
    pkg = into / "shardsafe_base"
    shutil.move(str(into / "src" / "shardsafe"), pkg)
    for py in pkg.rglob("*.py"):
        text = py.read_text()
        text = re.sub(r"\bshardsafe(?=[.\s])", "shardsafe_base", text)
        py.write_text(text.replace('"shardsafe/', '"shardsafe_base/'))
    return into


def import_baseline(directory: str | None = None) -> ModuleType:
    """Import ``shardsafe_base`` from ``directory`` (default: the one named by ``$SHARDSAFE_BENCH_BASELINE``)."""
    where = directory or os.environ.get(ENV, "")
    if not where or not os.path.isdir(os.path.join(where, "shardsafe_base")):
        raise RuntimeError(
            f"bench: no baseline tree at {where!r} (${ENV}); run the benchmark with --baseline REV to build one"
        )
    if where not in sys.path:
        sys.path.insert(0, where)
    return importlib.import_module("shardsafe_base")
