"""Checkpoint management: when to save, what to keep, where to resume from, and a clean stop on
preemption. :class:`CheckpointManager` is the entry point; retention policies are pure functions.

Lives here: the manager (``manager``), its config (``config``), when to save (``schedule``), preemption
signals (``preemption``), retention policies (``retention``), listing and ``ls`` (``listing``), cleanup
of leftovers (``cleanup``), resume (``resume``) and the base of an incremental save (``incremental``).
Its store agreements live in coord.steps.

Layer: may import engine, storage, coord, display, errors; imported by the public package and the CLI."""

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
