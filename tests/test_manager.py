"""CheckpointManager: configuration, saving on a schedule agreed across ranks, retention on disk,
resuming from the newest valid checkpoint after crashes and corruption, leftovers, ``shardsafe ls``."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli.ls import ls_main
from shardsafe.errors import CorruptCheckpointError, MissingKeysError
from shardsafe.manager import CheckpointManager, ManagerConfig, NameTemplate
from shardsafe.manager.cleanup import apply_retention, delete_checkpoint
from shardsafe.manager.listing import CheckpointRecord
from shardsafe.manager.retention import RetentionPolicy
from shardsafe.storage.local import LocalStorage

from harness import check_ok, run_ranks

# --------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"keep_best": 2}, ["keep_best=2", "monitor="]),
        ({"monitor": "loss"}, ["monitor='loss'", "keep_best"]),
        ({"keep_last": 0}, ["keep_last=0", "keep_last=1"]),
        ({"every_n_steps": 0}, ["every_n_steps=0", "positive integer"]),
        ({"every_seconds": -1.0}, ["every_seconds=-1.0", "positive"]),
        ({"mode": "lowest"}, ["mode='lowest'", "'min'"]),
        ({"name": "ckpt"}, ["name='ckpt'", "{step}"]),
        ({"name": "a/{step}"}, ["'a/0'", "no '/'"]),
        ({"name": "{step:.2f}"}, ["integer format"]),
        ({"save_on_signals": (9,)}, ["SIGKILL", "cannot be caught"]),
        ({"timeout": 0}, ["timeout=0", "positive"]),
        ({"leftover_age": -5}, ["leftover_age=-5", "slowest save"]),
    ],
)
def test_config_rejects_bad_values_naming_field_and_fix(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ManagerConfig(root="/tmp/x", **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_name_template_round_trips_and_rejects_other_names() -> None:
    t = NameTemplate("step-{step:08d}")
    assert t.format(42) == "step-00000042"
    assert t.parse("step-00000042") == 42
    assert t.parse("step-42") is None  # not a name this template makes
    assert t.parse("other-00000042") is None
    assert NameTemplate("ep{step}").parse("ep7") == 7


# ------------------------------------------------------------------------------- helpers


def make_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(4, 3), "step": 0}


def weights(state: dict[str, Any]) -> list[float]:
    return [float(v) for v in state["model"].weight.detach().flatten()]


def data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.startswith("data-"))


def flip_last_byte(path: Path) -> None:
    f = data_files(path)[0]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.iterdir() if (p / "MANIFEST.json").exists())


# ------------------------------------------------------------------------ one process: on disk


def test_saves_on_interval_keeps_last_and_best_and_lists_metrics(tmp_path: Path) -> None:
    state = make_state()
    losses = {2: 0.1, 4: 0.5, 6: 0.4, 8: 0.3}
    with CheckpointManager(tmp_path, every_n_steps=2, keep_last=2, keep_best=1, monitor="loss") as mgr:
        saved = [s for s in range(1, 9) if mgr.maybe_save(s, state, metrics={"loss": losses.get(s, 9.0)})]
        assert saved == [2, 4, 6, 8]
        assert mgr.maybe_save(8, state) is False  # a step is saved once
        listed = mgr.list()
        latest = mgr.latest()
    assert [r.step for r in listed] == [2, 6, 8]  # best (2) + last two
    assert [r.metrics["loss"] for r in listed] == [0.1, 0.4, 0.3]
    assert all(r.status == "committed" and r.size > 0 and r.created for r in listed)
    assert latest is not None and latest.step == 8
    assert committed_steps(tmp_path) == [2, 6, 8]


def _committed(path: Path, step: int) -> CheckpointRecord:
    shardsafe.save(str(path), {"x": torch.arange(4.0), "step": step})
    return CheckpointRecord(path.name, str(path), "committed", step, 0.0, 1, target=path.name)


def test_delete_uncommits_first_and_removes_only_its_listed_data_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000001"
    record = _committed(ckpt, 1)
    (ckpt / "notes.txt").write_text("the user's")  # never written by shardsafe: stays
    calls: list[str] = []

    class Recording(LocalStorage):
        def retire_manifest(self, path: str, tombstone: str) -> None:
            calls.append(f"retire {tombstone}")
            super().retire_manifest(path, tombstone)

        def unlink_names(self, directory: str, names: list[str]) -> None:
            calls.append(
                f"unlink {[n.split('-')[0] for n in names]}, manifest there: {(ckpt / 'MANIFEST.json').exists()}"
            )
            super().unlink_names(directory, names)

    delete_checkpoint(Recording(), record)
    assert calls == [
        "retire .MANIFEST.json.deleting",
        "unlink ['data'], manifest there: False",
        "unlink ['.MANIFEST.json.deleting'], manifest there: False",
    ]
    assert sorted(os.listdir(ckpt)) == ["notes.txt"]


def test_a_failed_delete_is_logged_and_the_others_still_go(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = [_committed(tmp_path / f"step-{step}", step) for step in (1, 2, 3, 4)]

    class Flaky(LocalStorage):
        def unlink_names(self, directory: str, names: list[str]) -> None:
            if directory.endswith("step-1"):
                raise PermissionError(13, "Permission denied", directory)
            super().unlink_names(directory, names)

    with caplog.at_level(logging.ERROR, logger="shardsafe"):
        deleted = apply_retention(Flaky(), records, RetentionPolicy(keep_last=1))
    assert deleted == ["step-2", "step-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-4"]
    assert not (tmp_path / "step-1" / "MANIFEST.json").exists()  # no longer committed, whatever remains
    assert (tmp_path / "step-1" / ".MANIFEST.json.deleting").exists()  # the next cleanup finishes it
    assert "step-1" in caplog.text and "Permission denied" in caplog.text


def test_resume_falls_back_from_corrupt_newest_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = make_state(0)
    with CheckpointManager(tmp_path, every_n_steps=2, keep_last=2) as mgr:
        for step in (2, 4):
            with torch.no_grad():
                state["model"].weight.fill_(float(step))
            state["step"] = step
            mgr.maybe_save(step, state)
    flip_last_byte(tmp_path / "step-00000004")
    fresh = make_state(1)
    with caplog.at_level(logging.WARNING, logger="shardsafe"), CheckpointManager(tmp_path, keep_last=2) as mgr:
        assert mgr.resume(fresh) == 2
        # the damaged one counts toward no limit and stays for inspection; the one resumed from stays
        mgr.save(3, fresh)
        assert committed_steps(tmp_path) == [2, 3, 4]
        mgr.save(4, fresh)  # overwriting the damaged step makes it good again
        assert [r.step for r in mgr.list()] == [3, 4]
    assert fresh["step"] == 2 and weights(fresh) == [2.0] * 12
    warning = next(r.getMessage() for r in caplog.records if "resume skips" in r.getMessage())
    assert "step-00000004" in warning and "CorruptCheckpointError" in warning


def test_resume_with_every_checkpoint_damaged_raises(tmp_path: Path) -> None:
    state = make_state()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    flip_last_byte(tmp_path / "step-00000001")
    flip_last_byte(tmp_path / "step-00000002")
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError) as info:
        mgr.resume(make_state())
    assert "step-00000001" in str(info.value) and "step-00000002" in str(info.value)


def test_resume_does_not_hide_a_state_mismatch_behind_a_fallback(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, make_state())
        mgr.save(2, make_state())
        with pytest.raises(MissingKeysError):
            mgr.resume({**make_state(), "extra": torch.zeros(2)})
        assert mgr.resume({}) == 2  # the mismatch marked nothing as damaged
    assert CheckpointManager(tmp_path / "empty", save_on_signals=()).resume(make_state()) is None


def test_leftovers_of_crashed_saves_go_once_old_enough(tmp_path: Path) -> None:
    state = make_state()
    mgr = CheckpointManager(tmp_path, keep_last=None, leftover_age=60, save_on_signals=())
    mgr.save(1, state)
    old = time.time() - 3600

    def litter(path: Path, *, age: float | None) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        f = path / "data-00001-deadbeef.safetensors"
        f.write_bytes(b"partial")
        if age is not None:
            for p in (f, path):
                os.utime(p, (age, age))
        return path

    crashed_staging = litter(tmp_path / ".step-00000002.staging-deadbeef", age=old)
    running_staging = litter(tmp_path / ".step-00000003.staging-cafe", age=None)
    no_manifest = litter(tmp_path / "step-00000004", age=old)
    unrelated = litter(tmp_path / ".cache.staging-1", age=old)  # not this manager's naming
    orphan = tmp_path / "step-00000001" / "data-00001-0ld.safetensors"
    orphan.write_bytes(b"from an overwrite that crashed")
    os.utime(orphan, (old, old))
    mgr.save(5, state)
    mgr.close()
    assert not crashed_staging.exists() and not no_manifest.exists() and not orphan.exists()
    assert running_staging.exists() and unrelated.exists()
    assert committed_steps(tmp_path) == [1, 5]
    assert CheckpointManager(tmp_path, save_on_signals=()).resume(make_state()) == 5


def test_ls_lists_status_step_size_metrics_and_verifies(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, make_state(), metrics={"loss": 0.5})
        mgr.save(2, make_state(), metrics={"loss": 0.25, "grad_norm": math.inf})
    (tmp_path / ".step-00000003.staging-abc").mkdir()
    out = io.StringIO()
    assert ls_main(str(tmp_path), verify=False, as_json=False, out=out) == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.getvalue().splitlines()}
    assert rows["step-00000001"][:2] == ["committed", "1"] and rows["step-00000002"][-2:] == [
        "loss=0.25",
        "grad_norm=inf",
    ]
    assert rows[".step-00000003.staging-abc"][:2] == ["incomplete", "3"]

    flip_last_byte(tmp_path / "step-00000002")
    out = io.StringIO()
    assert ls_main(str(tmp_path), verify=True, as_json=True, out=out) == 1
    doc = json.loads(out.getvalue())
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["step-00000001"]["status"] == "committed" and by_name["step-00000001"]["step"] == 1
    assert by_name["step-00000001"]["metrics"] == {"loss": 0.5} and by_name["step-00000001"]["size"] > 0
    assert by_name["step-00000002"]["status"] == "corrupt" and "step-00000002" in by_name["step-00000002"]["reason"]
    assert by_name["step-00000002"]["metrics"] == {"loss": 0.25, "grad_norm": "inf"}  # strict JSON
    assert by_name[".step-00000003.staging-abc"]["status"] == "incomplete"

    out = io.StringIO()
    (tmp_path / ".step-00000003.staging-abc").rmdir()
    flip_last_byte(tmp_path / "step-00000002")  # flip back
    assert ls_main(str(tmp_path), verify=True, as_json=False, out=out) == 0
    assert ls_main(str(tmp_path / "nope"), verify=False, as_json=False, out=io.StringIO()) == 2


def test_async_save_commits_in_background_and_retention_follows(tmp_path: Path) -> None:
    state = make_state()
    with CheckpointManager(tmp_path, every_n_steps=1, keep_last=2, async_save=True) as mgr:
        for step in range(1, 5):
            with torch.no_grad():
                state["model"].weight.fill_(float(step))
            mgr.maybe_save(step, state)
        mgr.wait()
        assert [r.step for r in mgr.list()] == [3, 4]
    fresh = make_state(1)
    assert CheckpointManager(tmp_path, save_on_signals=()).resume(fresh) == 4
    assert weights(fresh) == [4.0] * 12


def test_closed_manager_refuses_work(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.close()
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(1, make_state())


# ---------------------------------------------------------------------- two ranks: agreement


def _schedule_worker(rank: int, world: int, root: str) -> list[int]:
    state = make_state()
    # async: the time agreement of the next steps runs while a save is in flight
    mgr = CheckpointManager(
        root, every_n_steps=3, every_seconds=0.5, keep_last=None, async_save=True, save_on_signals=()
    )
    if rank == 1:
        # Rank 1's own clock never advances: only rank 0's clock may decide time-based saves.
        mgr._schedule.clock = lambda: 0.0
    saved = []
    for step in range(1, 9):
        if rank == 0 and step in (4, 7):
            time.sleep(0.6)  # past every_seconds since the save of the step before
        if mgr.maybe_save(step, state):
            saved.append(step)
    mgr.close()
    return saved


def test_interval_and_time_based_saves_are_agreed_across_ranks(tmp_path: Path) -> None:
    r0, r1 = check_ok(run_ranks(_schedule_worker, 2, str(tmp_path), timeout=120))
    assert r0 == r1
    assert {3, 4, 6, 7} <= set(r0)
    assert committed_steps(tmp_path) == r0


def _crash_worker(rank: int, world: int, root: str) -> str:
    state = make_state()
    mgr = CheckpointManager(root, every_n_steps=2, keep_last=None, timeout=5, save_on_signals=())
    for step in range(1, 5):
        mgr.maybe_save(step, state)
    # rank 1 dies (os._exit, like kill -9) in the middle of writing its data file of step 6
    os.environ["SHARDSAFE_FAULT"] = "save.write:rank=1:exit"
    try:
        mgr.maybe_save(6, state)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "saved"


def test_resume_after_a_rank_is_killed_mid_save_picks_the_previous_checkpoint(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_crash_worker, 2, str(tmp_path), timeout=120)
    assert r1.exitcode == 13 and not r1.killed
    assert r0.ok and re.search(r"\branks? \[?1\b", r0.result), r0.result  # rank 0 raised, naming rank 1
    assert committed_steps(tmp_path) == [2, 4]
    with CheckpointManager(tmp_path, save_on_signals=()) as mgr:
        assert mgr.resume(make_state()) == 4


def test_remote_root_saves_keeps_cleans_and_resumes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fsspec = pytest.importorskip("fsspec")
    root = f"memory://manager-test/{tmp_path.name}"
    state = make_state()
    with CheckpointManager(root, every_n_steps=2, keep_last=2, leftover_age=0, save_on_signals=()) as mgr:
        for step in range(1, 7):
            mgr.maybe_save(step, state, metrics={"loss": 1.0 / step})
        assert [(r.step, r.metrics["loss"]) for r in mgr.list()] == [(4, 0.25), (6, 1 / 6)]
    mem = fsspec.filesystem("memory")
    mem.pipe(f"/manager-test/{tmp_path.name}/step-00000008/data-00001-crashed.safetensors", b"partial")
    with caplog.at_level(logging.WARNING, logger="shardsafe"), CheckpointManager(root, save_on_signals=()) as mgr:
        assert mgr.resume(make_state(1)) == 6
        mgr.save(8, state)  # the crashed prefix of step 8 is replaced, then retention runs
        assert [r.step for r in mgr.list()] == [4, 6, 8]
    assert "step-00000008" in caplog.text and "no MANIFEST.json" in caplog.text


def test_a_resume_has_one_deadline_for_all_its_candidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's ``timeout=`` bounds the whole resume, not each candidate: three damaged candidates
    that each take 1.5 s to fail, under timeout=2, end with ``CheckpointTimeoutError`` before the third
    is tried (each candidate had its own fresh 2 s before, and the resume took 4.5 s for a 2 s timeout)."""
    from shardsafe.engine import api

    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state())
    tried: list[str] = []

    def slow_damaged(path: str, *args: Any, **kwargs: Any) -> None:
        tried.append(os.path.basename(path))
        time.sleep(1.5)
        raise CorruptCheckpointError(f"{path}: damaged (test)")

    monkeypatch.setattr(api, "load", slow_damaged)
    with CheckpointManager(tmp_path, timeout=2.0) as mgr, pytest.raises(shardsafe.CheckpointTimeoutError):
        mgr.resume(make_state())
    assert tried == ["step-00000003", "step-00000002"]  # the third was never tried
