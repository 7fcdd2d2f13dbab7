"""Every error shardsafe raises on purpose is a CheckpointError, defined in shardsafe.errors, and also the
builtin it resembles, so both ``except CheckpointError`` and ``except TimeoutError`` (etc.) catch it."""

from __future__ import annotations

import ast
import builtins
import inspect
import re
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import errors
from shardsafe.manager import CheckpointManager

SRC = Path(__file__).resolve().parent.parent / "src" / "shardsafe"

# Deliberate raises of a builtin that stay builtin, each with its reason. Every one is either caught
# and turned into a CheckpointError next to where it is raised, or is a signal that mimics the
# standard library on purpose.
ALLOWED_BUILTIN_RAISES = {
    ("format/values.py", "TypeError"): "malformed typed-JSON field; _decode_node turns it into CorruptCheckpointError",
    ("format/values.py", "ValueError"): "malformed typed-JSON field; _decode_node turns it into CorruptCheckpointError",
    ("format/jsontext.py", "ValueError"): "json.loads hook; the caller turns it into CorruptCheckpointError",
    ("format/datafile.py", "NotImplementedError"): "big-endian hosts: the platform, not the call, is unsupported",
    # Inside the save pipeline, below the engine: SaveJob._wrap turns these into a CheckpointError that
    # names the path, the rank and the phase (a CheckpointError would pass through without that context).
    ("format/datafile.py", "RuntimeError"): "byte count off the plan; wrapped by the save with its phase",
    ("format/datafile.py", "ValueError"): "internal precondition; wrapped by the save with its phase",
    # A builtin TimeoutError never reaches a caller: the save turns it into a CheckpointTimeoutError
    # (commit._publish for the publish, failures.wrap for a rank's own failure, guard.mapped for any
    # other; test_a_builtin_timeout_reaches_the_caller_as_a_checkpoint_timeout_error checks the last two).
    (
        "engine/commit.py",
        "TimeoutError",
    ): "publish called off at the deadline; raised by _publish as CheckpointTimeoutError",
    ("storage/uploads.py", "TimeoutError"): "an upload part past its deadline; failures.wrap: CheckpointTimeoutError",
    ("storage/uploads.py", "OSError"): "more parts than S3 allows; wrapped by the save",
    ("storage/uploads.py", "ValueError"): "writer used after close; wrapped by the save",
    ("storage/remote.py", "OSError"): "a batch delete that failed for some objects, like os; callers catch OSError",
    ("catalog/delete.py", "ValueError"): "a name shardsafe did not write: refused; callers catch ValueError",
    ("catalog/unlink.py", "ValueError"): "a name shardsafe did not write: refused; callers catch ValueError",
    ("catalog/publish.py", "ValueError"): "an export file name that is not a new plain name; the export maps it",
    ("catalog/publish.py", "OSError"): "an export's file that is not a regular file, like os; the export abandons",
    ("runtime/launch.py", "TypeError"): "an unpicklable worker result/exception; caught and reported as WorkerError",
    ("runtime/strategies.py", "AssertionError"): "unreachable branch",
    ("manager/listing.py", "AssertionError"): "unreachable branch",
    ("interop/ties.py", "TypeError"): "caught at once: falls back to writing every tensor",
    ("storage/remote.py", "FileNotFoundError"): "mtime() of nothing, like os.stat; callers catch it",
    # The storage interface speaks like ``os`` (its contract in storage/base.py); the engine maps these
    # (EOFError -> CorruptCheckpointError in engine/guard.py, FileExistsError -> CheckpointExistsError).
    ("storage/local.py", "EOFError"): "a truncated file, like os; mapped by the engine",
    ("storage/local.py", "FileExistsError"): "a checkpoint committed meanwhile, like os; mapped by the engine",
    ("storage/local.py", "NotADirectoryError"): "the target is a file, like os; mapped by the engine",
    ("storage/remote.py", "EOFError"): "a truncated object, like os; mapped by the engine",
    ("storage/remote.py", "FileExistsError"): "an object is there already, like os; mapped by the engine",
    ("storage/fsspec_util.py", "ImportError"): "fsspec/s3fs not installed: the message names the extra to install",
    ("storage/remote.py", "ImportError"): "fsspec/s3fs not installed: the message names the extra to install",
    ("fabric.py", "NotImplementedError"): "Lightning's own contract for an unsupported load_raw target",
    ("state/rest.py", "KeyError"): "the dict protocol of load's remainder, for a key the checkpoint does not hold",
    # A module's __getattr__ (PEP 562: public names imported on first use) must raise AttributeError
    # for a name it does not have, or hasattr(), getattr(..., default) and `from X import name` break.
    ("__init__.py", "AttributeError"): "module __getattr__ protocol (PEP 562)",
    ("interop/__init__.py", "AttributeError"): "module __getattr__ protocol (PEP 562)",
}


