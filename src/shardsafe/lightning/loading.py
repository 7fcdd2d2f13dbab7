"""A LightningModule (or LightningDataModule) built from a shardsafe checkpoint in one plain process:
:func:`load_from_checkpoint`, and :class:`ShardsafeCheckpointMixin`, which makes
``ModelClass.load_from_checkpoint(path)`` do the same for a class that mixes it in (Lightning's own reads a
``torch.save`` file through ``torch.load``, with no place for a library to plug another format in).

The module is made from the saved hyperparameters (updated with the keyword arguments given, filtered by
the class's ``__init__`` unless it takes ``**kwargs``), its ``configure_model()`` runs when it has one, its
``on_load_checkpoint(checkpoint)`` sees every saved entry but the weights, then the weights are loaded into
it in place: whole tensors, reassembled from the shards of any saved world size and strategy; nothing else
(optimizer state stays on disk, unread).
"""

from __future__ import annotations

import inspect as _inspect
import logging
import os
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch

from shardsafe.coord.resolve import SOLO
from shardsafe.engine import api
from shardsafe.errors import CheckpointError, InvalidArgumentError, InvalidTypeError, MissingKeysError
from shardsafe.integration import refuse_pickle_file
from shardsafe.lightning.checkpoint import MODULE_KEY, RNG_KEY

logger = logging.getLogger(__name__)

__all__ = ["ShardsafeCheckpointMixin", "latest_checkpoint", "load_from_checkpoint"]

T = TypeVar("T", "pl.LightningModule", "pl.LightningDataModule")


def load_from_checkpoint(
    cls: type[T],
    checkpoint_path: str | os.PathLike[str],
    map_location: str | torch.device | None = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    **kwargs: Any,
) -> T:
    """(one process, no rendezvous, also inside a distributed job) ``cls`` built from the shardsafe checkpoint at
    ``checkpoint_path`` and its weights loaded in place (module docstring), as Lightning's
    ``cls.load_from_checkpoint`` does for a ``torch.save`` file. ``kwargs`` override saved hyperparameters;
    ``hparams_file`` (``.yaml``/``.csv``) replaces them; ``strict`` (default: the module's ``strict_loading``)
    as in :func:`shardsafe.load`; ``map_location``: a device the module is moved to after the load;
    ``allow_pickle``: accept values a save with ``checkpoint_allow_pickle=True`` pickled."""
    path = os.fspath(checkpoint_path)
    refuse_pickle_file(path)
    if map_location is not None and not isinstance(map_location, (str, torch.device)):
        raise InvalidTypeError(
            f"map_location={map_location!r}: give a device (str or torch.device) to move the module to; shardsafe "
            "loads tensors on the CPU and never runs torch.load, so a mapping or a callable has nothing to apply to"
        )
    info = api.inspect(path, storage_options=storage_options)
    kinds = {e.name: e.kind for e in info.entries if e.kind != "tensor"}
    # the small entries, read whole: a value some ranks kept per rank comes back as {rank: value}
    rest = api.load(path, {}, group=SOLO, storage_options=storage_options, allow_pickle=allow_pickle, rest="values")
    checkpoint: dict[str, Any] = {k: rest[k] for k in rest if k != RNG_KEY}
    if hparams_file is not None:
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = _hparams_from(hparams_file)
    hparams = dict(checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {})
    hparams.update(kwargs)
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = hparams
    obj = _build(cls, checkpoint, kwargs)
    if isinstance(obj, pl.LightningDataModule):
        saved = checkpoint.get(type(obj).__qualname__)
        if saved is not None:
            obj.load_state_dict(saved)
        return obj
    assert isinstance(obj, pl.LightningModule)
    if MODULE_KEY not in kinds:
        raise MissingKeysError(
            f"{path} holds no model weights ('state_dict'): it is not a Lightning checkpoint saved through "
            f"shardsafe.lightning (it holds {sorted(kinds)}). Load it with shardsafe.load(path).",
            [MODULE_KEY],
            sorted(kinds),
        )
    if obj._strict_loading is not None and strict is not None and strict != obj.strict_loading:
        raise InvalidArgumentError(
            f"load_from_checkpoint(..., strict={strict!r}) conflicts with {cls.__name__}.strict_loading="
            f"{obj.strict_loading!r}; give the same value for both"
        )
    strict = obj.strict_loading if strict is None else strict
    if type(obj).configure_model is not pl.LightningModule.configure_model:
        obj.configure_model()
    obj.on_load_checkpoint(checkpoint)
    api.load(
        path,
        {MODULE_KEY: obj},
        strict=strict,
        group=SOLO,
        storage_options=storage_options,
        allow_pickle=allow_pickle,
        rest="none",
    )
    return obj.to(map_location) if map_location is not None else obj


