"""Exports from the careless user's and the attacker's side: targets that are not what they seem (a nested
export marker, a path under a regular file, a base folder of an incremental checkpoint that became a
file) give a ``CheckpointError`` with the reason, never a foreign exception, and a failed export leaves
nothing behind (the folders it created included). And names: a wrapped model (a LightningModule's
``self.model``) exported without ``--strip-prefix`` is never an export ``from_pretrained`` would ignore."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.cli import main
from shardsafe.errors import CheckpointError, CheckpointExistsError, InvalidArgumentError
from shardsafe.interop.outdir import MARKER

FORMATS = ["hf", "torch", "shardsafe"]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))


def _tree(root: Path) -> list[tuple[str, int, bytes]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = os.lstat(p)
            out.append(
                (str(p.relative_to(root)), st.st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
            )
    return sorted(out)


def _export(fmt: str, ckpt: Path, out: Path, **kwargs: Any) -> Any:
    if fmt == "hf":
        return shardsafe.export_hf(ckpt, out, **kwargs)
    if fmt == "torch":
        return shardsafe.export_torch(ckpt, out, **kwargs)
    from shardsafe.interop.consolidate import consolidate

    return consolidate(ckpt, out, **kwargs)


def _cli(fmt: str, ckpt: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["export", str(ckpt), str(out), "--format", fmt])
    o, e = capsys.readouterr()
    return rc, o + e


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    shardsafe.save(tmp_path / "ckpt", {"model": _model(), "step": 1})
    return tmp_path / "ckpt"


def test_a_nested_export_marker_is_refused_not_a_recursion_error(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for text in ("[" * 200_000 + "]" * 200_000, '{"format": "shardsafe-export", "files": ' + "[" * 100_000):
        (out / MARKER).write_text(text)
        before = _tree(tmp_path)
        for overwrite in (False, True):
            with pytest.raises(CheckpointExistsError, match="not a shardsafe export"):
                shardsafe.export_hf(ckpt, out, overwrite=overwrite)
        assert main(["export", str(ckpt), str(out), "--overwrite"]) == 1
        assert _tree(tmp_path) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_output_under_a_regular_file_is_refused(
    ckpt: Path, tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("mine")
    before = _tree(tmp_path)
    for out in (tmp_path / "file" / "out", tmp_path / "file" / "deeper" / "out"):
        with pytest.raises(CheckpointError, match="not a directory") as refused:
            _export(fmt, ckpt, out)
        assert str(tmp_path / "file") in str(refused.value)
        rc, text = _cli(fmt, ckpt, out, capsys)
        assert rc == 1 and "not a directory" in text, text
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_incremental_checkpoint_whose_base_became_a_file(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model()
    shardsafe.save(tmp_path / "s1", {"model": model})
    with torch.no_grad():
        model[2].bias.add_(1)  # only this changes: s2 takes the rest from s1
    shardsafe.save(tmp_path / "s2", {"model": model}, base=tmp_path / "s1")
    assert shardsafe.inspect(tmp_path / "s2").bases == ["s1"]
    shutil.move(tmp_path / "s1", tmp_path / "s1-moved")
    (tmp_path / "s1").write_text("not a folder any more")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match="s1") as refused:
        _export(fmt, tmp_path / "s2", tmp_path / "out")
    assert not isinstance(refused.value, NotADirectoryError) or isinstance(refused.value, CheckpointError)
    rc, text = _cli(fmt, tmp_path / "s2", tmp_path / "out", capsys)
    assert rc == 1 and "s1" in text and "Traceback" not in text, text
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_export_leaves_nothing_behind(ckpt: Path, tmp_path: Path, fmt: str) -> None:
    doc = json.loads((ckpt / "MANIFEST.json").read_text())
    chunk = doc["tensors"]["model/0.weight"]["chunks"][0]
    data = ckpt / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[chunk["begin"] + 3] ^= 0x01
    data.write_bytes(bytes(raw))
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match="checksum"):
        _export(fmt, ckpt, tmp_path / "new" / "deeper" / "out")
    assert _tree(tmp_path) == before  # not even the folders it would have written into


# ------------------------------------------------------------------------------- wrapped models


def _config() -> Any:
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=8, bos_token_id=0, eos_token_id=0,
        architectures=["GPT2LMHeadModel"],
    )  # fmt: skip


class Wrapper(torch.nn.Module):
    """A LightningModule's shape: the Hugging Face model as ``self.model`` (its names: ``model.transformer...``)."""

    def __init__(self, ema: bool = False) -> None:
        super().__init__()
        config = _config()
        from transformers import GPT2LMHeadModel

        torch.manual_seed(3)
        self.model = GPT2LMHeadModel(config)
        if ema:
            self.ema = GPT2LMHeadModel(config)


def _logits(path: Path | str) -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(8).reshape(1, 8)).logits  # type: ignore[no-any-return]


def _own_logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(8).reshape(1, 8)).logits  # type: ignore[no-any-return]


