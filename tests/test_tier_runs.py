"""Whose is a local-tier copy (docs/tiers.md, "Runs, saves and incarnations"): every share records the run
(an id the durable root keeps), the save and the incarnation it belongs to; a copy of another run never
counts and is never deleted; a step counts only when every rank's share comes from one save; node numbers
decide nothing about ownership; a resume that cannot delete a newer step goes on, with a warning; and a
local save that fails never costs the durable save due at the same step.

The single-process tests run a whole manager with one rank (one node, no replica); the multi-rank ones run
2 ranks as simulated nodes (``SHARDSAFE_NODE``)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe

from harness import check_ok, run_ranks


def _values(rank: int, step: int, tag: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * tag + 1000 * step + rank)
    return {"mine": torch.randn(16, generator=g)}


def _state(rank: int, step: int, tag: int) -> dict[str, Any]:
    return {"mine": _values(rank, step, tag)["mine"], "extra": {"step": step, "tag": tag}}


def _empty() -> dict[str, Any]:
    return {"mine": torch.zeros(16), "extra": {"step": -1, "tag": -1}}


def _exact(state: dict[str, Any], rank: int) -> bool:
    """Whether ``state`` holds exactly what the save it names (its step and tag) wrote for ``rank``."""
    step, tag = state["extra"]["step"], state["extra"]["tag"]
    return bool(torch.equal(state["mine"], _values(rank, step, tag)["mine"]))


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (links not followed) with its bytes."""
    out: dict[str, bytes] = {}
    for dirpath, _dirnames, filenames in os.walk(folder):
        for n in filenames:
            p = Path(dirpath) / n
            out[str(p.relative_to(folder))] = p.read_bytes() if p.is_file() and not p.is_symlink() else b"<other>"
    return out


def _manager(root: Path, local: str, *, keep: int = 2, every: int = 100) -> shardsafe.CheckpointManager:
    tier = shardsafe.LocalTier(local, every_n_steps=1, replicas=1, keep=keep)
    return shardsafe.CheckpointManager(str(root), every_n_steps=every, keep_last=3, local=tier, timeout=30)


def _train(root: Path, local: str, steps: range, tag: int) -> None:
    with _manager(root, local) as mgr:
        for step in steps:
            mgr.maybe_save(step, _state(0, step, tag))


# ------------------------------------------------------------------------------------------ runs