def _hparams_from(hparams_file: str | os.PathLike[str]) -> Any:
    from lightning.pytorch.core.saving import load_hparams_from_tags_csv, load_hparams_from_yaml

    name = os.fspath(hparams_file)
    if name.lower().endswith(".csv"):
        return load_hparams_from_tags_csv(name)
    if name.lower().endswith((".yml", ".yaml")):
        return load_hparams_from_yaml(name)
    raise InvalidArgumentError(f"hparams_file={os.fspath(hparams_file)!r}: give a .csv, .yml or .yaml file")


def _build(cls: type[T], checkpoint: dict[str, Any], overrides: dict[str, Any]) -> T:
    """``cls`` made from the saved hyperparameters (``overrides`` win), keeping only what its ``__init__``
    takes unless it takes ``**kwargs``; with ``save_hyperparameters`` of one named argument (Lightning's
    ``hparams_name``), the hyperparameters are that argument."""
    params = _inspect.signature(cls.__init__).parameters
    named = [
        n
        for n, p in list(params.items())[1:]
        if p.kind not in (_inspect.Parameter.VAR_POSITIONAL, _inspect.Parameter.VAR_KEYWORD)
    ]
    any_keyword = any(p.kind is _inspect.Parameter.VAR_KEYWORD for p in params.values())
    saved = dict(checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY])
    for internal in ("_instantiator", "_class_path"):  # LightningCLI's: this function builds cls itself
        if saved.pop(internal, None) is not None:
            logger.debug("shardsafe: load_from_checkpoint: ignoring the saved %s; building %s", internal, cls.__name__)
    as_one = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
    args: dict[str, Any] = {as_one: saved} if isinstance(as_one, str) and as_one in named else saved
    args.update(overrides)
    if not any_keyword:
        args = {k: v for k, v in args.items() if k in named}
    return cls(**args)


class ShardsafeCheckpointMixin:
    """Mixed in before ``LightningModule`` (``class MyModel(ShardsafeCheckpointMixin, L.LightningModule)``):
    ``MyModel.load_from_checkpoint(path)`` reads a shardsafe checkpoint (a folder, or a URL) with
    :func:`load_from_checkpoint`, and anything else as Lightning does."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, (str, os.PathLike)):
            p = os.fspath(checkpoint_path)
            if "://" in p or os.path.isdir(p):
                return load_from_checkpoint(cls, p, *args, **kwargs)  # type: ignore[type-var]
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]


def latest_checkpoint(dirpath: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> str | None:
    """(any process) The committed checkpoint in ``dirpath`` (e.g. ``ModelCheckpoint``'s folder) with the highest
    training step its save recorded, for ``trainer.fit(model, ckpt_path=latest_checkpoint(dirpath))``; ``None``
    when there is none. Symbolic links (``save_last="link"``) and folders without a manifest (a save or a
    delete that a crash interrupted) are left out; a manifest that does not validate is skipped with a
    WARNING. After a crash during a rotation this is the newest intact checkpoint, which ``ckpt_path="last"``
    may not be (Lightning saves the top-k checkpoint of a step before ``last.ckpt``)."""
    from shardsafe.storage import get_storage, is_remote

    root = os.fspath(dirpath)
    storage = get_storage(root, storage_options)
    if not storage.is_dir(root):
        return None
    best: tuple[int, float, str] | None = None
    for name in storage.list_dir(root):
        path = storage.join(root, name)
        if name.startswith(".") or (not is_remote(root) and os.path.islink(path)):
            continue
        if not storage.exists(storage.join(path, "MANIFEST.json")):
            continue
        try:
            info = api.inspect(path, storage_options=storage_options)
        except CheckpointError as err:
            logger.warning("shardsafe: latest_checkpoint: skipping %s: %s", path, err)
            continue
        meta = info.metadata if isinstance(info.metadata, dict) else {}
        step = meta.get("step")
        key = (step if isinstance(step, int) else -1, info.created, path)
        if best is None or key > best:
            best = key
    return None if best is None else best[2]
