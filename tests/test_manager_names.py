"""The manager resumes from committed checkpoints under its root whatever their names: the README saves
``run/step-100`` with ``shardsafe.save``, then a ``CheckpointManager("run/")`` must resume from step 100
(``shardsafe ls run/`` shows it), not start from scratch. The step comes from the manifest's metadata
(``metadata={"step": N}``) or from a name that tells it unambiguously; a checkpoint whose step cannot be
told, or that lacks an entry the state asks for, is named in a WARNING saying why it is not used.
Retention never deletes a checkpoint that the manager did not name."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli.ls import ls_main
from shardsafe.manager import CheckpointManager


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "step": 0}


def _weight(state: dict[str, Any]) -> torch.Tensor:
    return state["model"].weight.detach().clone()


def test_resume_finds_the_readmes_step_100(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saved = _state(1)
    shardsafe.save(run / "step-100", {**saved, "step": 100})  # the README's own line, no metadata
    out = io.StringIO()
    assert ls_main(str(run), verify=False, as_json=False, out=out) == 0 and " 100 " in out.getvalue()
    state = _state(2)
    with CheckpointManager(run, every_n_steps=50, save_on_signals=()) as mgr:
        start = mgr.resume(state) or 0
        assert start == 100 and state["step"] == 100
        assert torch.equal(_weight(state), _weight(saved))
        latest = mgr.latest()
        assert latest is not None and latest.name == "step-100"


def test_the_step_comes_from_metadata_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shardsafe.save(run / "step-100", _state(1))
    newest = _state(3)
    shardsafe.save(run / "final", newest, metadata={"step": 250})  # the name tells nothing; metadata does
    state = _state(2)
    with CheckpointManager(run, save_on_signals=()) as mgr:
        assert mgr.resume(state) == 250
    assert torch.equal(_weight(state), _weight(newest))


def test_newest_by_step_across_the_managers_names_and_others(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shardsafe.save(run / "step-100", _state(1))
    with CheckpointManager(run, save_on_signals=()) as mgr:
        mgr.save(200, _state(2))  # step-00000200
    with CheckpointManager(run, save_on_signals=()) as mgr:
        assert mgr.resume(_state(0)) == 200
    shardsafe.save(run / "checkpoint-300", _state(3))  # Hugging Face Trainer's naming
    state = _state(0)
    with CheckpointManager(run, save_on_signals=()) as mgr:
        assert mgr.resume(state) == 300
    assert torch.equal(_weight(state), _weight(_state(3)))


def test_a_checkpoint_it_cannot_use_is_named_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    shardsafe.save(run / "step-100", _state(1))
    shardsafe.save(run / "last", _state(5))  # no step anywhere
    shardsafe.save(run / "2024-06-01", _state(6))  # several numbers, none of them a step
    shardsafe.save(run / "step-900-weights", {"model": _state(7)["model"]})  # lacks the optimizer
    with caplog.at_level(logging.WARNING, logger="shardsafe"), CheckpointManager(run, save_on_signals=()) as mgr:
        assert mgr.resume(_state(0)) == 100
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in ("last", "2024-06-01"):
        line = next((w for w in warnings if f"{run / name}" in w), None)
        assert line is not None, (name, warnings)
        assert "no step" in line and "metadata={'step': N}" in line, line
    line = next((w for w in warnings if f"{run / 'step-900-weights'}" in w), None)
    assert line is not None and "'optimizer'" in line, warnings


def test_retention_never_deletes_a_checkpoint_it_did_not_name(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shardsafe.save(run / "step-100", _state(1))
    state = _state(0)
    with CheckpointManager(run, keep_last=1, save_on_signals=()) as mgr:
        assert mgr.resume(state) == 100
        for step in (200, 300, 400):
            mgr.save(step, state)
        assert [r.name for r in mgr.list()] == ["step-00000400"]
    assert (run / "step-100" / "MANIFEST.json").exists()
    assert sorted(p.name for p in run.iterdir()) == ["step-00000400", "step-100"]
    with CheckpointManager(run, save_on_signals=()) as mgr:
        assert mgr.resume(_state(0)) == 400


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-100", 100),
        ("step_100", 100),
        ("step100", 100),
        ("step-00000100", 100),
        ("global_step=1200", 1200),
        ("epoch=3-step=1200", 1200),
        ("checkpoint-500", 500),
        ("ckpt_7", 7),
        ("iter-42", 42),
        ("300", 300),
        ("last", None),
        ("final", None),
        ("epoch=3", None),
        ("2024-06-01", None),
        ("run2-step-3-step-4", None),
        ("model-v2", None),
    ],
)
def test_step_from_name_only_where_unambiguous(name: str, step: int | None) -> None:
    from shardsafe.manager.listing import step_from_name

    assert step_from_name(name) == step
