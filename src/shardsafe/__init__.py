"""shardsafe: distributed PyTorch checkpoints that are strategy-aware, all-or-nothing, verified,
pickle-free and never hang.

Every rank calls the same functions; the library decides which rank writes which bytes.

The top level is the checkpoint API (save, async_save, load, verify, inspect, delete, export and import), the
types it returns, its errors and the checkpoint manager. The training runtime (``shardsafe.runtime``)
and the Lightning Fabric strategies (``shardsafe.fabric``) are subpackages a program imports itself.

The public names are imported on first use (PEP 562 ``__getattr__``), so that ``import shardsafe``, and
with it the ``shardsafe`` command's ``--help``, does not import torch; the errors and ``__version__``
are imported at once. A new public name goes into ``_LAZY``, the ``TYPE_CHECKING`` block and ``__all__``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from shardsafe.errors import (
    BaseRefusedError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ClosedError,
    CommitFailedError,
    CoordinationError,
    CorruptCheckpointError,
    InconsistentRanksError,
    InsufficientMemoryError,
    InternalError,
    InvalidArgumentError,
    InvalidCallError,
    InvalidTypeError,
    LocalTierError,
    MissingKeysError,
    MissingPackageError,
    OperationTimeoutError,
    RankDeadError,
    RankDesyncError,
    RankTimeoutError,
    RemoteIOError,
    RemoteRankError,
    RetryableError,
    StateMismatchError,
    StorageError,
    TornSnapshotError,
    UnforeseenError,
    UnsafePathError,
    UnsafeValueError,
    UnsupportedCheckpointError,
    UnusableCheckpointError,
    UsageError,
)
from shardsafe.version import __version__

if TYPE_CHECKING:
    from shardsafe.engine.api import (
        CheckpointInfo,
        EntryInfo,
        SaveHandle,
        SaveOptions,
        VerifySummary,
        async_save,
        inspect,
        load,
        read_file,
        save,
        verify,
    )
    from shardsafe.engine.remove import delete
    from shardsafe.engine.sidefiles import side_files_folder
    from shardsafe.interop import ExportResult, ImportResult, export_hf, export_torch, import_checkpoint
    from shardsafe.manager import CheckpointManager, CheckpointRecord, LocalTier, ManagerConfig
    from shardsafe.progress.bar import ProgressBar
    from shardsafe.progress.record import Progress
    from shardsafe.state.per_rank import per_rank
    from shardsafe.state.rng import RNGState

_LAZY: dict[str, str] = {
    "CheckpointInfo": "shardsafe.engine.api",
    "EntryInfo": "shardsafe.engine.api",
    "SaveHandle": "shardsafe.engine.api",
    "SaveOptions": "shardsafe.engine.api",
    "VerifySummary": "shardsafe.engine.api",
    "async_save": "shardsafe.engine.api",
    "inspect": "shardsafe.engine.api",
    "load": "shardsafe.engine.api",
    "read_file": "shardsafe.engine.api",
    "save": "shardsafe.engine.api",
    "verify": "shardsafe.engine.api",
    "delete": "shardsafe.engine.remove",
    "side_files_folder": "shardsafe.engine.sidefiles",
    "Progress": "shardsafe.progress.record",
    "ProgressBar": "shardsafe.progress.bar",
    "ExportResult": "shardsafe.interop",
    "ImportResult": "shardsafe.interop",
    "export_hf": "shardsafe.interop",
    "export_torch": "shardsafe.interop",
    "import_checkpoint": "shardsafe.interop",
    "CheckpointManager": "shardsafe.manager",
    "CheckpointRecord": "shardsafe.manager",
    "ManagerConfig": "shardsafe.manager",
    "LocalTier": "shardsafe.manager",
    "per_rank": "shardsafe.state.per_rank",
    "RNGState": "shardsafe.state.rng",
}
"""Each public name imported on first use, and the module it comes from."""

__all__ = [
    "BaseRefusedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointRecord",
    "CheckpointTimeoutError",
    "ClosedError",
    "CommitFailedError",
    "CoordinationError",
    "CorruptCheckpointError",
    "EntryInfo",
    "ExportResult",
    "ImportResult",
    "InconsistentRanksError",
    "InsufficientMemoryError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidCallError",
    "InvalidTypeError",
    "LocalTier",
    "LocalTierError",
    "ManagerConfig",
    "MissingKeysError",
    "MissingPackageError",
    "OperationTimeoutError",
    "Progress",
    "ProgressBar",
    "RNGState",
    "RankDeadError",
    "RankDesyncError",
    "RankTimeoutError",
    "RemoteIOError",
    "RemoteRankError",
    "RetryableError",
    "SaveHandle",
    "SaveOptions",
    "StateMismatchError",
    "StorageError",
    "TornSnapshotError",
    "UnforeseenError",
    "UnsafePathError",
    "UnsafeValueError",
    "UnsupportedCheckpointError",
    "UnusableCheckpointError",
    "UsageError",
    "VerifySummary",
    "__version__",
    "async_save",
    "delete",
    "export_hf",
    "export_torch",
    "import_checkpoint",
    "inspect",
    "load",
    "per_rank",
    "read_file",
    "save",
    "side_files_folder",
    "verify",
]


def __getattr__(name: str) -> Any:
    """A public name, on first use: the first one imports them all, as ``import shardsafe`` did before the
    names were imported lazily (so a program that touches one has the same modules loaded as then). Or a
    subpackage (``shardsafe.storage``), imported now, as importing the whole API made them available."""
    if name in _LAZY:
        for public, module in _LAZY.items():
            globals()[public] = getattr(importlib.import_module(module), public)
        return globals()[name]
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