def _builtin_raises() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                name = node.exc.func.id
                cls = getattr(builtins, name, None)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.add((rel, name))
    return found


def test_no_deliberate_raise_of_a_bare_builtin_outside_the_reasoned_list() -> None:
    unexplained = _builtin_raises() - set(ALLOWED_BUILTIN_RAISES)
    assert not unexplained, f"raise a CheckpointError subclass from shardsafe.errors instead: {sorted(unexplained)}"


def test_every_error_in_errors_derives_from_checkpoint_error_and_is_public() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]
    assert classes
    for cls in classes:
        assert issubclass(cls, errors.CheckpointError), cls
        assert cls.__name__ in errors.__all__ and getattr(shardsafe, cls.__name__) is cls


def test_runtime_and_remote_errors_are_checkpoint_errors() -> None:
    from shardsafe.runtime import LaunchError, WorkerError

    assert issubclass(LaunchError, RuntimeError) and issubclass(LaunchError, errors.CheckpointError)
    assert issubclass(WorkerError, errors.CheckpointError)
    assert issubclass(errors.RemoteIOError, OSError)


def test_save_handle_wait_timeout_is_a_checkpoint_error_and_a_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDSAFE_FAULT", "save.report:rank=0:sleep=1.5")
    handle = shardsafe.async_save(str(tmp_path / "ck"), {"w": torch.ones(4)})
    with pytest.raises(errors.CheckpointError, match="still running") as caught:
        handle.wait(timeout=0.05)
    assert isinstance(caught.value, TimeoutError)
    handle.wait()  # the save itself goes on and commits
    assert torch.equal(shardsafe.load(str(tmp_path / "ck"))["w"], torch.ones(4))


def test_closed_manager_raises_a_checkpoint_error_that_is_a_runtime_error(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.close()
    with pytest.raises(errors.ClosedError, match="is closed") as caught:
        mgr.save(1, {"w": torch.ones(2)})
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, errors.CheckpointError)


def test_bad_knob_value_is_an_invalid_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardsafe import knobs

    monkeypatch.setenv("SHARDSAFE_IO_THREADS", "many")
    with pytest.raises(errors.InvalidArgumentError, match="SHARDSAFE_IO_THREADS") as caught:
        knobs.io_threads()
    assert isinstance(caught.value, ValueError)


# ------------------------------------------------------------------------------- the closed set

# Public exception classes defined outside errors.py, each with its reason. A new one fails
# test_no_public_exception_class_outside_errors_py: define it in errors.py, in one remedy group.
ALLOWED_CLASSES_OUTSIDE = {
    ("runtime/errors.py", "LaunchError"): "the runtime's, off the top level (test_public_api); a UsageError",
    ("runtime/errors.py", "WorkerError"): "the runtime's, off the top level (test_public_api); a RetryableError",
    ("runtime/errors.py", "WorkerTraceback"): "never raised: the text of a worker's traceback, chained as __cause__",
    ("coord/faults.py", "InjectedFault"): "stands for a failing disk: it must take the path of a real OSError",
    ("storage/base.py", "PublishRefusedError"): "the storage interface speaks like os; the commit wraps it",
}
EXCEPTION_BASES = {
    n
    for n in dir(builtins)
    if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)
}


def _is_exception_base(base: ast.expr) -> bool:
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    return name in EXCEPTION_BASES or name.endswith(("Error", "Exception", "Fault", "Refused", "Malformed"))


def _exception_classes_outside_errors() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(_is_exception_base(b) for b in node.bases):
                found.add((rel, node.name))
    return found


def test_no_public_exception_class_outside_errors_py() -> None:
    public = {(rel, name) for rel, name in _exception_classes_outside_errors() if not name.startswith("_")}
    assert public - set(ALLOWED_CLASSES_OUTSIDE) == set(), "define it in shardsafe/errors.py, in one remedy group"
    assert set(ALLOWED_CLASSES_OUTSIDE) <= public, "an allowed class is gone: drop it from the list"


def test_no_bare_checkpoint_error_is_raised_or_built() -> None:
    """Every error names its remedy: a bare ``CheckpointError(...)`` (raised, or built to raise later)
    says only that something failed."""
    bare = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Name) and f.id == "CheckpointError") or (
                    isinstance(f, ast.Attribute) and f.attr == "CheckpointError"
                ):
                    bare.append(f"{rel}:{node.lineno}")
    assert not bare, f"raise the class of shardsafe.errors its remedy calls for instead: {bare}"


def _public_error_classes() -> list[type[BaseException]]:
    return [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]