def test_a_new_run_neither_resumes_nor_replaces_nor_deletes_another_runs_shares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Run A saves local steps 1..4; run B, a new durable root and the same local path, starts from
    scratch (not from A's step 4), and its saves and retention leave every file of A's as it was, with a
    warning naming them; A requeued (its own durable root) still resumes its step 4."""
    monkeypatch.setenv("SHARDSAFE_NODE", "0")
    local = str(tmp_path / "local-{node}")
    _train(tmp_path / "run-a", local, range(1, 5), tag=1)
    a_files = _files(tmp_path / "local-0")
    assert a_files

    state = _empty()
    with caplog.at_level(logging.WARNING, logger="shardsafe"), _manager(tmp_path / "run-b", local) as mgr:
        assert mgr.resume(state) is None
        assert state["extra"] == {"step": -1, "tag": -1} and not state["mine"].any()
        for step in range(1, 4):
            mgr.maybe_save(step, _state(0, step, 2))
    after = _files(tmp_path / "local-0")
    changed = sorted(n for n, b in a_files.items() if after.get(n) != b)
    assert not changed, f"run B replaced or deleted run A's files: {changed}"
    assert "another run" in caplog.text and str(tmp_path / "local-0") in caplog.text

    for root, tag, step in ((tmp_path / "run-a", 1, 4), (tmp_path / "run-b", 2, 3)):
        state = _empty()
        with _manager(root, local) as mgr:
            assert mgr.resume(state) == step
        assert state["extra"] == {"step": step, "tag": tag} and _exact(state, 0), (root, state["extra"])


# ---------------------------------------------------------------------- one save, whatever the nodes


def _job(rank: int, world: int, root: str, local: str, tag: int, last: int) -> tuple[int | None, dict[str, Any], bool]:
    """Resume, then local saves up to step ``last`` with values of ``tag``; returns what resume loaded."""
    state = _empty()
    with _manager(Path(root), local) as mgr:
        step = mgr.resume(state)
        resumed = (step, dict(state["extra"]), step is None or _exact(state, rank))
        for s in range((step or 0) + 1, last + 1):
            mgr.maybe_save(s, _state(rank, s, tag))
    return resumed


def test_a_step_is_one_saves_on_every_rank_whatever_the_node_numbering(tmp_path: Path) -> None:
    """Job 1 (rank r on node r) saves steps 1..5; job 2 (node numbers swapped), then job 3 (both ranks on
    node 0) resume: each loads, on every rank, the values of one save of its step. Before, entries that no
    rank of job 2 owned under its mapping survived its resume, and job 3 loaded step 5 with rank 0's share
    from job 1 and rank 1's from job 2."""
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    jobs = [
        ({0: {"SHARDSAFE_NODE": "0"}, 1: {"SHARDSAFE_NODE": "1"}}, 1),
        ({0: {"SHARDSAFE_NODE": "1"}, 1: {"SHARDSAFE_NODE": "0"}}, 2),
        ({0: {"SHARDSAFE_NODE": "0"}, 1: {"SHARDSAFE_NODE": "0"}}, 3),
    ]
    seen = []
    for nodes, tag in jobs:
        out = check_ok(run_ranks(_job, 2, root, local, tag, 5, rank_env=nodes, timeout=120))
        steps = {o[0] for o in out}
        saves = {(o[1]["step"], o[1]["tag"]) for o in out}
        assert len(steps) == 1 and len(saves) == 1, f"job {tag}: the ranks resumed different saves: {out}"
        assert all(o[2] for o in out), f"job {tag}: a rank's values are not its save's: {out}"
        seen.append(out[0][:2])
    assert seen[2][0] == 5, seen  # job 2 went on to step 5, whichever step it resumed: job 3 finds it


# ------------------------------------------------------------------ links and undeletable newer steps


def _step_dirs(node: Path) -> list[Path]:
    return [p for p in node.rglob("step-*") if p.is_dir() and not p.is_symlink()]


def test_resume_never_deletes_through_a_step_folder_that_is_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``step-N`` entry of the node folder that links to a checkpoint elsewhere is neither loaded nor
    deleted through (before, resume dropped 'newer' steps through it, deleting the other checkpoint)."""
    monkeypatch.setenv("SHARDSAFE_NODE", "0")
    local = str(tmp_path / "local-{node}")
    _train(tmp_path / "durable", local, range(1, 4), tag=1)
    outside = tmp_path / "elsewhere"
    shardsafe.save(outside / "rank-00000", {"mine": torch.ones(16)}, metadata={"step": 99, "kept": True})
    kept = _files(outside)
    node = tmp_path / "local-0"
    real = _step_dirs(node)
    for where in {node, *(p.parent for p in real)}:
        (where / "step-00000099").symlink_to(outside, target_is_directory=True)
        twin = real[0].name.replace(real[0].name[5:13], "00000099", 1)
        if twin != "step-00000099":
            (where / twin).symlink_to(outside, target_is_directory=True)
    state = _empty()
    with _manager(tmp_path / "durable", local) as mgr:
        assert mgr.resume(state) == 3
    assert state["extra"] == {"step": 3, "tag": 1} and _exact(state, 0)
    assert _files(outside) == kept, "resume deleted or changed a checkpoint through a link"
    shardsafe.verify(outside / "rank-00000")


@pytest.mark.parametrize("damage", ["manifest", "tombstone-folder"])
def test_a_newer_step_that_cannot_be_deleted_is_skipped_with_a_warning_and_every_restart_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Step 3's share damaged so that it can neither be loaded nor deleted (a manifest that does not
    parse; a tombstone that is a folder, with a flipped data byte): resume loads step 2 and returns it,
    warning about step 3 by path, on every restart (before, each one raised after loading step 2); a new
    save of step 3 then commits and is resumed."""
    monkeypatch.setenv("SHARDSAFE_NODE", "0")
    local = str(tmp_path / "local-{node}")
    _train(tmp_path / "durable", local, range(1, 4), tag=1)
    share = next(d for d in _step_dirs(tmp_path / "local-0") if d.name.startswith("step-00000003")) / "rank-00000"
    if damage == "manifest":
        (share / "MANIFEST.json").write_text('{"format_version": 1, "this is": "not a manifest"')
    else:
        (share / ".MANIFEST.json.deleting").mkdir()
        (share / ".MANIFEST.json.deleting" / "x").write_text("x")
        data = next(p for p in share.iterdir() if p.name.startswith("data-"))
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    for _ in range(2):
        state = _empty()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardsafe"), _manager(tmp_path / "durable", local) as mgr:
            assert mgr.resume(state) == 2
        assert state["extra"] == {"step": 2, "tag": 1} and _exact(state, 0)
        assert str(share) in caplog.text, caplog.text
    with _manager(tmp_path / "durable", local) as mgr:
        assert mgr.resume(_empty()) == 2
        mgr.maybe_save(3, _state(0, 3, 2))
    state = _empty()
    with _manager(tmp_path / "durable", local) as mgr:
        assert mgr.resume(state) == 3
    assert state["extra"] == {"step": 3, "tag": 2} and _exact(state, 0)


# ----------------------------------------------------------------- a full local disk, the durable save


def _full_disk_on_node_1(rank: int, world: int, root: str, local: str) -> tuple[bool, list[str]]:
    """Rank 1's local disk is full from step 5 on (every write under its node folder fails with ENOSPC);
    ``maybe_save(5)`` is due in both tiers. Returns whether it returned, and the warnings logged."""
    from shardsafe.storage import local as local_storage

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("shardsafe").addHandler(handler)
    folder = os.path.abspath(local.replace("{node}", os.environ["SHARDSAFE_NODE"]))
    real_write = local_storage.LocalWriter.write

    def write(self: Any, data: memoryview) -> None:
        if rank == 1 and full and str(getattr(self, "path", "")).startswith(folder):
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        real_write(self, data)

    full = False
    local_storage.LocalWriter.write = write  # type: ignore[method-assign]
    with _manager(Path(root), local, every=5) as mgr:
        for step in range(1, 6):
            full = step == 5
            mgr.maybe_save(step, _state(rank, step, 1))
    logging.getLogger("shardsafe").removeHandler(handler)
    return True, records


def test_a_full_local_disk_on_one_node_never_skips_the_durable_save_due_at_that_step(tmp_path: Path) -> None:
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    nodes = {0: {"SHARDSAFE_NODE": "0"}, 1: {"SHARDSAFE_NODE": "1"}}
    out = check_ok(run_ranks(_full_disk_on_node_1, 2, root, local, rank_env=nodes, timeout=120))
    assert (tmp_path / "durable" / "step-00000005" / "MANIFEST.json").exists()
    loaded = shardsafe.load(tmp_path / "durable" / "step-00000005")
    assert loaded["extra"] == {"step": 5, "tag": 1}
    warned = [m for m in out[1][1] if "No space left" in m]
    assert warned, out[1][1]
    text = warned[0]
    assert "node 1" in text and str(tmp_path / "local-1") in text and "durable" in text, text
    rank0 = [m for m in out[0][1] if "rank 1" in m and "node 1" in m]
    assert rank0, out[0][1]


def test_a_job_that_saved_nothing_abandons_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job A saves local steps 1..3; job B never resumes (its state is from nowhere: its shares would
    abandon A's) and its first local save fails (a full disk); job C still resumes A's step 3. Before,
    B recorded its incarnation when its save began, and C started from scratch (the kill -9 rounds of
    tests/test_tiers.py found it: a kill between that record and the end of the save)."""
    from shardsafe.storage import local as local_storage

    monkeypatch.setenv("SHARDSAFE_NODE", "0")
    local = str(tmp_path / "local-{node}")
    _train(tmp_path / "durable", local, range(1, 4), tag=1)

    def full(self: Any, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", self.path)

    with monkeypatch.context() as m, _manager(tmp_path / "durable", local) as mgr:
        m.setattr(local_storage.LocalWriter, "write", lambda self, data: full(self, data))
        with pytest.raises(shardsafe.CheckpointError, match="No space left"):
            mgr.save_local(4, _state(0, 4, 2))
    state = _empty()
    with _manager(tmp_path / "durable", local) as mgr:
        assert mgr.resume(state) == 3
    assert state["extra"] == {"step": 3, "tag": 1} and _exact(state, 0)
