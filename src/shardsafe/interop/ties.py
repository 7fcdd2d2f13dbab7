"""The model a ``config.json`` describes, as ``transformers`` builds it: its tied weights and the names
of its weights.

A checkpoint does not record that two parameters were one tensor (``lm_head.weight`` and
``transformer.wte.weight`` of GPT-2 are saved as two tensors with equal bytes), and equal bytes alone
prove nothing (every LayerNorm bias of an untrained model is zeros). So the model's own declaration is
asked: the class named in the config's ``architectures`` is built on the meta device (no memory, no
weights), its parameters are grouped by identity, and ``transformers``' own
``remove_tied_weights_from_state_dict`` says which names ``save_pretrained`` leaves out. A name is
then left out of the export only if its bytes also equal the kept tensor's. The same model's state dict
names are what ``from_pretrained`` looks for (interop/names.py checks an export's names against them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What ``from_pretrained`` of the config's class expects."""

    arch: str  # the class, e.g. GPT2LMHeadModel
    names: frozenset[str]  # its state dict's names
    base_prefix: str  # ``base_model_prefix`` (``transformer``): from_pretrained adds or strips it
    ties: dict[str, str] = field(default_factory=dict)  # left-out name -> kept name, as save_pretrained


def declared_ties(config: Mapping[str, Any]) -> dict[str, str] | None:
    """``{left-out name: kept name}`` for the model ``config`` describes (a ``config.json`` document), or
    ``None`` (with a warning saying why) when it cannot be told (see :func:`describe_model`)."""
    info = describe_model(config)
    return None if info is None else info.ties


def describe_model(config: Mapping[str, Any]) -> ModelInfo | None:
    """The model ``config`` describes, built on the meta device (no memory, no weights), or ``None``
    (with a warning saying why) when it cannot be told: no ``transformers``, no single
    ``architectures`` entry naming a ``transformers`` model class, or the class fails to build."""
    archs = config.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        logger.warning(
            "shardsafe export: the config has no single 'architectures' entry (save_pretrained writes one), so "
            "tied weights cannot be identified; every tensor is written (from_pretrained ties them again)"
        )
        return None
    try:
        import transformers
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError as err:
        logger.warning("shardsafe export: transformers is not importable (%s); every tensor is written", err)
        return None
    cls = getattr(transformers, archs[0], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        logger.warning(
            "shardsafe export: %r is not a transformers model class; every tensor is written (tied weights "
            "cannot be identified)",
            archs[0],
        )
        return None
    try:
        config_class = cls.config_class
        if config_class is None:
            _unknown(archs[0], "it has no config class")
            return None
        model_config = config_class.from_dict(dict(config))
        with torch.device("meta"):
            model = cls(model_config)
        state = model.state_dict()
        kept = remove_tied_weights_from_state_dict(dict(state), model)
    except Exception as err:  # a config this transformers cannot build: fall back to writing every tensor
        logger.warning(
            "shardsafe export: could not build %s from the config to find its tied weights (%s: %s); every "
            "tensor is written",
            archs[0],
            type(err).__name__,
            err,
        )
        return None
    owners: dict[int, str] = {}
    for name in state:
        if name in kept:
            owners.setdefault(id(model.get_parameter_or_buffer(name)), name)
    ties: dict[str, str] = {}
    for name in state:
        if name not in kept:
            source = owners.get(id(model.get_parameter_or_buffer(name)))
            if source is not None:
                ties[name] = source
    prefix = getattr(model, "base_model_prefix", "")
    return ModelInfo(archs[0], frozenset(state), prefix if isinstance(prefix, str) else "", ties)


def _unknown(arch: str, why: str) -> None:
    logger.warning(
        "shardsafe export: could not build %s from the config (%s); every tensor is written and names are not checked",
        arch,
        why,
    )
