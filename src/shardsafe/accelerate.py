"""Hugging Face Accelerate's ``Accelerator`` whose ``save_state`` and ``load_state`` go through shardsafe
(docs/huggingface.md). ``from shardsafe.accelerate import Accelerator`` is the only change to a script.

``accelerator.save_state(dir)`` is one :func:`shardsafe.save` on every rank: the models as prepared (DDP,
FSDP1, FSDP2: each rank writes its share, nothing is gathered), the optimizers, schedulers, gradient scaler,
the objects given to ``register_for_checkpointing``, each prepared dataloader's position (its epoch counter, a
seedable sampler's seed, a stateful dataloader's state: per rank), every rank's random generators
(:class:`shardsafe.RNGState`) and ``accelerator.step``; committed all-or-nothing, checksummed, pickle-free.
What the save-state pre-hooks write into the folder they are given is committed with the checkpoint as side
files, and ``load_state`` hands the load-state pre-hooks the committed folder after checking those files.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` checkpoints go to
``<project_dir>/checkpoints/checkpoint_<N>``; ``total_limit`` is applied after the new checkpoint is committed
(rank 0, :func:`shardsafe.delete`, oldest first), and ``load_state()`` without a folder loads the newest
checkpoint there that is committed and intact, skipping newer damaged or uncommitted ones with a WARNING.

Refused when the ``Accelerator`` is made (:class:`~shardsafe.InvalidArgumentError`): DeepSpeed and Megatron-LM,
whose engines save and load their own checkpoints. A ``save_state`` that some ranks never call (under
``if accelerator.is_main_process:``) raises :class:`~shardsafe.RankTimeoutError` naming them within
``checkpoint_timeout`` and commits nothing.

This module imports ``accelerate``; ``import shardsafe`` does not (install ``shardsafe[accelerate]``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Mapping
from typing import Any

import accelerate
import torch
from accelerate.data_loader import SeedableRandomSampler
from accelerate.utils import DistributedType

import shardsafe
from shardsafe import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    MissingKeysError,
)

__all__ = ["Accelerator"]

logger = logging.getLogger(__name__)

CHECKPOINT = re.compile(r"^checkpoint_(\d+)$")
_TOMBSTONE = ".MANIFEST.json.deleting"
"""The manifest of a checkpoint being deleted, set aside (docs/format.md, section 7)."""
"""The folders automatic checkpoint naming makes under ``<project_dir>/checkpoints``."""

_REFUSED = {
    DistributedType.DEEPSPEED: (
        "DeepSpeed: its engine saves and loads its own checkpoints (model.save_checkpoint), which shardsafe "
        "cannot make all-or-nothing or verify; use accelerate.Accelerator with DeepSpeed, or FSDP (FSDP2: "
        "fsdp_version=2) with this one"
    ),
    DistributedType.MEGATRON_LM: (
        "Megatron-LM: its engine saves and loads its own checkpoints (model.save_checkpoint); use "
        "accelerate.Accelerator with Megatron-LM, or FSDP with this one"
    ),
}


class Accelerator(accelerate.Accelerator):  # type: ignore[misc]  # (Accelerate is not type-checked here)
    """``accelerate.Accelerator`` with shardsafe checkpoints (module docstring, docs/huggingface.md). Takes
    Accelerate's arguments, plus ``checkpoint_timeout``: the seconds every checkpoint wait may take (ranks
    arriving, writes, the commit); default ``SHARDSAFE_TIMEOUT`` / ``SHARDSAFE_IO_TIMEOUT``."""

    def __init__(self, *args: Any, checkpoint_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        why = _REFUSED.get(self.distributed_type)
        if why is not None:
            raise InvalidArgumentError(f"shardsafe.accelerate.Accelerator does not support {why}")
        self.checkpoint_timeout = checkpoint_timeout

    # ------------------------------------------------------------------------------------ save

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """(every rank) Save the training state as one shardsafe checkpoint at ``output_dir`` (with automatic
        naming: ``<project_dir>/checkpoints/checkpoint_<iteration>``) and return its path. A committed
        checkpoint there is replaced atomically (refused when the hooks write files: side files cannot replace
        a committed checkpoint's). ``safe_serialization`` has no effect: nothing is ever pickled. Keyword
        arguments for DeepSpeed's ``save_checkpoint`` are refused (there is no such engine here)."""
        if kwargs:
            raise InvalidArgumentError(
                f"save_state() got {sorted(kwargs)}: keyword arguments of DeepSpeed's save_checkpoint, which "
                "shardsafe.accelerate.Accelerator does not use"
            )
        config = self.project_configuration
        root = os.path.join(self.project_dir, "checkpoints") if config.automatic_checkpoint_naming else None
        if root is not None:
            output_dir = os.path.join(root, f"checkpoint_{self.save_iteration}")
            if os.path.exists(output_dir):
                raise InvalidArgumentError(
                    f"Checkpoint directory {output_dir} ({self.save_iteration}) already exists. Please manually "
                    "override `self.save_iteration` with what iteration to start with."
                )
        if output_dir is None:
            raise InvalidArgumentError(
                "save_state() needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)"
            )
        path = os.fspath(output_dir)
        logger.info("Saving current state to %s", path)
        with shardsafe.side_files_folder() as folder:  # this rank's, for the hooks; removed through the gate
            kept = self._run_save_hooks(folder)
            files, write_files = kept.side_files(self.is_main_process, path)
            shardsafe.save(
                path,
                self._state(kept.models),
                overwrite=True,
                timeout=self.checkpoint_timeout,
                metadata={"step": self.save_iteration, "accelerator_step": self.step},
                files=files,
                write_files=write_files,
            )
        config.iteration += 1
        if root is not None and config.total_limit is not None and self.is_main_process:
            _rotate(root, config.total_limit)
        return path

    def _run_save_hooks(self, folder: str) -> _HookOutput:
        """(every rank) Call the save-state pre-hooks as Accelerate does, ``hook(models, weights, folder)``,
        with ``folder``, a fresh local folder of this rank's own; which models they left in ``weights`` are
        saved."""
        fsdp = self.distributed_type == DistributedType.FSDP or self.is_fsdp2
        # As Accelerate: FSDP models are not in ``weights``; the others' state dicts are, taken as they are
        # (references, never a gathered copy: Accelerate's get_state_dict would gather an FSDP2 model).
        weights = [] if fsdp else [m.state_dict() for m in self._models]
        before = list(weights)
        out = _HookOutput(folder, list(enumerate(self._models)))
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, weights, folder)
        if not fsdp:  # a hook that took a model's weights out of the list saves that model itself
            out.models = [(i, m) for (i, m), w in zip(out.models, before, strict=True) if any(w is x for x in weights)]
        return out

    def _state(self, models: list[tuple[int, torch.nn.Module]]) -> dict[str, Any]:
        """The state one save writes and one load fills, in place."""
        state: dict[str, Any] = {_key("model", i): m for i, m in models}
        for i, opt in enumerate(self._optimizers):
            state[_key("optimizer", i)] = getattr(opt, "optimizer", opt)
        for i, sched in enumerate(self._schedulers):
            state[_key("scheduler", i)] = getattr(sched, "scheduler", sched)
        for i, loader in enumerate(self._dataloaders):
            state[_key("dataloader", i)] = shardsafe.per_rank(_LoaderPosition(loader))
        if self.scaler is not None:
            state["scaler"] = self.scaler
        for i, obj in enumerate(self._custom_objects):
            state[f"custom_{i}"] = obj
        state["rng"] = shardsafe.RNGState()
        state["step"] = self.step
        return state

    # ------------------------------------------------------------------------------------ load

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """(every rank) Load a checkpoint of :meth:`save_state` into the prepared objects, in place, every byte
        verified. Without ``input_dir`` (automatic naming): the newest committed and intact
        ``checkpoint_<N>``; newer damaged or uncommitted ones are skipped with a WARNING. Saved on another
        number of ranks: models, optimizers, schedulers and registered objects reshard and load; the random
        generators and dataloader positions, which belong to the saving ranks, stay as they are (WARNING).
        ``map_location`` (``"cpu"``, ``"on_device"``) is checked and has no other effect: state is loaded into
        the prepared objects where they are. ``strict`` (default True) applies to every entry."""
        map_location = load_model_func_kwargs.pop("map_location", None)
        if map_location not in (None, "cpu", "on_device"):
            raise InvalidTypeError(
                "Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or `'on_device'`"
            )
        strict = bool(load_model_func_kwargs.pop("strict", True))
        unknown = sorted(load_model_func_kwargs) + sorted(load_kwargs or {})
        if unknown:
            raise InvalidArgumentError(
                f"load_state() got {unknown}, which shardsafe.accelerate.Accelerator does not use (it loads "
                "every entry in place, verified; strict= is the one option)"
            )
        if input_dir is not None:
            self._load_from(os.fspath(os.path.expanduser(input_dir)), strict)
            return
        if not self.project_configuration.automatic_checkpoint_naming:
            raise InvalidArgumentError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        candidates = _numbered(root)
        for name in reversed(candidates):
            path = os.path.join(root, name)
            try:
                self._load_from(path, strict)
                return
            except (CorruptCheckpointError, CheckpointNotFoundError) as err:
                logger.warning("shardsafe: skipping %s, not an intact committed checkpoint: %s", path, err)
        raise CheckpointNotFoundError(
            f"no intact committed checkpoint under {root} (checked {', '.join(candidates) or 'none'}); "
            "pass input_dir= to load another one"
        )

    def _load_from(self, path: str, strict: bool) -> None:
        """(every rank) Load the checkpoint at ``path``: its side files checked, the load-state pre-hooks
        called with it, then one :func:`shardsafe.load` of the models the hooks left in the list."""
        logger.info("Loading states from %s", path)
        info = shardsafe.inspect(path, storage_options=None)
        for name in info.side_files:  # read by path by the hooks: checked first
            shardsafe.read_file(path, name)
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, path)
        kept = [(i, m) for i, m in enumerate(self._models) if any(m is x for x in models)]
        state = self._state(kept)
        if info.world_size != self.num_processes:
            for key in [k for k in state if k.startswith("dataloader")]:
                logger.warning(
                    "shardsafe: %s was saved by %d rank(s) and this load runs on %d: the position of %s is left "
                    "as it is",
                    path,
                    info.world_size,
                    self.num_processes,
                    key,
                )
                del state[key]
        if self.scaler is not None and self.is_fsdp2:  # as Accelerate: the scaler is ready before the optimizer
            shardsafe.load(path, {"scaler": self.scaler}, strict=strict, timeout=self.checkpoint_timeout)
            self.scaler._lazy_init_scale_growth_tracker(self.scaler._device)
            del state["scaler"]
        try:
            shardsafe.load(path, state, strict=strict, timeout=self.checkpoint_timeout, rest="none")
        except MissingKeysError as err:
            raise MissingKeysError(
                f"{err} (the prepared models, optimizers, schedulers, dataloaders and registered objects must be "
                "those of the save, in the same order)",
                err.missing,
                err.available,
            ) from err
        self.step = int(state["step"])


