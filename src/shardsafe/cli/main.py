"""The ``shardsafe`` command (also ``python -m shardsafe``). Runs in one process and talks to no other
rank: it only reads checkpoints.

- ``shardsafe inspect PATH [--json]``: what a checkpoint holds, from its manifest alone.
- ``shardsafe verify PATH``: every byte of every data file checked against its checksum.
- ``shardsafe ls ROOT [--verify] [--json]``: the checkpoints under a directory, with their status.
- ``shardsafe export CKPT OUT`` / ``shardsafe import SRC DEST``: see :mod:`shardsafe.cli.interop`.

Exit status: 0 when all is well, 1 when a checkpoint is corrupt, incomplete (uncommitted) or not
there, 2 for a usage error. A reader that goes away (``shardsafe inspect CKPT | head -1``) is no failure.

Torch and the rest of the library are imported inside the commands that need them, so ``--help`` and
``--version`` answer at once, and so does a read-only command given a local path where nothing is (a
typo): it is said before anything heavy is imported (importing torch takes seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

from shardsafe.cli.interop import add_commands as add_interop_commands
from shardsafe.cli.interop import run as run_interop
from shardsafe.cli.status import EXIT_BAD, EXIT_OK, EXIT_USAGE
from shardsafe.display import exact_size, table
from shardsafe.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardsafe.progress.bar import command_bar as bar
from shardsafe.version import __version__

# What a command may raise for a bad, missing or unreachable checkpoint besides a CheckpointError
# (reported, exit 1): a store that cannot be reached, a missing optional package.
_REPORTED = (OSError, ImportError)


def _path(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the path is empty")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="Inspect, verify and list shardsafe checkpoints; export them to the Hugging Face layout "
        "or a torch.save file; import torch.save files and DCP checkpoints.",
        epilog="Exit status: 0 fine, 1 corrupt, incomplete or missing checkpoint, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"shardsafe {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    inspect = commands.add_parser(
        "inspect", help="show what a checkpoint holds (reads only MANIFEST.json)", description=_doc("inspect")
    )
    inspect.add_argument("path", type=_path, metavar="PATH", help="checkpoint directory or URL (s3://...)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    verify = commands.add_parser(
        "verify", help="check every byte of a checkpoint against its checksums", description=_doc("verify")
    )
    verify.add_argument("path", type=_path, metavar="PATH", help="checkpoint directory or URL (s3://...)")

    ls = commands.add_parser("ls", help="list the checkpoints under a directory", description=_doc("ls"))
    ls.add_argument("root", type=_path, metavar="ROOT", help="directory (or URL) that holds checkpoints")
    ls.add_argument("--verify", action="store_true", help="also verify every committed checkpoint byte for byte")
    ls.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_interop_commands(commands)
    return parser


def _doc(command: str) -> str:
    return {
        "inspect": "Print a checkpoint's format version, save time, world size, strategy and size, and a table "
        "of its entries (name, kind, dtype, global shape, chunks, bytes). Reads only MANIFEST.json.",
        "verify": "Read every data file of a checkpoint and check it against the checksums in its manifest. "
        "Prints one line: a summary, or the error naming the file and tensor. Exit 0 intact, 1 corrupt, "
        "uncommitted or missing. On a terminal a progress bar on stderr shows the bytes verified.",
        "ls": "List the checkpoints under ROOT with status (committed, incomplete, corrupt), step, time, size "
        "and metrics. With --verify, exit 1 if any is not intact; on a terminal a progress bar on stderr shows "
        "each checkpoint's verification.",
    }[command]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardsafe`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status.
    A failure of any kind is one line on stderr and exit status 1, never a traceback. A closed stdout
    (the reader of a pipe went away, as ``head`` does once it has its lines) ends the command quietly
    with the status it had reached (0 unless it had already found a failure)."""
    code = EXIT_OK
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
    except BrokenPipeError:
        _discard_stdout()
    return code


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # argparse exits on --help, --version and usage errors
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    try:
        return _run(args)
    except BrokenPipeError:
        raise
    except Exception as err:  # whatever a damaged checkpoint provokes: reported, never a traceback
        return _fail(args.command, err)


