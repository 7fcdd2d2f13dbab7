"""Interop with the rest of the ecosystem: export a checkpoint in the Hugging Face layout (or as one
``torch.save`` file), import ``torch.save`` files, DCP folders and Hugging Face safetensors exports,
read as hostile input. docs/interop.md describes both.

Layer: may import engine, format, storage, knobs, errors; imported by the public package and the CLI."""

from shardsafe.interop.hf import ExportResult, export_hf
from shardsafe.interop.importer import ImportResult, import_checkpoint
from shardsafe.interop.torchfile import export_torch

__all__ = ["ExportResult", "ImportResult", "export_hf", "export_torch", "import_checkpoint"]
