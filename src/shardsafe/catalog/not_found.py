"""What a folder without ``MANIFEST.json`` is, for the error that refuses to read it as a checkpoint
(load, verify, inspect, export) and for ``shardsafe ls``: each kind comes with its own fix.

- nothing there, or an empty folder: check the path;
- a retired incremental base (its manifest set aside as the tombstone ``.MANIFEST.json.deleting`` by a
  delete, its data files kept because sibling checkpoints refer to them): load one of those, and do
  not remove it;
- a checkpoint whose deletion was interrupted (a tombstone, no sibling refers to it);
- a torch.distributed.checkpoint (DCP) folder (``.metadata``) or a Hugging Face model folder
  (``model.safetensors``, its sharded index, or safetensors files beside ``config.json``): not
  shardsafe's format, ``shardsafe import`` brings it in;
- the leftovers of a save that did not commit (shardsafe's data files, no manifest);
- a run root (checkpoint folders inside): give one of them, or ``shardsafe ls`` it;
- any other folder.

Local to the calling process; reads only names, plus the manifests of the siblings of a tombstoned
folder (to say which checkpoints keep it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from shardsafe.catalog.names import DATA_FILE, TEMP_MANIFEST, TOMBSTONE
from shardsafe.catalog.refs import referrers, split
from shardsafe.errors import CheckpointNotFoundError
from shardsafe.storage.base import MANIFEST_NAME, Storage

Kind = Literal["missing", "empty", "retired", "deleting", "dcp", "hf", "uncommitted", "run-root", "other"]

DCP_METADATA = ".metadata"
"""The file torch.distributed.checkpoint writes its (pickled) metadata to."""
HF_CONFIG = "config.json"
_HF_WEIGHTS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
_TRAILING_DIGITS = re.compile(r"(\d+)$")
_MAX_SUBFOLDERS = 256
"""A run root is recognised from at most this many of its folders (each costs a request on object stores)."""


@dataclass(frozen=True)
class Finding:
    """What the folder at a path without ``MANIFEST.json`` is, and the sentence that tells a user."""

    kind: Kind
    message: str


def not_found(storage: Storage, path: str) -> CheckpointNotFoundError:
    """(any rank) The error for reading ``path`` as a checkpoint when it has no ``MANIFEST.json``."""
    return CheckpointNotFoundError(describe(storage, path).message)


def describe(storage: Storage, path: str) -> Finding:
    """(any rank, local) What the folder at ``path`` (which has no ``MANIFEST.json``) is."""
    names = storage.list_dir(path)
    if not names:
        if storage.exists(path):
            return Finding("empty", f"no checkpoint at {path}: an empty folder; check the path")
        return Finding("missing", f"no checkpoint at {path}: nothing is there; check the path")
    if TOMBSTONE in names:
        return _tombstoned(storage, path)
    if DCP_METADATA in names:
        return Finding(
            "dcp",
            f"{path} is a torch.distributed.checkpoint (DCP) folder (it holds {DCP_METADATA}), not a shardsafe "
            f"checkpoint: bring it in with `shardsafe import {path} DEST --allow-pickle` (DCP metadata is a "
            "pickle: only for a source you trust), then load DEST; or read it with torch.distributed.checkpoint",
        )
    weights = sorted(n for n in names if n.endswith(".safetensors") and not DATA_FILE.match(n))
    if any(_HF_WEIGHTS.match(n) for n in names) or (weights and HF_CONFIG in names):
        shown = ", ".join([*weights[:3], *(["..."] if len(weights) > 3 else []), *[n for n in names if n == HF_CONFIG]])
        return Finding(
            "hf",
            f"{path} is a Hugging Face model folder ({shown}), not a shardsafe checkpoint: load it with "
            f"transformers' from_pretrained, or bring it in with `shardsafe import {path} DEST`",
        )
    if any(DATA_FILE.match(n) or TEMP_MANIFEST.match(n) for n in names):
        return Finding(
            "uncommitted",
            f"{path} holds no MANIFEST.json: it is an uncommitted (interrupted or failed) save, not a checkpoint. "
            "Load an older checkpoint; a CheckpointManager removes such leftovers in its root.",
        )
    checkpoints = _checkpoints_in(storage, path, names)
    if checkpoints:
        shown = ", ".join([*(["..."] if len(checkpoints) > 3 else []), *checkpoints[-3:]])
        return Finding(
            "run-root",
            f"{path} is a folder of checkpoints ({len(checkpoints)} checkpoint(s): {shown}), not a checkpoint "
            f"itself: give one of them, e.g. the newest, {storage.join(path, checkpoints[-1])}, or list them with "
            f"`shardsafe ls {path}`",
        )
    shown = ", ".join(repr(n) for n in sorted(names)[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return Finding(
        "other",
        f"no checkpoint at {path}: the folder holds no MANIFEST.json and no file shardsafe writes ({shown}); "
        "check the path",
    )


def _tombstoned(storage: Storage, path: str) -> Finding:
    keepers = referrers(storage, path)
    committed = sorted((n for n, kind in keepers.items() if kind == "committed"), key=_step_order)
    others = sorted(n for n, kind in keepers.items() if kind != "committed")
    if not keepers:
        return Finding(
            "deleting",
            f"{path} is a checkpoint whose deletion was interrupted (its manifest was set aside as {TOMBSTONE}): "
            "it is no longer a checkpoint. Load another one; a CheckpointManager over its parent folder finishes "
            "the deletion.",
        )
    keep = ", ".join([*committed, *(f"{n} ({keepers[n]})" for n in others)])
    load = f" Load {storage.join(split(path)[0], committed[-1])} instead." if committed else ""
    return Finding(
        "retired",
        f"{path} is a retired checkpoint, no longer loadable: it was deleted, and its data files are kept "
        f"because the incremental checkpoint(s) {keep} refer to them.{load} Do not remove {path} by hand: "
        "those checkpoints would lose their data (shardsafe removes it once none refers to it; `shardsafe export "
        "CKPT OUT --format shardsafe` makes a self-contained copy).",
    )


def _checkpoints_in(storage: Storage, path: str, names: list[str]) -> list[str]:
    """The committed checkpoints among the first folders of ``path``, oldest first (by trailing number)."""
    folders = sorted(n for n in names if not n.startswith("."))[:_MAX_SUBFOLDERS]
    found = [n for n in folders if storage.exists(storage.join(storage.join(path, n), MANIFEST_NAME))]
    return sorted(found, key=_step_order)


def _step_order(name: str) -> tuple[int, str]:
    m = _TRAILING_DIGITS.search(name)
    return (int(m.group(1)) if m else -1, name)
