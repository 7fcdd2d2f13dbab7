"""shardsafe: distributed PyTorch checkpoints that are strategy-aware, all-or-nothing, verified,
pickle-free and never hang.

Every rank calls the same functions; the library decides which rank writes which bytes.
"""

from shardsafe.engine.api import CheckpointInfo, SaveHandle, VerifySummary, async_save, inspect, load, save, verify
from shardsafe.engine.progress import Progress
from shardsafe.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    MissingKeysError,
    RankDeadError,
    RankDesyncError,
    RankTimeoutError,
    RemoteRankError,
    UnsafeValueError,
)
from shardsafe.format.values import PerRank
from shardsafe.interop import ExportResult, ImportResult, export_hf, export_torch, import_checkpoint
from shardsafe.manager import CheckpointManager, CheckpointRecord
from shardsafe.progressbar import ProgressBar
from shardsafe.runtime import LaunchError, Runtime, WorkerError
from shardsafe.state.per_rank import per_rank

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointRecord",
    "CoordinationError",
    "CorruptCheckpointError",
    "ExportResult",
    "ImportResult",
    "LaunchError",
    "MissingKeysError",
    "PerRank",
    "Progress",
    "ProgressBar",
    "RankDeadError",
    "RankDesyncError",
    "RankTimeoutError",
    "RemoteRankError",
    "Runtime",
    "SaveHandle",
    "UnsafeValueError",
    "VerifySummary",
    "WorkerError",
    "__version__",
    "async_save",
    "export_hf",
    "export_torch",
    "import_checkpoint",
    "inspect",
    "load",
    "per_rank",
    "save",
    "verify",
]
