"""Checkpoint management: when to save, what to keep, where to resume from, and a clean stop on
preemption. :class:`CheckpointManager` is the entry point; retention policies are pure functions.

Lives here: the manager (``manager``), its config (``config``), when to save (``schedule``), preemption
signals (``preemption``), retention policies (``retention``), the scan of a root (``listing``; the
``shardsafe ls`` command prints it, :mod:`shardsafe.cli.ls`), cleanup of leftovers (``cleanup``), resume
(``resume``), the node-local tier (``tiers``: config and layout; ``local``: its protocols; ``replica``: its
socket transport; ``lineage``: the run and incarnations a copy belongs to) and the chain of incremental
saves: which base, when a full save is due (``chain``). Its per-step agreements live in coord.steps.

Layer: may import engine, storage, coord, display, errors; imported by the public package and the CLI."""

from shardsafe.manager.config import ManagerConfig, NameTemplate
from shardsafe.manager.listing import CheckpointRecord
from shardsafe.manager.manager import CheckpointManager
from shardsafe.manager.retention import RetentionPolicy, keep_best, keep_every_n_steps, keep_last
from shardsafe.manager.tiers import LocalTier

__all__ = [
    "CheckpointManager",
    "CheckpointRecord",
    "LocalTier",
    "ManagerConfig",
    "NameTemplate",
    "RetentionPolicy",
    "keep_best",
    "keep_every_n_steps",
    "keep_last",
]