def _discard_stdout() -> None:
    """Point stdout's descriptor at the null device, so that what is still buffered (flushed again at
    exit) goes nowhere instead of raising once more."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's buffer): nothing is flushed at exit
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _run(args: argparse.Namespace) -> int:
    early = _nothing_there(args)
    if early is not None:
        return early
    if args.command == "inspect":
        return _inspect(args.path, as_json=args.json, out=sys.stdout)
    if args.command == "verify":
        return _verify(args.path, out=sys.stdout)
    if args.command in ("export", "import"):
        return run_interop(args, sys.stdout)
    from shardsafe.cli.ls import ls_main  # the manager is not needed by inspect/verify

    return ls_main(
        args.root, verify=args.verify, as_json=args.json, out=sys.stdout, progress=lambda name: bar(f"verify {name}")
    )


def _nothing_there(args: argparse.Namespace) -> int | None:
    """(inspect, verify, ls of a local path) The answer for a path where nothing is, or that ``ls`` cannot
    list, in the words the library would use, without importing it; ``None`` when there is something to
    read."""
    if args.command in ("inspect", "verify") and "://" not in args.path and not os.path.lexists(args.path):
        return _fail(args.command, CheckpointNotFoundError(NOTHING_THERE.format(path=args.path)))
    if args.command == "ls" and "://" not in args.root and not os.path.isdir(args.root):
        what = "does not exist" if not os.path.lexists(args.root) else "is not a directory"
        print(f"shardsafe ls: {args.root!r} {what}; give the directory that holds the checkpoints", file=sys.stderr)
        return EXIT_USAGE
    return None


NOTHING_THERE = "no checkpoint at {path}: nothing is there; check the path"
"""What the library says of a path where nothing is (catalog/not_found.py; a test keeps the two alike)."""


def _fail(command: str, err: BaseException) -> int:
    if isinstance(err, CorruptCheckpointError):
        what = "CORRUPT"
    elif isinstance(err, (CheckpointNotFoundError, FileNotFoundError, NotADirectoryError)):
        what = "NOT A CHECKPOINT"
    else:
        what = f"ERROR ({type(err).__name__})"
    print(_one_line(f"shardsafe {command}: {what}: {err}"), file=sys.stderr)
    return EXIT_BAD


def _one_line(text: str) -> str:
    """``text`` on one line of printable characters: line breaks become `` | ``, other control
    characters (a hostile name may hold terminal escapes) their escape sequence."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    joined = " | ".join(lines)
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in joined)


def _verify(path: str, *, out: TextIO) -> int:
    """Verify ``path`` byte for byte; one line on ``out`` when intact, else one on stderr."""
    from shardsafe.engine.api import verify

    try:
        summary = verify(path, progress=bar())
    except (CheckpointError, *_REPORTED) as err:
        return _fail("verify", err)
    side = f", {summary.side_files} side file(s)" if summary.side_files else ""
    out.write(
        f"OK {path}: {summary.files} data file(s), {summary.tensors} tensor(s){side}, {exact_size(summary.bytes)} "
        "verified\n"
    )
    return EXIT_OK


def _inspect(path: str, *, as_json: bool, out: TextIO) -> int:
    """Describe ``path`` from its manifest: a JSON object, or header lines and a table of entries."""
    from shardsafe.engine.api import inspect

    try:
        info = inspect(path)
    except (CheckpointError, *_REPORTED) as err:
        return _fail("inspect", err)
    if as_json:
        doc = asdict(info)
        doc["metadata"] = _jsonable(info.metadata)
        json.dump(doc, out, indent=2, allow_nan=False)
        out.write("\n")
        return EXIT_OK
    created = datetime.datetime.fromtimestamp(info.created).astimezone().isoformat(timespec="seconds")
    library = ", ".join(f"{k} {v}" for k, v in sorted(info.library.items())) or "-"
    header = [
        ("checkpoint", info.path),
        ("format version", str(info.format_version)),
        ("save id", info.save_id),
        ("created", created),
        ("world size", str(info.world_size)),
        ("strategy", info.strategy),
        ("total size", f"{exact_size(info.total_bytes)} in {len(info.files)} data file(s)"),
        ("written by", library),
        ("metadata", _short(info.metadata)),
    ]
    if info.bases:  # an incremental checkpoint: the rest of its data lives in these siblings
        header.append(("refers to", f"{', '.join(info.bases)} ({exact_size(info.referenced_bytes)} of their files)"))
    for label, value in header:
        out.write(f"{label + ':':<16}{value}\n")
    out.write("\n")
    rows = [("NAME", "KIND", "DTYPE", "SHAPE", "CHUNKS", "BYTES")]
    for e in info.entries:
        if e.kind == "tensor":
            shape = "[" + ", ".join(map(str, e.shape or ())) + "]"
            rows.append((e.name, e.kind, e.dtype or "-", shape, str(e.chunks), str(e.nbytes)))
        else:
            rows.append((e.name, e.kind, "-", "-", "-", "-"))
    for name, size in info.side_files.items():  # files of their own names beside the data (format v3)
        rows.append((name, "side file", "-", "-", "-", str(size)))
    out.write("\n".join(table(rows, right=(4, 5))) + "\n")
    return EXIT_OK


def _short(value: Any, limit: int = 200) -> str:
    text = "-" if value is None else json.dumps(_jsonable(value), allow_nan=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON for display: tuples become lists, dict keys strings, non-finite floats
    the strings ``"nan"``/``"inf"``/``"-inf"``, anything else JSON cannot hold its ``repr``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
