"""Checkpoint management: when to save, what to keep, where to resume from, and a clean stop on
preemption. :class:`CheckpointManager` is the entry point; retention policies are pure functions."""

from shardsafe.manager.config import ManagerConfig, NameTemplate
from shardsafe.manager.listing import CheckpointRecord, ls_main
from shardsafe.manager.manager import CheckpointManager
from shardsafe.manager.retention import RetentionPolicy, keep_best, keep_every_n_steps, keep_last

__all__ = [
    "CheckpointManager",
    "CheckpointRecord",
    "ManagerConfig",
    "NameTemplate",
    "RetentionPolicy",
    "keep_best",
    "keep_every_n_steps",
    "keep_last",
    "ls_main",
]
