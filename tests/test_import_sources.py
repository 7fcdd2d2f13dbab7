"""Imports a user resumes from or exports again, from the user's side: a DCP checkpoint of a model and
its optimizer resumes both with ``shardsafe.load`` (the optimizer's state keyed by parameter name, as
shardsafe keys it); an imported ``torch.save`` file exports without ``--key`` and hints name entries that
exist; a Hugging Face safetensors folder (or file) imports on purpose, never asking for ``--allow-pickle``."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli import main
from shardsafe.errors import CorruptCheckpointError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 6, generator=g)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


# ------------------------------------------------------------------------------------------ DCP


def test_a_dcp_checkpoint_resumes_model_and_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    _train(model, opt, 3, seed=1)
    msd, osd = get_state_dict(model, opt)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": msd, "optim": osd, "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    assert main(["import", str(tmp_path / "dcp"), str(tmp_path / "ckpt"), "--allow-pickle"]) == 0
    assert "optim" in capsys.readouterr().out
    # a fresh job resumes with the library's own load, model and optimizer in place
    model2 = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    state = {"model": model2, "optim": opt2, "step": 0}
    shardsafe.load(tmp_path / "ckpt", state)
    assert state["step"] == 3 and opt2.param_groups[0]["lr"] == 0.01 and opt2.param_groups[0]["betas"] == (0.8, 0.9)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        sa, sb = opt.state[p], opt2.state[q]
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    _train(model, opt, 2, seed=2)  # and training goes on exactly as it would have
    _train(model2, opt2, 2, seed=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    # and the imported model exports with no --key
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), "--format", "torch"]) == 0
    assert sorted(torch.load(tmp_path / "out.pt", weights_only=True)) == sorted(msd)


def test_dcp_optimizer_kind_is_recorded(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1, seed=1)
    msd, osd = get_state_dict(model, opt)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    shardsafe.import_checkpoint(tmp_path / "dcp", tmp_path / "ckpt", allow_pickle=True)
    doc = json.loads((tmp_path / "ckpt" / "MANIFEST.json").read_text())
    assert doc["objects"]["optim"]["kind"] == "optimizer" and doc["objects"]["model"]["kind"] == "module"
    whole = shardsafe.load(tmp_path / "ckpt")  # and load(path) still gives it back as saved
    assert sorted(whole["optim"]["state"]) == sorted(n for n, _ in model.named_parameters())


# ------------------------------------------------------------------------------------------ torch.save


def test_an_imported_state_dict_exports_without_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = _model().state_dict()
    torch.save(sd, tmp_path / "flat.pt")
    shardsafe.import_checkpoint(tmp_path / "flat.pt", tmp_path / "flat")
    assert main(["export", str(tmp_path / "flat"), str(tmp_path / "hf-flat")]) == 0, capsys.readouterr().err
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "hf-flat" / "model.safetensors"))
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], v) for k, v in sd.items())
    # the usual training checkpoint: the model's state dict beside an index-keyed optimizer
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1, seed=0)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}, tmp_path / "train.pt")
    shardsafe.import_checkpoint(tmp_path / "train.pt", tmp_path / "train")
    assert main(["export", str(tmp_path / "train"), str(tmp_path / "hf-train")]) == 0
    assert "[model]" in capsys.readouterr().out
    got = load_file(str(tmp_path / "hf-train" / "model.safetensors"))
    assert sorted(got) == sorted(model.state_dict())


def test_export_hints_name_entries_that_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"student": _model().state_dict(), "teacher": _model().state_dict()}, tmp_path / "two.pt")
    shardsafe.import_checkpoint(tmp_path / "two.pt", tmp_path / "two")
    assert main(["export", str(tmp_path / "two"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "--key student" in err and "teacher" in err and "--key model" not in err, err


# ------------------------------------------------------------------------------------------ Hugging Face


@pytest.fixture
def hf_model() -> Any:
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=8, bos_token_id=0, eos_token_id=0,
        architectures=["GPT2LMHeadModel"],
    )  # fmt: skip
    torch.manual_seed(4)
    return GPT2LMHeadModel(config)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(8).reshape(1, 8)).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("shards", ["single", "sharded", "file"])
def test_a_hugging_face_folder_imports_on_purpose(
    hf_model: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], shards: str
) -> None:
    from transformers import GPT2LMHeadModel

    folder = tmp_path / "hf"
    hf_model.save_pretrained(str(folder), max_shard_size="20KB" if shards == "sharded" else "5GB")
    assert (folder / "model.safetensors.index.json").exists() == (shards == "sharded")
    src = folder / "model.safetensors" if shards == "file" else folder
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr()
    assert "safetensors" in out.out and "allow-pickle" not in out.out + out.err, out
    # resumable into the model itself, strictly (the tied head that save_pretrained leaves out is back)
    fresh = GPT2LMHeadModel(hf_model.config)
    shardsafe.load(tmp_path / "ckpt", {"model": fresh})
    assert torch.equal(_logits(fresh), _logits(hf_model))
    # and exported again, it opens as it was
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "again"), "--config", str(folder)]) == 0
    assert torch.equal(_logits(GPT2LMHeadModel.from_pretrained(str(tmp_path / "again"))), _logits(hf_model))


def test_a_damaged_safetensors_file_is_refused_as_damage(
    hf_model: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "hf"
    hf_model.save_pretrained(str(folder))
    file = folder / "model.safetensors"
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    cases = {
        "cut": bytes(raw[: n + 8 + 100]),
        "header": bytes(raw[:20]) + b"\xff" + bytes(raw[21:]),
        "length": struct.pack("<Q", 2**60) + bytes(raw[8:]),
    }
    for name, data in cases.items():
        file.write_bytes(data)
        with pytest.raises(CorruptCheckpointError, match="safetensors"):
            shardsafe.import_checkpoint(folder, tmp_path / name)
        assert main(["import", str(folder), str(tmp_path / name)]) == 1
        text = capsys.readouterr().err
        assert "allow-pickle" not in text and str(file) in text, text
        assert not (tmp_path / name).exists()
