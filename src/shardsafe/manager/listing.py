"""What is under a checkpoint root: committed checkpoints (from their manifests, through
:func:`shardsafe.inspect`), incomplete ones (pending directories and directories without a manifest)
and corrupt ones (a manifest that does not parse, or bytes that fail :func:`shardsafe.verify`).
Also the ``shardsafe ls ROOT`` command (:func:`ls_main`).

Listing is local to the calling process and talks to no other rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from shardsafe.catalog.names import DATA_FILE, EXPORT_HIDDEN, EXPORT_REPLACED, LITTER_DIR, PENDING_DIR, TOMBSTONE
from shardsafe.catalog.refs import referenced_files
from shardsafe.engine import api
from shardsafe.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardsafe.manager.config import NameTemplate
from shardsafe.progress.record import ProgressCallback
from shardsafe.storage import Storage
from shardsafe.storage.base import MANIFEST_NAME

Status = Literal["committed", "incomplete", "corrupt", "retired"]

_STEP_WORD = re.compile(r"(?:^|[^a-z0-9])(?:global_)?steps?[-_=]?(\d+)(?![0-9])", re.IGNORECASE)
_NUMBERED = re.compile(r"(?:(?:checkpoint|ckpt|iter|iteration)[-_=.]?)?(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class CheckpointRecord:
    """One entry under a root, as :meth:`CheckpointManager.list` and ``shardsafe ls`` report it."""

    name: str
    """The directory name inside the root (hidden ``.<name>.staging-<id>`` for a save in flight)."""
    path: str
    status: Status
    """``committed`` (its manifest exists and parses), ``incomplete`` (no manifest: a save that is
    running or crashed), ``corrupt`` (its manifest or, with verification, its bytes are bad; or an
    incremental checkpoint whose base is missing) or ``retired`` (deleted by retention, its data files
    kept because newer checkpoints refer to them; not loadable)."""
    step: int | None
    """The training step it holds (the save's ``metadata["step"]``, else read from the name)."""
    created: float | None
    """Unix time of the commit; for an incomplete entry, of its last change."""
    size: int
    """Bytes of tensor data (committed) or of the files present (incomplete)."""
    metrics: Mapping[str, Any] = field(default_factory=dict)
    """The ``metrics=`` given to the save."""
    reason: str = ""
    """Why it is not committed or not intact; empty when it is."""
    files: tuple[str, ...] = ()
    """Data files its manifest lists (committed only)."""
    target: str = ""
    """For a pending or litter directory: the checkpoint name it was meant for; else ``name``."""

    @property
    def leftover(self) -> bool:
        """A hidden pending/litter directory rather than a checkpoint directory."""
        return self.name != self.target

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: non-finite metric values become the strings ``"nan"``, ``"inf"``, ``"-inf"``, and
        values JSON cannot hold (in checkpoints not written by the manager) their ``repr``."""
        out = asdict(self)
        out["metrics"] = {str(k): _finite_or_str(v) for k, v in self.metrics.items()}
        del out["files"], out["target"]
        return out


def _finite_or_str(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return repr(value)


def step_from_name(name: str) -> int | None:
    """The training step a checkpoint name tells without doubt, else ``None``: the number after the word
    ``step`` (``step-100``, ``step_100``, ``global_step=1200``, ``epoch=3-step=1200``), or the number of a
    name that is only a number, bare or after ``checkpoint``/``ckpt``/``iter``/``iteration``
    (``checkpoint-500``, ``300``). Anything else (``last``, ``epoch=3``, ``2024-06-01``, ``model-v2``, two
    different ``step`` numbers) tells no step."""
    steps = {int(n) for n in _STEP_WORD.findall(name)}
    if steps:
        return steps.pop() if len(steps) == 1 else None
    m = _NUMBERED.fullmatch(name)
    return int(m.group(1)) if m else None


def _step_from_name(name: str, template: NameTemplate | None) -> int | None:
    if template is not None:
        return template.parse(name)
    return step_from_name(name)


def scan(
    fs: Storage, root: str, template: NameTemplate | None = None, *, others: bool = False
) -> list[CheckpointRecord]:
    """(any rank, local) Every checkpoint-like entry under ``root``, sorted by step then name.

    With ``template`` only entries of that naming are reported (what a manager saves, keeps and
    deletes); without, or with ``others``, also every other directory holding a manifest or data files
    (``shardsafe ls``; what a manager may resume from). The step of an entry of the template's naming
    is the one in its name; of any other, its manifest's ``metadata["step"]`` (an int), else what
    :func:`step_from_name` reads in its name, else ``None``. Pending and litter directories of
    unfinished saves come back as ``incomplete``."""
    records: list[CheckpointRecord] = []
    for name in fs.list_dir(root):
        path = fs.join(root, name)
        if name.startswith("."):
            record = _leftover(fs, name, path, template, others)
        else:
            record = _checkpoint(fs, name, path, template, others)
        if record is not None:
            records.append(record)
    records.sort(key=lambda r: (r.step is None, r.step or 0, r.name))
    return records


def _leftover(
    fs: Storage, name: str, path: str, template: NameTemplate | None, others: bool
) -> CheckpointRecord | None:
    kind = "staging"  # the catalog's names: what the sweep and the gate see too
    m = PENDING_DIR.match(name)
    for pattern, what in ((LITTER_DIR, "litter"), (EXPORT_HIDDEN, "export"), (EXPORT_REPLACED, "replaced")):
        if m is None:
            m, kind = pattern.match(name), what
    if m is None or not fs.is_dir(path):
        return None
    target = m.group("target")
    step = _step_from_name(target, template)
    if template is not None and step is None:
        if not others:
            return None
        step = step_from_name(target)
    try:
        created, size = fs.mtime(path), fs.total_size(path)
    except FileNotFoundError:  # finished (renamed into place) or removed while we looked
        return None
    reason = {
        "staging": f"pending directory of a save of {target!r} that has not committed (still running, or crashed)",
        "litter": f"remains of an earlier crashed save of {target!r}, set aside by a later save",
        "export": f"hidden folder of an export to {target!r} that has not been published (still running, or crashed)",
        "replaced": f"an export of {target!r} replaced by a newer one, not yet removed (its removal failed)",
    }[kind]
    return CheckpointRecord(name, path, "incomplete", step, created, size, reason=reason, target=target)


def _checkpoint(
    fs: Storage, name: str, path: str, template: NameTemplate | None, others: bool
) -> CheckpointRecord | None:
    if not fs.is_dir(path):
        return None
    step = _step_from_name(name, template)
    if template is not None and step is None:
        if not others:
            return None
        template = None  # another naming: seen as shardsafe ls sees it
        step = step_from_name(name)
    if fs.exists(fs.join(path, MANIFEST_NAME)):
        try:
            info = api.inspect(path)
        except CorruptCheckpointError as err:
            return CheckpointRecord(name, path, "corrupt", step, None, 0, reason=f"bad manifest: {err}", target=name)
        except CheckpointNotFoundError as err:
            if not fs.exists(fs.join(path, MANIFEST_NAME)):
                return None  # deleted while we looked
            return CheckpointRecord(name, path, "corrupt", step, None, 0, reason=f"missing base: {err}", target=name)
        meta = info.metadata if isinstance(info.metadata, dict) else {}
        if template is None and _is_int(meta.get("step")):
            step = meta["step"]
        metrics = meta.get("metrics")
        return CheckpointRecord(
            name,
            path,
            "committed",
            step,
            info.created,
            info.total_bytes,
            metrics=dict(metrics) if isinstance(metrics, dict) else {},
            files=tuple(info.files),
            target=name,
        )
    names = fs.list_dir(path)
    if template is None and not any(DATA_FILE.match(n) for n in names):
        return None  # some other directory, not a checkpoint
    try:
        created, size = fs.mtime(path), fs.total_size(path)
    except FileNotFoundError:
        return None
    if TOMBSTONE in names and _referenced(fs, path):
        reason = "deleted by retention; its data files stay while newer (incremental) checkpoints refer to them"
        return CheckpointRecord(name, path, "retired", step, created, size, reason=reason, target=name)
    reason = "no MANIFEST.json: a save that did not commit, or a checkpoint whose deletion was interrupted"
    return CheckpointRecord(name, path, "incomplete", step, created, size, reason=reason, target=name)


def _referenced(fs: Storage, path: str) -> bool:
    """Whether a checkpoint beside ``path`` refers to its data files (a retired base, not a leftover)."""
    try:
        return bool(referenced_files(fs, path))
    except (OSError, ValueError):
        return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def verify_record(record: CheckpointRecord, progress: ProgressCallback | None = None) -> CheckpointRecord:
    """(any rank, local) ``record`` checked byte for byte with :func:`shardsafe.verify` (reporting to
    ``progress``): returned as is when intact, as ``corrupt`` with the reason when not. Reads every data
    byte of the checkpoint."""
    if record.status != "committed":
        return record
    try:
        api.verify(record.path, progress=progress)
    except (CorruptCheckpointError, OSError) as err:
        return replace(record, status="corrupt", reason=f"{type(err).__name__}: {err}")
    return record
