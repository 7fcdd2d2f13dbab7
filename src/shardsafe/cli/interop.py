"""The ``shardsafe export`` and ``shardsafe import`` commands (wired into :mod:`shardsafe.cli.main`).

Exit status: 0 done; 1 the source is corrupt, missing or unreadable, or the target is refused (nothing
changed); 2 a usage error, or a source that would need unpickling without ``--allow-pickle``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from shardsafe.cli.status import EXIT_BAD, EXIT_OK, EXIT_USAGE
from shardsafe.display import one_line
from shardsafe.errors import CheckpointError, InvalidArgumentError, UnsafeValueError
from shardsafe.progress.bar import command_bar as bar

EXPORT_DOC = (
    "Write one entry of a shardsafe checkpoint (any saved world size) in the Hugging Face layout: "
    "model.safetensors, or model-0000X-of-0000N.safetensors shards plus model.safetensors.index.json, "
    "streamed tensor by tensor with every byte verified; or, with --format torch, as one torch.save file. "
    "OUT appears whole or not at all; it must be absent, empty, or a previous export (replaced with --overwrite). "
    "On a terminal a progress bar shows the export."
)
IMPORT_DOC = (
    "Save a torch.save file or a DCP checkpoint folder as a shardsafe checkpoint, then verify it. torch.save "
    "files are read with weights_only=True; a DCP folder's metadata is a pickle, so it needs --allow-pickle "
    "(exit 2 without it). On a terminal a progress bar shows the save."
)
_HF_OPTIONS = ("max_shard_size", "config", "tied", "strip_prefix", "overwrite")
"""The ``export`` flags passed on, by the same names, to :func:`~shardsafe.interop.hf.export_hf`."""


def add_commands(commands: Any) -> None:
    """Add ``export`` and ``import`` to the ``shardsafe`` command's subparsers."""
    export = commands.add_parser("export", help="write a checkpoint in the Hugging Face layout", description=EXPORT_DOC)
    export.add_argument("checkpoint", metavar="CKPT", help="shardsafe checkpoint directory or URL (s3://...)")
    export.add_argument("out", metavar="OUT", help="export directory (--format hf) or file (--format torch)")
    export.add_argument(
        "--format",
        choices=("hf", "torch", "shardsafe"),
        default="hf",
        help="output layout (default hf; shardsafe: a self-contained copy of an incremental checkpoint)",
    )
    export.add_argument("--key", help="checkpoint entry to export (default: its one module; a/b goes inside; / all)")
    export.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="convert floating tensors")
    export.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB; e.g. 500MB, 2GiB)")
    export.add_argument("--config", help="the model's config.json (or its folder): copied in; identifies tied weights")
    export.add_argument(
        "--tied", choices=("auto", "keep"), default="auto", help="keep: write tied weights twice (default auto)"
    )
    export.add_argument("--strip-prefix", help="remove this prefix from every tensor name (e.g. model.)")
    export.add_argument("--overwrite", action="store_true", help="replace a previous export at OUT")
    export.add_argument("--allow-pickle", action="store_true", help="--format torch: decode pickled values")
    imp = commands.add_parser("import", help="bring a torch.save file or DCP folder in", description=IMPORT_DOC)
    imp.add_argument("source", metavar="SRC", help="a torch.save file or a DCP checkpoint folder")
    imp.add_argument("dest", metavar="DEST", help="the new shardsafe checkpoint")
    imp.add_argument("--allow-pickle", action="store_true", help="unpickle the source (runs its code: trusted only)")
    imp.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DEST")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``export`` or ``import`` with parsed ``args``; one line on ``out``, or one on stderr."""
    try:
        return _export(args, out) if args.command == "export" else _import(args, out)
    except BrokenPipeError:  # stdout's reader went away: the command's own business (shardsafe.cli.main)
        raise
    except UnsafeValueError as err:
        return _fail(args.command, "REFUSED", err, EXIT_USAGE)
    except ValueError as err:
        return _fail(args.command, "USAGE", err, EXIT_USAGE)
    except (CheckpointError, OSError, ImportError) as err:
        return _fail(args.command, f"ERROR ({type(err).__name__})", err, EXIT_BAD)