def test_every_error_is_in_exactly_one_remedy_group() -> None:
    from shardsafe.coord.failures import _remote_class
    from shardsafe.runtime import LaunchError, WorkerError

    groups = errors.REMEDY_GROUPS
    assert {g.__name__ for g in groups} == {"UsageError", "UnusableCheckpointError", "RetryableError", "InternalError"}
    across = {errors.CheckpointError, errors.CoordinationError, errors.RemoteRankError}
    checked = [c for c in _public_error_classes() if c not in across] + [LaunchError, WorkerError]
    for cls in checked:
        assert [g.__name__ for g in groups if issubclass(cls, g)] and sum(issubclass(cls, g) for g in groups) == 1, cls
    # another rank's error is also an instance of the class that rank raised: of that class's group only
    for cls in checked:
        if not issubclass(cls, errors.CoordinationError):
            remote = _remote_class(cls.__name__)
            assert issubclass(remote, errors.RemoteRankError) and issubclass(remote, cls)
            assert sum(issubclass(remote, g) for g in groups) == 1, cls
    # a foreign error of another rank: of the class that rank wraps it into (wrap), hence of its group
    assert issubclass(_remote_class("PermissionError"), errors.UnforeseenError)
    assert issubclass(_remote_class("TimeoutError"), errors.CheckpointTimeoutError)
    # the builtin bases the existing except clauses rely on
    assert issubclass(errors.CheckpointTimeoutError, TimeoutError)
    assert issubclass(errors.RankTimeoutError, errors.CheckpointTimeoutError)
    assert issubclass(errors.OperationTimeoutError, errors.CheckpointTimeoutError)
    assert issubclass(errors.BaseRefusedError, ValueError) and issubclass(LaunchError, RuntimeError)
    assert issubclass(errors.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(errors.CheckpointExistsError, FileExistsError)


def test_the_old_names_are_the_same_classes() -> None:
    from shardsafe.engine import incremental

    assert incremental.BaseRefusedError is errors.BaseRefusedError is shardsafe.BaseRefusedError


def test_every_error_is_in_the_docs_table() -> None:
    doc = (SRC.parent.parent / "docs" / "faults.md").read_text()
    table = doc.split("## The errors, by remedy", 1)[1].split("\n## ", 1)[0]
    for cls in [*_public_error_classes(), *errors.REMEDY_GROUPS]:
        assert f"`{cls.__name__}`" in table, cls.__name__


def test_a_builtin_timeout_reaches_the_caller_as_a_checkpoint_timeout_error() -> None:
    from shardsafe.coord import failures
    from shardsafe.engine import guard

    mapped = guard.mapped("load", "/x", TimeoutError("the storage did not answer"), reads=True)
    assert isinstance(mapped, errors.CheckpointTimeoutError) and "the storage did not answer" in str(mapped)
    wrapped = failures.wrap(TimeoutError("an upload part"), op="save", target="/x", rank=1, phase="write")
    assert isinstance(wrapped, errors.CheckpointTimeoutError) and "rank 1" in str(wrapped)
    other = failures.wrap(ValueError("boom"), op="save", target="/x", rank=1, phase="write")
    assert isinstance(other, errors.UnforeseenError) and not isinstance(other, TimeoutError)


def test_an_import_that_outlives_its_timeout_raises_a_checkpoint_timeout_error() -> None:
    import threading

    from shardsafe.interop import importer

    release = threading.Event()
    try:
        with pytest.raises(errors.CheckpointTimeoutError, match="did not finish within") as caught:
            importer._deadline("src.pt", 0.05, lambda: release.wait(10))
        assert isinstance(caught.value, TimeoutError)
    finally:
        release.set()


_TIMEOUT_WORDS = re.compile(
    r"did not (finish|start|complete|answer) (within|in time)|deadline passed|timed out|still running\s+\{"
)


def _text(node: ast.AST) -> str:
    return " ".join(
        str(n.value) if isinstance(n, ast.Constant) else "{"
        for n in ast.walk(node)
        if isinstance(n, (ast.Constant, ast.FormattedValue))
    )


def test_every_error_that_says_a_deadline_passed_is_a_checkpoint_timeout_error() -> None:
    """One class to catch for every timeout: an error whose message says a wait ran out is a
    CheckpointTimeoutError (a bare CheckpointError or LaunchError saying so is not caught by it)."""
    from shardsafe.runtime import errors as runtime_errors

    wrong = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            cls = getattr(errors, name, None) or getattr(runtime_errors, name, None)
            timeout = isinstance(cls, type) and _TIMEOUT_WORDS.search(_text(node.exc))
            if timeout and not issubclass(cls, errors.CheckpointTimeoutError):  # type: ignore[arg-type]
                wrong.append(f"{rel}:{node.lineno} {name}")
    assert not wrong, f"raise CheckpointTimeoutError (or a subclass) for a timeout: {wrong}"
