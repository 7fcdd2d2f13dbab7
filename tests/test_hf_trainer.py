"""shardsafe.transformers.Trainer: checkpoint-N folders are shardsafe checkpoints with trainer_state.json as a
side file; on 2 CPU ranks a run stopped mid-epoch and resumed with resume_from_checkpoint=True ends bit for bit
where an uninterrupted run does (the same batches, the same dropout), save_total_limit rotating through
shardsafe.delete after each commit; save_only_model, load_best_model_at_end, a damaged newest checkpoint skipped
by resume_from_checkpoint=True, the refused options; CheckpointMixin on a Trainer subclass."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="transformers is needed (requirements-dev.txt)")
pytest.importorskip("accelerate", reason="accelerate is needed (requirements-dev.txt)")

import shardsafe

from harness import check_ok, run_ranks


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.x[:, 0] = torch.arange(n)  # each sample says which it is
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    """A linear model behind dropout, recording the samples it sees (a Python list: not part of its state)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.drop = nn.Dropout(0.3)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.seen += [int(v) for v in x[:, 0].tolist()]
        out = self.lin(self.drop(x))
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _trainer(
    out: str, stop_at: int | None = None, hf_weights: bool = True, samples: int = 32, evaluate: bool = False, **kw: Any
) -> Any:
    from transformers import TrainerCallback, TrainingArguments

    from shardsafe.transformers import Trainer

    class Stop(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True  # a job that ends here, as a preemption would
            return control

    torch.manual_seed(0)
    options: dict[str, Any] = {
        "per_device_train_batch_size": 2,
        "num_train_epochs": 3,
        "save_steps": 3,
        "save_total_limit": 2,
        "logging_steps": 1000,
        "report_to": [],
        "use_cpu": True,
        "seed": 7,
        "disable_tqdm": True,
        **kw,
    }
    args = TrainingArguments(out, **options)
    evaluation = Data(8) if evaluate else None
    return Trainer(
        Net(), args, train_dataset=Data(samples), eval_dataset=evaluation, callbacks=[Stop()], hf_weights=hf_weights
    )


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    common = {"num_train_epochs": 2, "hf_weights": False}
    whole = _trainer(f"{root}/whole", **common)
    whole.train()  # 2 epochs of 8 steps per rank: 16 steps
    stopped = _trainer(f"{root}/run", stop_at=10, **common)
    stopped.train()  # ends after step 10: checkpoint-9 (the first step of epoch 2 done) is the newest
    after_stop = sorted(os.listdir(f"{root}/run"))
    resumed = _trainer(f"{root}/run", **common)
    resumed.train(resume_from_checkpoint=True)
    return {
        "whole": [p.detach().clone() for p in whole.model.parameters()],
        "resumed": [p.detach().clone() for p in resumed.model.parameters()],
        "tail": whole.model.seen[-7 * 2 :],  # the samples of steps 10..16 on this rank
        "resumed_seen": resumed.model.seen,
        "after_stop": after_stop,
        "final": sorted(os.listdir(f"{root}/run")),
        "state": json.loads(shardsafe.read_file(f"{root}/run/checkpoint-16", "trainer_state.json")),
    }


def test_a_resume_mid_epoch_on_two_ranks_ends_where_the_whole_run_does(tmp_path: Path) -> None:
    r0, r1 = check_ok(run_ranks(_resume, 2, str(tmp_path), timeout=300))
    for r in (r0, r1):
        assert r["after_stop"] == ["checkpoint-6", "checkpoint-9"]  # save_total_limit=2, after each commit
        assert r["final"] == ["checkpoint-15", "checkpoint-16"]
        assert r["resumed_seen"] == r["tail"]  # the same batches from step 13 on
        assert all(torch.equal(a, b) for a, b in zip(r["whole"], r["resumed"], strict=True))  # dropout too
        assert r["state"]["global_step"] == 16
    assert r0["tail"] != r1["tail"]  # each rank its own share of the data
    for name in ("checkpoint-15", "checkpoint-16"):
        info = shardsafe.inspect(tmp_path / "run" / name)
        assert info.world_size == 2 and "trainer_state.json" in info.side_files
        assert {"model", "optimizer", "scheduler", "rng"} <= {e.name for e in info.entries}
        shardsafe.verify(tmp_path / "run" / name)


def test_one_process_files_damage_save_only_model_best_model_and_refusals(tmp_path: Path) -> None:
    from transformers import Trainer as Stock
    from transformers import TrainingArguments

    from shardsafe.transformers import CheckpointMixin, Trainer

    t = _trainer(str(tmp_path / "a"), num_train_epochs=1, samples=12, save_steps=2)  # 6 steps: 4 and 6 stay
    t.train()
    ckpt = tmp_path / "a" / "checkpoint-6"
    names = set(os.listdir(ckpt))
    assert {"trainer_state.json", "model.safetensors", "MANIFEST.json"} <= names  # hf_weights: the stock files too
    assert not {"optimizer.pt", "scheduler.pt"} & names  # no pickles of the optimizer's state
    # The newest checkpoint damaged: resume_from_checkpoint=True takes checkpoint-4 (WARNING).
    (ckpt / "trainer_state.json").write_text("{}")
    from shardsafe.transformers import last_checkpoint

    assert last_checkpoint(str(tmp_path / "a")) == str(tmp_path / "a" / "checkpoint-4")
    with pytest.raises(shardsafe.CorruptCheckpointError, match=r"trainer_state\.json"):
        _trainer(str(tmp_path / "a"), num_train_epochs=1, samples=12).train(resume_from_checkpoint=str(ckpt))
    # save_only_model: the model alone, no optimizer or generators.
    only = _trainer(str(tmp_path / "b"), num_train_epochs=1, samples=6, save_only_model=True, hf_weights=False)
    only.train()
    info = shardsafe.inspect(tmp_path / "b" / "checkpoint-3")
    assert {e.name for e in info.entries if "/" not in e.name} == {"model"}
    assert "model.safetensors" not in info.side_files
    # load_best_model_at_end with save_total_limit=1: the best checkpoint is kept beside the newest, and loaded.
    best = _trainer(
        str(tmp_path / "c"),
        num_train_epochs=1,
        samples=12,
        save_steps=2,
        evaluate=True,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        save_total_limit=1,
    )
    best.train()
    kept = sorted(os.listdir(tmp_path / "c"))
    assert best.state.best_model_checkpoint is not None
    assert os.path.basename(best.state.best_model_checkpoint) in kept and len(kept) <= 2
    saved = shardsafe.load(best.state.best_model_checkpoint)["model"]
    assert torch.equal(saved["lin.weight"], best.model.lin.weight.detach())
    # A Trainer subclass gets the same through the mixin.
    mixed = type("Mixed", (CheckpointMixin, Stock), {})
    sub = mixed(Net(), TrainingArguments(str(tmp_path / "d"), max_steps=3, save_steps=3, use_cpu=True, report_to=[]))
    sub.train_dataset = Data()
    sub.train()
    assert shardsafe.read_file(tmp_path / "d" / "checkpoint-3", "trainer_state.json")
    for bad, match in (({"push_to_hub": True}, "push_to_hub"), ({"save_on_each_node": True}, "save_on_each_node")):
        with pytest.raises(shardsafe.InvalidArgumentError, match=match):
            Trainer(Net(), TrainingArguments(str(tmp_path / "e"), use_cpu=True, report_to=[], **bad))


class Growing(Net):
    """Records the samples it saw in a buffer that grows, resized by its own load_state_dict (as the stock
    Trainer's resume calls it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("order", torch.zeros(0))

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self.order = state_dict["order"].clone()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.order = torch.cat([self.order, x[:, 0]])
        return super().forward(x, labels)


def test_a_model_whose_buffer_grows_resumes_through_its_own_load_state_dict(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from shardsafe.transformers import Trainer

    def trainer(out: Path) -> Any:
        torch.manual_seed(0)
        args = TrainingArguments(str(out), max_steps=4, save_steps=2, per_device_train_batch_size=2, use_cpu=True)
        args.report_to = []
        return Trainer(Growing(), args, train_dataset=Data(8), hf_weights=False)

    whole = trainer(tmp_path / "a")
    whole.train()
    resumed = trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))  # StateMismatchError before
    assert torch.equal(resumed.model.order, whole.model.order)