@pytest.fixture
def wrapped(tmp_path: Path) -> dict[str, Any]:
    wrapper = Wrapper()
    shardsafe.save(tmp_path / "ckpt", {"model": wrapper, "step": 5})
    config = tmp_path / "config.json"
    _config().to_json_file(str(config))
    return {"ckpt": tmp_path / "ckpt", "config": config, "logits": _own_logits(wrapper.model)}


def test_a_wrapped_model_is_stripped_and_said_so(
    wrapped: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        result = shardsafe.export_hf(wrapped["ckpt"], tmp_path / "hf", config=wrapped["config"])
    assert result.stripped == "model."
    assert "'model.'" in caplog.text and "strip" in caplog.text
    assert torch.equal(_logits(tmp_path / "hf"), wrapped["logits"])  # every weight found, none initialised


def test_the_cli_says_it_stripped_a_wrapper_prefix(wrapped: dict[str, Any], tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "shardsafe", "export", str(wrapped["ckpt"]), str(tmp_path / "hf"), "--config",
         str(wrapped["config"])],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(shardsafe.__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "model." in run.stderr and "strip" in run.stderr, run.stderr
    assert torch.equal(_logits(tmp_path / "hf"), wrapped["logits"])


def test_names_the_model_would_ignore_are_refused_with_the_prefix_to_strip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shardsafe.save(tmp_path / "ckpt", {"model": Wrapper(ema=True)})
    config = tmp_path / "config.json"
    _config().to_json_file(str(config))
    with pytest.raises(InvalidArgumentError, match=r"strip-prefix.*'model\.'|'model\.'.*strip-prefix") as refused:
        shardsafe.export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config)
    assert "'ema.'" in str(refused.value)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--config", str(config)]) == 2
    assert not (tmp_path / "hf").exists()
    # the named prefix picks its model: the rest is left out, and said so
    result = shardsafe.export_hf(tmp_path / "ckpt", tmp_path / "hf", config=config, strip_prefix="model.")
    assert result.stripped == "" and any(n.startswith("ema.") for n in result.skipped)
    assert torch.equal(_logits(tmp_path / "hf"), _own_logits(Wrapper().model))


def test_matching_names_need_no_strip_and_the_base_model_prefix_is_understood(tmp_path: Path) -> None:
    model = Wrapper().model
    shardsafe.save(tmp_path / "ckpt", {"model": model, "base": model.transformer})
    config = tmp_path / "config.json"
    _config().to_json_file(str(config))
    result = shardsafe.export_hf(tmp_path / "ckpt", tmp_path / "hf", key="model", config=config)
    assert result.stripped == "" and torch.equal(_logits(tmp_path / "hf"), _own_logits(model))
    # GPT2Model's names ("h.0...") under a GPT2LMHeadModel config: from_pretrained adds "transformer."
    result = shardsafe.export_hf(tmp_path / "ckpt", tmp_path / "hf-base", key="base", config=config)
    assert result.stripped == ""


def test_without_a_config_a_shared_wrapper_prefix_is_warned_about(
    wrapped: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        result = shardsafe.export_hf(wrapped["ckpt"], tmp_path / "hf")
    assert result.stripped == ""
    assert "'model.'" in caplog.text and "--config" in caplog.text and "--strip-prefix" in caplog.text


def test_a_disk_full_midway_through_a_shardsafe_export_leaves_nothing_and_says_so(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shardsafe-format export (consolidate) discards what it wrote as a failed save is discarded:
    no pending directory, no data file, no folder it created, and the caller gets a ``CheckpointError``
    that is still the ``OSError`` (``errno.ENOSPC``) the disk raised."""
    import errno

    from shardsafe.storage.local import LocalWriter

    real = LocalWriter.write
    calls: list[int] = []

    def full(self: LocalWriter, data: memoryview) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(LocalWriter, "write", full)
    before = _tree(tmp_path)
    with pytest.raises(OSError) as info:
        _export("shardsafe", ckpt, tmp_path / "new" / "deeper" / "out")
    assert isinstance(info.value, CheckpointError) and info.value.errno == errno.ENOSPC
    assert "free space" in str(info.value) and len(calls) >= 2
    assert _tree(tmp_path) == before


def test_a_shardsafe_export_whose_read_hangs_ends_at_its_deadline_and_leaves_nothing(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shardsafe-format export has one deadline for the whole copy (``timeout=``): a read of the
    source that never returns (a hung disk or mount) ends the call with ``CheckpointTimeoutError`` at
    that deadline, and what it wrote is removed."""
    import threading
    import time

    from shardsafe.interop import consolidate as module

    release = threading.Event()

    def hung(*args: Any, **kwargs: Any) -> None:
        release.wait(60)

    monkeypatch.setattr(module, "read_blocks", hung)
    before = _tree(tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(shardsafe.CheckpointTimeoutError):
            _export("shardsafe", ckpt, tmp_path / "new" / "out", timeout=1.0)
        assert time.monotonic() - started < 30
        assert _tree(tmp_path) == before
    finally:
        release.set()