def _key(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


class _HookOutput:
    """What the save-state pre-hooks left: the models still to save and the files in this rank's folder."""

    def __init__(self, folder: str, models: list[tuple[int, torch.nn.Module]]) -> None:
        self.folder = folder
        self.models = models

    def side_files(self, main: bool, path: str) -> tuple[dict[str, bytes] | None, Callable[[str], None] | None]:
        """(files=, write_files=) of the save of ``path``: on the main process the folder's files are copied
        into the checkpoint (``write_files``, streamed; plain files only, else :class:`InvalidArgumentError`);
        on the others their bytes are compared with the main process's (``files=``: the same name must hold the
        same bytes). The folder is :func:`shardsafe.side_files_folder`'s, removed when the save returns."""
        names = sorted(os.listdir(self.folder))
        if not names:
            return None, None
        if main:

            def copy(into: str) -> None:
                if os.path.islink(self.folder):
                    raise InvalidArgumentError(
                        f"save_state({path!r}): a save-state hook replaced its folder {self.folder} with a "
                        "symbolic link; nothing is read, moved or deleted through it. Write the files into the "
                        "folder the hook is given"
                    )
                for name in names:
                    where = os.path.join(self.folder, name)
                    if not stat.S_ISREG(os.lstat(where).st_mode):
                        raise InvalidArgumentError(
                            f"save_state({path!r}): a save-state hook left {where}, not a plain file (a folder or "
                            "a link); the hooks' files are committed as side files, which are plain files only"
                        )
                    shutil.copyfile(where, os.path.join(into, name), follow_symlinks=False)

            return None, copy
        files: dict[str, bytes] = {}
        for name in names:
            where = os.path.join(self.folder, name)
            if os.path.isfile(where) and not os.path.islink(where):
                with open(where, "rb") as f:
                    files[name] = f.read()
            else:
                logger.warning("shardsafe: a save-state hook left %s, not a plain file: not compared", where)
        return files, None


class _LoaderPosition:
    """Where a prepared dataloader is (kept per rank): its epoch counter (``iteration``, which seeds a
    seedable sampler's order), the seed of such a sampler, and a stateful dataloader's own state."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def _sampler(self) -> SeedableRandomSampler | None:
        get = getattr(self.loader, "get_sampler", None)
        sampler = get() if get is not None else None
        return sampler if isinstance(sampler, SeedableRandomSampler) else None

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"iteration": int(getattr(self.loader, "iteration", 0))}
        sampler = self._sampler()
        if sampler is not None:
            out["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
        if getattr(self.loader, "use_stateful_dataloader", False):
            out["loader"] = self.loader.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = int(state["iteration"])
        sampler = self._sampler()
        if sampler is not None and "sampler" in state:
            sampler.epoch = int(state["sampler"]["epoch"])
            sampler.initial_seed = int(state["sampler"]["initial_seed"])
        if "loader" in state and getattr(self.loader, "use_stateful_dataloader", False):
            self.loader.load_state_dict(state["loader"])


def _numbered(root: str) -> list[str]:
    """The ``checkpoint_<N>`` folders under ``root``, by N, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := CHECKPOINT.match(n))]
    return [n for _, n in sorted(found)]


def _rotate(root: str, limit: int) -> None:
    """(main process, after a commit) Delete the oldest committed ``checkpoint_<N>`` under ``root`` until
    ``limit`` are left, each through :func:`shardsafe.delete` (the newest one, just committed, is never among
    them), and finish the deletions a crash interrupted (a tombstone, no manifest); anything else is left alone."""
    numbered = _numbered(root)
    committed = [n for n in numbered if os.path.exists(os.path.join(root, n, "MANIFEST.json"))]
    doomed = committed[: max(0, len(committed) - max(limit, 1))]
    # a deletion a crash interrupted (its tombstone, docs/format.md section 7) is finished the same way
    doomed += [n for n in numbered if n not in committed and os.path.exists(os.path.join(root, n, _TOMBSTONE))]
    if doomed:
        logger.warning("Deleting %d checkpoints to make room for new checkpoint.", len(doomed))
    for name in doomed:
        try:
            shardsafe.delete(os.path.join(root, name))
        except shardsafe.CheckpointError as err:
            logger.error("shardsafe: could not delete %s (total_limit=%d): %s", os.path.join(root, name), limit, err)
