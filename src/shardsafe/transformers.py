"""Hugging Face transformers' ``Trainer`` whose ``checkpoint-N`` folders are shardsafe checkpoints
(docs/huggingface.md): ``from shardsafe.transformers import Trainer`` is the only change to a script, and
:class:`CheckpointMixin` gives the same to a ``Trainer`` subclass (TRL's ``SFTTrainer``...):
``class MyTrainer(CheckpointMixin, SFTTrainer): pass``.

A checkpoint is one :func:`shardsafe.save` on every rank: the model as prepared (DDP, FSDP through Accelerate:
each rank writes its share, nothing is gathered), the optimizer, the scheduler, the gradient scaler and every
rank's random generators (:class:`shardsafe.RNGState`), committed all-or-nothing, checksummed, pickle-free. The
files the Trainer reads by path before anything else, ``trainer_state.json`` first, are side files of that
checkpoint: written by the main process into the checkpoint before its commit, listed in its manifest,
checked before a resume uses them. With ``hf_weights`` (the default, for a model that is not sharded) the
main process also writes what the stock Trainer does (``model.safetensors``, ``config.json``, the tokenizer,
``training_args.bin``) as side files, so ``from_pretrained("…/checkpoint-N")`` works as before.

``train(resume_from_checkpoint=True)`` resumes from the newest ``checkpoint-N`` that is committed and whose
``trainer_state.json`` checks (newer damaged or uncommitted ones are skipped with a WARNING); a resume continues
mid-epoch with the same batches and the same random streams. ``save_total_limit`` deletes older checkpoints
through :func:`shardsafe.delete` after the new one is committed (never the newest, nor the best one with
``load_best_model_at_end``). A folder of the stock Trainer is still resumed the stock way.

Refused when the Trainer is made (:class:`~shardsafe.InvalidArgumentError`, with the reason): DeepSpeed (its
engine writes its own checkpoints), ``push_to_hub`` (it uploads the stock files of a checkpoint folder) and
``save_on_each_node`` (one checkpoint is one folder every rank writes to).

This module imports ``transformers``; ``import shardsafe`` does not (install ``shardsafe[transformers]``).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

import shardsafe
from shardsafe import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError, StateMismatchError

__all__ = ["CheckpointMixin", "Trainer"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
MANIFEST = "MANIFEST.json"
_TOMBSTONE = ".MANIFEST.json.deleting"
"""The manifest of a checkpoint being deleted, set aside (docs/format.md, section 7)."""
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a committed shardsafe checkpoint (its manifest there), not a stock Trainer folder."""
    return os.path.isfile(os.path.join(path, MANIFEST))


