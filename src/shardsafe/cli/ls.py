"""``shardsafe ls ROOT [--verify] [--json]``: the checkpoints under a directory (the manager's scan,
:mod:`shardsafe.manager.listing`), as a table or JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from shardsafe.catalog.not_found import describe
from shardsafe.display import binary_size, table
from shardsafe.manager.listing import CheckpointRecord, scan, verify_record
from shardsafe.progress.record import ProgressCallback
from shardsafe.storage import get_storage
from shardsafe.storage.base import MANIFEST_NAME


def _format_metrics(metrics: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _table(records: list[CheckpointRecord]) -> list[str]:
    rows = [("NAME", "STATUS", "STEP", "CREATED", "SIZE", "METRICS")]
    for r in records:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)) if r.created is not None else "-"
        step = str(r.step) if r.step is not None else "-"
        rows.append((r.name, r.status, step, created, binary_size(r.size), _format_metrics(r.metrics)))
    lines = table(rows, pad_last=False)
    for r in records:
        if r.reason:
            lines.append(f"{r.name}: {r.reason}")
    return lines


def ls_main(
    root: str,
    *,
    verify: bool,
    as_json: bool,
    out: TextIO,
    progress: Callable[[str], ProgressCallback | None] | None = None,
) -> int:
    """``shardsafe ls ROOT [--verify] [--json]``: print the checkpoints under ``root`` with status,
    step, time, size and metrics. Exit code: 0 when fine, 1 when ``verify`` and any entry is incomplete
    or corrupt, 2 when ``root`` is not a directory (message on stderr). ``progress(name)``: the
    ``progress=`` of the verification of the checkpoint ``name`` (each is its own operation)."""
    try:
        fs = get_storage(root)
    except (ValueError, ImportError) as err:
        print(f"shardsafe ls: {err}", file=sys.stderr)
        return 2
    if not fs.is_dir(root):
        what = "does not exist" if not fs.exists(root) else "is not a directory"
        print(f"shardsafe ls: {root!r} {what}; give the directory that holds the checkpoints", file=sys.stderr)
        return 2
    records = scan(fs, root)
    if verify:
        records = [verify_record(r, progress(r.name) if progress is not None else None) for r in records]
    if as_json:
        json.dump({"root": root, "checkpoints": [r.to_json() for r in records]}, out, indent=2, allow_nan=False)
        out.write("\n")
    elif records:
        out.write("\n".join(_table(records)) + "\n")
    elif fs.exists(fs.join(root, MANIFEST_NAME)):
        out.write(f"{root} is itself a checkpoint, not a root of checkpoints; list its parent directory\n")
    else:
        found = describe(fs, root)  # a folder of another kind says so (DCP, Hugging Face, a retired base)
        if found.kind in ("retired", "deleting", "dcp", "hf", "uncommitted"):
            out.write(f"no checkpoints under {root}: {found.message}\n")
        else:
            out.write(f"no checkpoints under {root}\n")
    bad = [r for r in records if r.status not in ("committed", "retired")]
    return 1 if verify and bad else 0
