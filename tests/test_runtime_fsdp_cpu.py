"""The Runtime's FSDP strategy on CPU: it runs where torch's FSDP2 runs on CPU, and where it does not
(torch 2.6: ``AttributeError: 'Stream' object has no attribute 'record_event'`` on every rank at the first
forward, which crashed runtime.md's first example) the Runtime refuses it when it is created, before any
process starts, saying why and what to use instead. Runs the example's shape (2 CPU processes: train,
save, load back) on the torch installed: on torch 2.6 through ``make test-torch TORCH=2.6.0``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe.runtime import Runtime
from shardsafe.runtime.compat import fsdp_on_cpu_problem

CAN = fsdp_on_cpu_problem() is None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _train(rt: Runtime, path: str) -> dict[str, Any]:
    rt.seed_everything(0)
    model = _Net()
    model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        rt.backward(loss)
        opt.step()
        opt.zero_grad()
    rt.save(path, {"model": model, "optim": opt, "step": 3})
    state = {"model": model, "optim": opt, "step": 0}
    shardsafe.load(path, state)
    return {"wrapper": type(model).__name__, "step": state["step"], "loss": float(rt.all_reduce(loss.detach()))}


@pytest.mark.parametrize("devices", [2, 1])
def test_fsdp_on_cpu_runs_or_is_refused_up_front(tmp_path: Path, devices: int) -> None:
    if not CAN:
        with pytest.raises(ValueError, match="record_event") as err:
            Runtime(accelerator="cpu", devices=devices, strategy="fsdp", timeout=120)
        assert isinstance(err.value, shardsafe.InvalidArgumentError)
        assert torch.__version__ in str(err.value) and "strategy='ddp'" in str(err.value), err.value
        Runtime(accelerator="cpu", devices=devices, strategy="ddp", timeout=120)  # the way out is accepted
        return
    rt = Runtime(accelerator="cpu", devices=devices, strategy="fsdp", timeout=120)
    result = rt.launch(_train, str(tmp_path / "final"))
    assert result["wrapper"].startswith("FSDP") and result["step"] == 3, result
    assert torch.isfinite(torch.tensor(result["loss"]))
    whole = shardsafe.load(tmp_path / "final")  # the sharded checkpoint, whole, in this process
    assert whole["model"]["blocks.0.weight"].shape == (8, 8)


def test_the_check_follows_the_cpu_stream_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.6's ``torch.cpu.Stream`` (no ``record_event``) is refused; a later one's is not."""

    class OldStream:
        def wait_stream(self, stream: Any) -> None:
            pass

    class NewStream(OldStream):
        def record_event(self) -> None:
            pass

    monkeypatch.setattr(torch.cpu, "Stream", OldStream)
    problem = fsdp_on_cpu_problem()
    assert problem is not None and "record_event" in problem
    with pytest.raises(shardsafe.InvalidArgumentError, match="strategy='fsdp' with accelerator='cpu'"):
        Runtime(accelerator="cpu", devices=2, strategy="fsdp")
    monkeypatch.setattr(torch.cpu, "Stream", NewStream)
    assert fsdp_on_cpu_problem() is None