class CheckpointMixin:
    """Mixed in before ``transformers.Trainer`` or a subclass of it: its checkpoints go through shardsafe
    (module docstring). Two keyword arguments of its own: ``checkpoint_timeout`` (seconds every checkpoint
    wait may take; default ``SHARDSAFE_TIMEOUT`` / ``SHARDSAFE_IO_TIMEOUT``) and ``hf_weights`` (default True:
    also write the stock files of a checkpoint folder, ``model.safetensors`` and the rest, for a model that is
    not sharded; False: the shardsafe checkpoint only)."""

    def __init__(self, *args: Any, checkpoint_timeout: float | None = None, hf_weights: bool = True, **kwargs: Any):
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None:  # before the Trainer's own set-up (push_to_hub would reach the Hub at once)
            _refuse(given)
        super().__init__(*args, **kwargs)
        self.checkpoint_timeout = checkpoint_timeout
        self.hf_weights = bool(hf_weights)
        trainer: Any = self
        _refuse(trainer.args)
        if trainer.is_deepspeed_enabled:
            raise InvalidArgumentError(_DEEPSPEED)

    # ------------------------------------------------------------------------------------ save

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """(every rank) One shardsafe checkpoint ``<output_dir>/checkpoint-<global_step>`` (module docstring),
        then the rotation of ``save_total_limit`` (main process, after the commit)."""
        t: Any = self
        folder = f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}"
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_dir = t._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)
        strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        if t.args.save_strategy in strategies and t.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.best_global_step}")
            if t.state.best_global_step == t.state.global_step or os.path.exists(best):  # this save, or committed
                t.state.best_model_checkpoint = best
        if t.args.should_save:
            _record_callbacks(t)
        state: dict[str, Any] = {"model": t.model}
        if not t.args.save_only_model:
            state["optimizer"] = getattr(t.optimizer, "optimizer", t.optimizer)
            if t.lr_scheduler is not None:
                state["scheduler"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = shardsafe.RNGState()

        def write_files(into: str) -> None:  # the main process: what the Trainer reads by path, committed
            t.state.save_to_json(os.path.join(into, TRAINER_STATE))
            if self.hf_weights and not (t.is_fsdp_enabled or t.is_distributed_loading_by_transformers):
                t._save(into)

        if t.args.should_save and is_checkpoint(output_dir):
            # A checkpoint of this step from a run beyond the point this one resumed from (the stock Trainer
            # writes over it): side files cannot replace a committed checkpoint's, so it goes first.
            logger.warning("shardsafe: %s exists (a run past this one's resume point): replacing it", output_dir)
            shardsafe.delete(output_dir)
        shardsafe.save(
            output_dir,
            state,
            timeout=self.checkpoint_timeout,
            metadata={"step": int(t.state.global_step)},
            write_files=write_files if t.args.should_save else None,
        )
        if t.args.should_save:
            _rotate(run_dir, t.args.save_total_limit, t.state.best_model_checkpoint)

    # ------------------------------------------------------------------------------------ resume

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest intact ``checkpoint-N``, and a
        shardsafe checkpoint's ``trainer_state.json`` is checked against its manifest before the Trainer reads it."""
        t: Any = self
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_checkpoint(t.args.output_dir)
            if resume_from_checkpoint is None:
                raise InvalidArgumentError(f"No valid checkpoint found in output directory ({t.args.output_dir})")
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and is_checkpoint(os.fspath(resume_from_checkpoint)):
            shardsafe.read_file(resume_from_checkpoint, TRAINER_STATE)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """A shardsafe checkpoint's model is loaded with its optimizer, after the model is prepared
        (:meth:`_load_optimizer_and_scheduler`): one read; a stock folder loads the stock way."""
        if not is_checkpoint(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """(every rank) Load the model, optimizer, scheduler and scaler of a shardsafe checkpoint, in place,
        every byte verified, into the prepared objects (any saved world size: they reshard)."""
        if checkpoint is None or not is_checkpoint(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        t: Any = self
        saved = {e.name for e in shardsafe.inspect(checkpoint).entries}
        state: dict[str, Any] = {"model": t.model}
        if "optimizer" in saved:
            state["optimizer"] = getattr(t.optimizer, "optimizer", t.optimizer)
        if "scheduler" in saved and t.lr_scheduler is not None:
            state["scheduler"] = t.lr_scheduler
        scaler = getattr(t.accelerator, "scaler", None)
        if "scaler" in saved and scaler is not None:
            state["scaler"] = scaler
        if "optimizer" not in saved:
            logger.warning("shardsafe: %s holds no optimizer (save_only_model): the model alone is loaded", checkpoint)
        try:
            shardsafe.load(checkpoint, state, timeout=self.checkpoint_timeout, rest="none")
        except StateMismatchError as err:  # refused before anything changed
            if t.is_fsdp_enabled or not hasattr(t.model, "load_state_dict"):
                raise
            # A model whose tensors change shape as it trains (a buffer that grows): its own load_state_dict,
            # as the stock Trainer calls it, gets the saved tensors (read whole, verified), then the in-place load.
            logger.warning("shardsafe: %s: %s; the model loads through its own load_state_dict first", checkpoint, err)
            saved_model = shardsafe.load(checkpoint, {}, timeout=self.checkpoint_timeout, rest="all")["model"]
            t.model.load_state_dict(saved_model)
            shardsafe.load(checkpoint, state, timeout=self.checkpoint_timeout, rest="none")

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_checkpoint(checkpoint):
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """(every rank) This rank's random generators, where the resumed epoch starts; saved on another number
        of ranks (or with ``save_only_model``) they stay as they are, with a WARNING."""
        if checkpoint is None or not is_checkpoint(checkpoint):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        if "rng" not in {e.name for e in shardsafe.inspect(checkpoint).entries}:
            logger.warning("shardsafe: %s holds no random generators (save_only_model): left as they are", checkpoint)
            return
        shardsafe.load(checkpoint, {"rng": shardsafe.RNGState()}, timeout=self.checkpoint_timeout, rest="none")

    def _load_best_model(self) -> None:
        t: Any = self
        best = t.state.best_model_checkpoint
        if best is None or not is_checkpoint(best):
            super()._load_best_model()  # type: ignore[misc]
            return
        logger.info("Loading best model from %s (score: %s).", best, t.state.best_metric)
        shardsafe.load(best, {"model": t.model_wrapped if t.is_fsdp_enabled else t.model}, rest="none")


_DEEPSPEED = (
    "shardsafe.transformers does not support DeepSpeed: its engine writes and reads its own checkpoints "
    "(model_wrapped.save_checkpoint), which shardsafe cannot make all-or-nothing or verify; use FSDP "
    "(fsdp=..., FSDP2 with fsdp_config={'fsdp_version': 2}) or transformers.Trainer"
)


def _refuse(args: Any) -> None:
    """Raise :class:`InvalidArgumentError` for the training arguments this Trainer cannot honour."""
    if getattr(args, "deepspeed", None):
        raise InvalidArgumentError(_DEEPSPEED)
    if getattr(args, "push_to_hub", False):
        raise InvalidArgumentError(
            "shardsafe.transformers does not support push_to_hub=True: it uploads the stock files of each "
            "checkpoint folder; export a checkpoint (shardsafe.export_hf) and push that, or use transformers.Trainer"
        )
    if getattr(args, "save_on_each_node", False):
        raise InvalidArgumentError(
            "shardsafe.transformers does not support save_on_each_node=True: a shardsafe checkpoint is one folder "
            "that every rank writes its share to (a shared filesystem or an object store)"
        )


class Trainer(CheckpointMixin, transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints are shardsafe checkpoints (module docstring)."""


def _record_callbacks(t: Any) -> None:
    """(main process) The states of the stateful callbacks and of ``TrainerControl`` into ``t.state``, as the
    stock Trainer records them before it writes ``trainer_state.json``."""
    from transformers.trainer_callback import ExportableState

    for cb in [c for c in [*t.callback_handler.callbacks, t.control] if isinstance(c, ExportableState)]:
        name = cb.__class__.__name__
        if isinstance(t.state.stateful_callbacks[name], list):
            t.state.stateful_callbacks[name].append(cb.state())
        else:
            t.state.stateful_callbacks[name] = cb.state()


def _numbered(run_dir: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), os.path.join(run_dir, n)) for n in names if (m := _NUMBERED.match(n)))


def last_checkpoint(run_dir: str) -> str | None:
    """(every rank, local) The newest ``checkpoint-N`` under ``run_dir`` to resume from: a shardsafe checkpoint
    whose manifest validates and whose ``trainer_state.json`` checks, or a stock Trainer folder (its
    ``trainer_state.json`` there); newer ones that are neither are skipped with a WARNING (a crashed save, a
    damaged checkpoint). ``None`` when there is none."""
    for _, path in reversed(_numbered(run_dir)):
        if is_checkpoint(path):
            try:
                shardsafe.read_file(path, TRAINER_STATE)
                return path
            except (CorruptCheckpointError, CheckpointNotFoundError, KeyError) as err:
                logger.warning("shardsafe: not resuming from %s: %s", path, err)
        elif os.path.isfile(os.path.join(path, TRAINER_STATE)) and not os.path.exists(os.path.join(path, _TOMBSTONE)):
            return path  # a folder of the stock Trainer
        else:
            logger.warning("shardsafe: not resuming from %s: no committed checkpoint there", path)
    return None


def _rotate(run_dir: str, limit: int | None, best: str | None) -> None:
    """(main process, after a commit) Keep at most ``limit`` committed ``checkpoint-N`` (the newest and the best
    always), deleting the oldest others through :func:`shardsafe.delete`, and finish deletions a crash
    interrupted; a stock Trainer folder is left alone (logged)."""
    if limit is None or limit <= 0:
        return
    numbered = [path for _, path in _numbered(run_dir)]
    committed = [p for p in numbered if is_checkpoint(p)]
    protected = set(committed[-1:]) | ({os.path.normpath(best)} if best else set())
    keep = max(limit, len(protected & {os.path.normpath(p) for p in committed}))
    doomed = []
    left = len(committed)
    for path in committed:
        if left <= keep:
            break
        if os.path.normpath(path) not in protected:
            doomed.append(path)
            left -= 1
    doomed += [p for p in numbered if not is_checkpoint(p) and os.path.exists(os.path.join(p, _TOMBSTONE))]
    for path in doomed:
        logger.info("Deleting older checkpoint [%s] due to args.save_total_limit", path)
        try:
            shardsafe.delete(path)
        except shardsafe.CheckpointError as err:
            logger.error("shardsafe: could not delete %s (save_total_limit=%d): %s", path, limit, err)
