"""shardsafe.verify has one deadline from the call to every wait (``timeout=``, default
``SHARDSAFE_IO_TIMEOUT`` as a load's): a read that never returns, of a data file or of the manifest,
raises CheckpointTimeoutError at that deadline, and the process then exits (the stuck read is left on a
daemon thread). Before, verify took no timeout and waited for a hung read for ever."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hung_reads import run, script

HUNG = script(
    """
    path = sys.argv[1]
    shardsafe.save(path, {"w": torch.arange(1000.0)})
    LocalStorage.read_into = hung  # the data file's blocks
    t = time.monotonic()
    try:
        shardsafe.verify(path, timeout=1)
    except shardsafe.CheckpointError as err:
        print("DATA", type(err).__name__, round(time.monotonic() - t, 1), path in str(err), flush=True)
    LocalStorage.read_bytes = hung  # the manifest; the deadline from SHARDSAFE_IO_TIMEOUT (1 s here)
    t = time.monotonic()
    try:
        shardsafe.verify(path)
    except shardsafe.CheckpointError as err:
        print("MANIFEST", type(err).__name__, round(time.monotonic() - t, 1), flush=True)
    """
)


def test_a_hung_read_ends_verify_at_its_deadline_and_the_process_exits(tmp_path: Path) -> None:
    started = time.monotonic()
    env = {**os.environ, "SHARDSAFE_IO_TIMEOUT": "1"}
    done, lines = run(HUNG, str(tmp_path / "c"), env)
    took = time.monotonic() - started
    assert lines.get("DATA", [""])[0] == "CheckpointTimeoutError", (done.stdout, done.stderr[-2000:])
    assert lines["DATA"][2] == "True"  # the message names the checkpoint
    assert lines.get("MANIFEST", [""])[0] == "CheckpointTimeoutError", (done.stdout, done.stderr[-2000:])
    assert float(lines["DATA"][1]) < 20 and float(lines["MANIFEST"][1]) < 20, lines
    assert done.returncode == 0, done.stderr[-2000:]
    assert took < 60, f"the process took {took:.0f}s to end after verify raised: a reader thread held it"


HUNG_RESUME = script(
    """
    manager = shardsafe.CheckpointManager(sys.argv[1], timeout=3)
    manager.save(1, {"w": torch.arange(1000.0)})
    LocalStorage.read_into = hung
    t = time.monotonic()
    try:
        manager.resume({"w": torch.zeros(1000)}, verify=True)
    except shardsafe.CheckpointError as err:
        print("RESUME", type(err).__name__, round(time.monotonic() - t, 1), flush=True)
    """
)


def test_a_resume_that_verifies_ends_at_its_deadline_when_a_read_hangs(tmp_path: Path) -> None:
    """The manager's resume verifies each candidate within what is left of its one deadline (it gave the
    verify none of it: a hung read waited for SHARDSAFE_IO_TIMEOUT, 1,800 s)."""
    done, lines = run(HUNG_RESUME, str(tmp_path / "run"))
    assert lines.get("RESUME", [""])[0] == "CheckpointTimeoutError", (done.stdout, done.stderr[-2000:])
    assert float(lines["RESUME"][1]) < 20, lines
    assert done.returncode == 0, done.stderr[-2000:]


HUNG_MANIFEST = script(
    """
    path = sys.argv[1]
    shardsafe.save(path, {"w": torch.arange(10.0)}, files={"notes.txt": b"hi"})
    LocalStorage.read_bytes = hung
    for name, call in (("INSPECT", lambda: shardsafe.inspect(path, timeout=1)),
                       ("READ_FILE", lambda: shardsafe.read_file(path, "notes.txt", timeout=1))):
        t = time.monotonic()
        try:
            call()
        except shardsafe.CheckpointError as err:
            print(name, type(err).__name__, round(time.monotonic() - t, 1), flush=True)
    """
)


def test_inspect_and_read_file_end_at_their_deadline_when_a_read_hangs(tmp_path: Path) -> None:
    """inspect() and read_file() have one deadline too (``timeout=``, default SHARDSAFE_IO_TIMEOUT): a
    manifest read that never returns raises CheckpointTimeoutError at it (both waited for ever)."""
    done, lines = run(HUNG_MANIFEST, str(tmp_path / "c"))
    for name in ("INSPECT", "READ_FILE"):
        assert lines.get(name, [""])[0] == "CheckpointTimeoutError", (done.stdout, done.stderr[-2000:])
        assert float(lines[name][1]) < 20, lines
    assert done.returncode == 0, done.stderr[-2000:]
