"""Library-style logging (``getLogger(__name__)``, a DEBUG line per protocol phase naming the rank and
the timings) and tunables (each in knobs.py, each with a ``SHARDSAFE_`` override, each read)."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe import knobs
from shardsafe.storage.local import LocalWriter
from shardsafe.storage.retry import RetryPolicy

SRC = Path(__file__).resolve().parent.parent / "src" / "shardsafe"


def test_every_logger_is_named_after_its_module() -> None:
    wrong = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            named = len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__"
            if node.func.attr == "getLogger" and not named:
                wrong.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not wrong, f"use logging.getLogger(__name__): {wrong}"


def _phases(records: list[logging.LogRecord], op: str) -> list[str]:
    out = []
    for rec in records:
        line = rf"shardsafe: {op} .* rank (\S+): (\w+) took [0-9.]+s, entering (\w+) at [0-9.]+s"
        m = re.match(line, rec.getMessage())
        if m and rec.levelno == logging.DEBUG:
            out.append(m.group(3))
    return out


def test_save_and_load_log_each_phase_at_debug_with_rank_and_timings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "ck")
    with caplog.at_level(logging.DEBUG, logger="shardsafe"):
        shardsafe.save(path, {"w": torch.arange(6.0)})
        shardsafe.save(path, {"w": torch.ones(6)}, overwrite=True)  # replaces data files: a cleanup
        state = {"w": torch.zeros(6)}
        shardsafe.load(path, state)
    saves = _phases(caplog.records, "save")
    for phase in ("plan", "write", "report", "commit", "decide", "publish", "acknowledge", "done"):
        assert phase in saves, (phase, saves)
    assert any("removed 1 replaced file(s)" in r.getMessage() for r in caplog.records)
    loads = _phases(caplog.records, "load")
    assert [p for p in loads if p in ("manifest", "plan", "go", "read", "restore", "done")] == [
        "manifest",
        "plan",
        "go",
        "read",
        "restore",
        "done",
    ], loads
    assert any(re.search(r"save \S+ rank 0: plan took", r.getMessage()) for r in caplog.records)
    assert torch.equal(state["w"], torch.ones(6))


def test_every_knob_has_an_env_override_and_is_read_somewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    named = {name: k for name, k in vars(knobs).items() if isinstance(k, knobs.Knob)}
    assert sorted(map(id, named.values())) == sorted(map(id, knobs.ALL)), "a knob outside ALL, or bound twice"
    text = {p: p.read_text() for p in SRC.rglob("*.py") if p.name != "knobs.py"}
    for name, knob in named.items():
        assert callable(knob)
        assert any(re.search(rf"\bknobs\.{name}\b", t) for t in text.values()), f"knobs.{name} is never read"
        if isinstance(knob, knobs.Choice):  # a word: each of its words, nothing else
            for word in knob.choices:
                monkeypatch.setenv(knob.env, word.upper())
                assert knob() == word
            for bad in ("7", "yes", "-1"):
                monkeypatch.setenv(knob.env, bad)
                with pytest.raises(shardsafe.InvalidArgumentError, match=knob.env):
                    knob()
            monkeypatch.delenv(knob.env)
            assert knob() == knob.choices[0]
            continue
        monkeypatch.setenv(knob.env, "7")
        assert knob() == 7, f"knobs.{name} ignores {knob.env}"
        for bad in ("-1", "0", "nan", "inf", "-inf", "1e999"):  # nan/inf: a deadline that never passes
            monkeypatch.setenv(knob.env, bad)
            with pytest.raises(shardsafe.InvalidArgumentError, match=knob.env):
                knob()
        monkeypatch.delenv(knob.env)
        assert knob() > 0


def test_docs_list_every_knob_with_its_default() -> None:
    """docs/knobs.md holds knobs.markdown() as it is: a new or changed knob changes the doc."""
    doc = (SRC.parent.parent / "docs" / "knobs.md").read_text()
    assert knobs.markdown() in doc, "docs/knobs.md is out of date: paste shardsafe.knobs.markdown() into it"
    assert "| `SHARDSAFE_IO_TIMEOUT` | see text |" in doc and "| `SHARDSAFE_STAGING_POOL_BYTES` | 256 MiB |" in doc


def test_storage_tunables_come_from_knobs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDSAFE_REMOTE_RETRY_FIRST_DELAY", "0.25")
    monkeypatch.setenv("SHARDSAFE_REMOTE_RETRY_MAX_DELAY", "2")
    monkeypatch.setenv("SHARDSAFE_REMOTE_READ_THREADS", "7")
    monkeypatch.setenv("SHARDSAFE_LOCAL_GATHER_BELOW_BYTES", "1024")
    policy = RetryPolicy()
    assert (policy.base_delay, policy.max_delay) == (0.25, 2.0)
    assert knobs.remote_read_threads() == 7
    writer = LocalWriter(str(tmp_path / "data-00000-abc.safetensors"))
    try:
        assert writer.SMALL == 1024
    finally:
        writer.abort()
