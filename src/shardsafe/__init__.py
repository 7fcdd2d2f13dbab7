"""shardsafe: distributed PyTorch checkpoints that are strategy-aware, all-or-nothing, verified,
pickle-free and never hang.

Every rank calls the same functions; the library decides which rank writes which bytes.
"""

from shardsafe.engine.api import (
    CheckpointInfo,
    SaveHandle,
    SaveOptions,
    VerifySummary,
    async_save,
    inspect,
    load,
    save,
    verify,
)
from shardsafe.engine.progress import Progress
from shardsafe.engine.progressbar import ProgressBar
from shardsafe.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ClosedError,
    CoordinationError,
    CorruptCheckpointError,
    InternalError,
    InvalidArgumentError,
    InvalidTypeError,
    LaunchError,
    MissingKeysError,
    OperationTimeoutError,
    RankDeadError,
    RankDesyncError,
    RankTimeoutError,
    RemoteIOError,
    RemoteRankError,
    StateMismatchError,
    UnsafeValueError,
    WorkerError,
)
from shardsafe.format.values import PerRank
from shardsafe.interop import ExportResult, ImportResult, export_hf, export_torch, import_checkpoint
from shardsafe.manager import CheckpointManager, CheckpointRecord
from shardsafe.runtime import Runtime
from shardsafe.state.per_rank import per_rank
from shardsafe.version import __version__

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointRecord",
    "CheckpointTimeoutError",
    "ClosedError",
    "CoordinationError",
    "CorruptCheckpointError",
    "ExportResult",
    "ImportResult",
    "InternalError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LaunchError",
    "MissingKeysError",
    "OperationTimeoutError",
    "PerRank",
    "Progress",
    "ProgressBar",
    "RankDeadError",
    "RankDesyncError",
    "RankTimeoutError",
    "RemoteIOError",
    "RemoteRankError",
    "Runtime",
    "SaveHandle",
    "SaveOptions",
    "StateMismatchError",
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