def _fail(command: str, what: str, err: BaseException, code: int) -> int:
    print(one_line(f"shardsafe {command}: {what}: {as_flags(str(err))}"), file=sys.stderr)
    return code


_FLAGS = (("overwrite", "--overwrite"), ("allow_pickle", "--allow-pickle"))


def as_flags(text: str) -> str:
    """A library message as the command says it: the keyword arguments it names become the command's
    flags (``pass overwrite=True`` -> ``pass --overwrite``; ``allow_pickle=True (--allow-pickle)`` ->
    ``--allow-pickle``)."""
    for keyword, flag in _FLAGS:
        text = text.replace(f"{keyword}=True ({flag})", flag).replace(f"{keyword}=True", flag)
        text = text.replace(f"{keyword}= ", f"{flag} ").replace(f"{keyword}=", flag)
    return text


def _export(args: argparse.Namespace, out: TextIO) -> int:
    from shardsafe.interop.hf import export_hf
    from shardsafe.interop.torchfile import export_torch

    only = {"torch": ("allow_pickle",), "hf": ("config", "strip_prefix", "overwrite")}
    for fmt, flags in only.items():
        for flag in flags:
            if fmt != args.format and getattr(args, flag):
                raise InvalidArgumentError(f"--{flag.replace('_', '-')} applies to --format {fmt} only")
    if args.format == "shardsafe":
        return _consolidate(args, out)
    if args.format == "torch":
        result = export_torch(
            args.checkpoint, args.out, key=args.key, dtype=args.dtype, allow_pickle=args.allow_pickle, progress=bar()
        )
    else:
        hf = {name: getattr(args, name) for name in _HF_OPTIONS}
        result = export_hf(args.checkpoint, args.out, key=args.key, dtype=args.dtype, progress=bar(), **hf)
    line = (
        f"OK {args.checkpoint} [{result.key}] -> {result.path}: {result.tensors} tensor(s), {result.bytes} bytes "
        f"in {len(result.files)} file(s)"
    )
    if result.tied:
        line += "; written once: " + ", ".join(f"{a} (tied to {b})" for a, b in result.tied.items())
    if result.skipped:
        line += "; not exported (not tensors): " + ", ".join(result.skipped[:10])
        line += ", ..." if len(result.skipped) > 10 else ""
    out.write(one_line(line) + "\n")
    return EXIT_OK


def _consolidate(args: argparse.Namespace, out: TextIO) -> int:
    from shardsafe.interop.consolidate import consolidate

    for flag in ("key", "dtype", "config", "strip_prefix", "overwrite", "allow_pickle"):
        if getattr(args, flag):
            raise InvalidArgumentError(
                f"--{flag.replace('_', '-')} does not apply to --format shardsafe (a whole, exact copy)"
            )
    result = consolidate(args.checkpoint, args.out, progress=bar())
    bases = f" (data of {', '.join(result.bases)} copied in)" if result.bases else ""
    out.write(
        one_line(
            f"OK {args.checkpoint} -> {result.path}: self-contained, {result.tensors} tensor(s), {result.bytes} bytes "
            f"in {len(result.files)} file(s){bases}"
        )
        + "\n"
    )
    return EXIT_OK


def _import(args: argparse.Namespace, out: TextIO) -> int:
    from shardsafe.interop.importer import WRAP_KEY, import_checkpoint

    result = import_checkpoint(
        args.source, args.dest, allow_pickle=args.allow_pickle, overwrite=args.overwrite, progress=bar()
    )
    entries = ", ".join(result.keys[:10]) + (", ..." if len(result.keys) > 10 else "")
    wrapped = f" (saved under {WRAP_KEY!r}: its keys are not plain strings)" if result.wrapped else ""
    out.write(
        one_line(
            f"OK {result.source} ({result.source_format}) -> {result.path}: {result.tensors} tensor(s), "
            f"{result.bytes} bytes verified; entries: {entries}{wrapped}"
        )
        + "\n"
    )
    return EXIT_OK
