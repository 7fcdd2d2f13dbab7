"""Interop with the rest of the ecosystem: export a checkpoint in the Hugging Face layout (or as one
``torch.save`` file), import ``torch.save`` files, DCP folders and Hugging Face safetensors exports,
read as hostile input. docs/interop.md describes both.

The public names are imported on first use, so that the ``shardsafe`` command can build its parser from
:mod:`shardsafe.cli.interop` without importing torch.

Layer: may import engine, format, storage, knobs, errors; imported by the public package and the CLI."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardsafe.interop.hf import ExportResult, export_hf
    from shardsafe.interop.importer import ImportResult, import_checkpoint
    from shardsafe.interop.torchfile import export_torch

_LAZY: dict[str, str] = {
    "ExportResult": "shardsafe.interop.hf",
    "export_hf": "shardsafe.interop.hf",
    "ImportResult": "shardsafe.interop.importer",
    "import_checkpoint": "shardsafe.interop.importer",
    "export_torch": "shardsafe.interop.torchfile",
}

__all__ = ["ExportResult", "ImportResult", "export_hf", "export_torch", "import_checkpoint"]


def __getattr__(name: str) -> Any:
    """The public names on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardsafe.interop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
