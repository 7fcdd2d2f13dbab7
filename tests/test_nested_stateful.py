"""Objects with ``state_dict()``/``load_state_dict()`` nested anywhere in the state's dicts, lists and
tuples (Lightning's scheduler config ``{"scheduler": {"scheduler": sched, "interval": "step"}}``) are
saved through their own ``state_dict()`` and loaded back in place through ``load_state_dict``, as
top-level ones are; modules and optimizers nested inside an entry are refused with the advice to put
them at the top level of the state (not the advice to give them a ``state_dict()``, which they have)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe


class Counter:
    """A user's own Stateful class."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.seen = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.seen = sd["seen"]


def _training(seed: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter()
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        counter.n += 1
        counter.seen += 1
    return {
        "model": model,
        "optim": opt,
        "scheduler": {"scheduler": sched, "interval": "step", "frequency": 1},  # Lightning's scheduler config
        "extras": [counter, {"deep": (Counter(7 if steps else 0), "tag")}],
    }


def test_nested_stateful_objects_round_trip_in_place(tmp_path: Path) -> None:
    saved = _training(0, 5)
    shardsafe.save(tmp_path / "c", saved)
    state = _training(1, 0)
    sched, counter, deep = state["scheduler"]["scheduler"], state["extras"][0], state["extras"][1]["deep"][0]
    shardsafe.load(tmp_path / "c", state)
    assert state["scheduler"]["scheduler"] is sched and state["extras"][0] is counter
    assert state["extras"][1]["deep"][0] is deep and state["extras"][1]["deep"][1] == "tag"
    assert sched.state_dict() == saved["scheduler"]["scheduler"].state_dict()
    assert sched.last_epoch == 5 and sched.get_last_lr() == saved["scheduler"]["scheduler"].get_last_lr()
    assert state["optim"].param_groups[0]["lr"] == 0.25
    assert state["scheduler"]["interval"] == "step" and state["scheduler"]["frequency"] == 1
    assert counter.n == 5 and torch.equal(counter.seen, torch.full((3,), 5.0)) and deep.n == 7
    whole = shardsafe.load(tmp_path / "c")  # without a state: the state dicts, as saved
    assert whole["scheduler"]["scheduler"]["last_epoch"] == 5 and whole["extras"][0]["n"] == 5


@pytest.mark.parametrize("kind", ["module", "optimizer"])
def test_a_nested_module_or_optimizer_is_refused_with_the_right_advice(tmp_path: Path, kind: str) -> None:
    model = torch.nn.Linear(2, 2)
    obj = model if kind == "module" else torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(shardsafe.CheckpointError) as info:
        shardsafe.save(tmp_path / "c", {"model": model, "parts": {"inner": obj}})
    message = str(info.value)
    assert "'parts/inner'" in message and "top level" in message, message
    assert "give the object state_dict()" not in message, message
    assert not (tmp_path / "c").exists()


def test_a_nested_object_meeting_another_structure_is_refused_before_anything_changes(tmp_path: Path) -> None:
    shardsafe.save(tmp_path / "c", {"cfg": {"scheduler": 5, "t": torch.ones(2)}})
    counter = Counter(3)
    state = {"cfg": {"scheduler": counter, "t": torch.zeros(2)}}
    with pytest.raises(shardsafe.CheckpointError, match=r"cfg/scheduler.*state dict"):
        shardsafe.load(tmp_path / "c", state)
    assert state["cfg"]["scheduler"] is counter and counter.n == 3 and torch.equal(state["cfg"]["t"], torch.zeros(2))
