"""Every ```python snippet of README.md and docs/*.md runs as written, and so does every ```bash block
made of ``shardsafe`` commands (each in a folder of its own, through ``shardsafe.cli.main``; optional
parts written ``[--flag value]`` left out; blocks of other commands, pip or torchrun, are not run).

A page is read top to bottom: its snippets run in order, in one namespace and one working folder of
their own (what one snippet defines or saves, the next may use). A snippet that needs something the
page does not make says so in an HTML comment on the line just before it, and gets a small stand-in:

    <!-- snippet: needs model, opt, sched, step -->        names and files from PLACEHOLDERS / FILES below
    <!-- snippet: script; needs MyModel, make_loader -->    run as a script of its own (it starts processes)
    <!-- snippet: ...; if fsdp-on-cpu -->                   run only where torch can (CONDITIONS below)
    <!-- snippet: skip: why -->                             not run (it is still compiled); listed in SKIPPED

A name a snippet uses without defining or declaring it fails the test (NameError), so the comments stay
true; every skip is on purpose: SKIPPED lists them, and a skip not in that list (or the other way
round) fails. Async saves a page leaves in flight are waited for, managers it leaves open are closed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.runtime.compat import fsdp_on_cpu_problem

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARK = re.compile(r"^<!--\s*snippet:\s*(?P<body>.*?)\s*-->$")

SKIPPED = {
    ("docs/fabric.md", "import lightning as L"): "8 GPUs",
    ("docs/fabric.md", "if fabric.global_rank == 0:"): "the mistake",
    ("docs/lightning.md", "import lightning as L"): "8 GPUs",
    ("docs/object-storage.md", "import shardsafe"): "S3",
    ("docs/runtime.md", 'fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")'): "Fabric",
}
"""Every snippet not run, by (page, first line), with a word its reason must contain."""


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    line: int  # of the ```python fence
    code: str
    needs: tuple[str, ...] = ()
    script: bool = False
    skip: str | None = None
    conditions: tuple[str, ...] = ()

    @property
    def first(self) -> str:
        return self.code.splitlines()[0]


def _snippets(path: Path) -> list[Snippet]:
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    found = []
    for i, line in enumerate(lines):
        if line.strip() != "```python":
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(lines[i + 1 : end]) + "\n"
        mark = _MARK.match(lines[i - 1].strip()) if i > 0 else None
        needs: tuple[str, ...] = ()
        conditions: list[str] = []
        script, skip = False, None
        if mark is not None:
            body = mark.group("body")
            if body.startswith("skip:"):
                skip = body.removeprefix("skip:").strip()
            else:
                for part in (p.strip() for p in body.split(";")):
                    if part == "script":
                        script = True
                    elif part.startswith("needs "):
                        needs = tuple(n.strip() for n in part.removeprefix("needs ").split(","))
                    elif part.startswith("if "):
                        conditions.append(part.removeprefix("if ").strip())
                    else:
                        raise AssertionError(f"{page}:{i}: unknown snippet comment {part!r}")
        found.append(Snippet(page, i + 1, code, needs, script, skip, tuple(conditions)))
    return found


SNIPPETS = [s for page in PAGES for s in _snippets(page)]


@dataclass(frozen=True)
class Shell:
    page: str
    line: int  # of the ```bash fence
    commands: tuple[str, ...]
    needs: tuple[str, ...] = ()


def _shell_blocks(path: Path) -> list[Shell]:
    """The ```bash blocks of ``path`` whose every command is ``shardsafe ...`` (comment lines aside)."""
    lines = path.read_text().splitlines()
    page = str(path.relative_to(ROOT))
    found = []
    for i, line in enumerate(lines):
        if line.strip() not in ("```bash", "```sh"):
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        commands = [c for c in lines[i + 1 : end] if c.strip() and not c.strip().startswith("#")]
        if not commands or not all(c.startswith("shardsafe ") for c in commands):
            continue
        mark = _MARK.match(lines[i - 1].strip()) if i > 0 else None
        needs: tuple[str, ...] = ()
        if mark is not None:
            body = mark.group("body")
            assert body.startswith("needs "), f"{page}:{i}: a shell block takes only 'needs': {body!r}"
            needs = tuple(n.strip() for n in body.removeprefix("needs ").split(","))
        found.append(Shell(page, i + 1, tuple(commands), needs))
    return found


SHELL = [b for page in PAGES for b in _shell_blocks(page)]


def _argv(command: str) -> list[str]:
    """A documented command as it runs: its comment and its optional parts (``[--json]``) left out."""
    text = re.sub(r"\s+#.*$", "", command)
    text = re.sub(r"\s*\[[^\]]*\]", "", text)
    return shlex.split(text)


# ------------------------------------------------------------------------------- stand-ins


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)  # type: ignore[no-any-return]


def _placeholders() -> dict[str, Any]:
    """Small objects standing for what a snippet's surroundings would hold (a model, its optimizer...)."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step() -> float:
        loss = model(torch.randn(2, 8)).pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        return float(loss)

    train_step()  # the optimizer has state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    return {
        "model": model,
        "opt": opt,
        "optimizer": opt,
        "sched": sched,
        "step": 100,
        "state": {"model": model, "optimizer": opt, "step": 0},
        "train_step": train_step,
        "loss": 0.25,
        "total": 3,
        "total_steps": 3,
        "rank": 0,
        "n": 1,
    }


def _gpt2(ns: dict[str, Any]) -> dict[str, Any]:
    """A tiny GPT-2 saved as run/step-1000 and its config.json; the name GPT2LMHeadModel."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0)
    config.to_json_file("config.json")
    shardsafe.save("run/step-1000", {"model": GPT2LMHeadModel(config)})
    return {"GPT2LMHeadModel": GPT2LMHeadModel}


def _gpt2_at_100(ns: dict[str, Any]) -> dict[str, Any]:
    """The tiny GPT-2 of ``gpt2`` saved as run/step-100, with its config.json."""
    names = _gpt2(ns)
    os.rename("run/step-1000", "run/step-100")
    return names


def _incremental(ns: dict[str, Any]) -> dict[str, Any]:
    """run/step-300, an incremental checkpoint of run/step-100 (made first when it is not there)."""
    if not os.path.exists("run/step-100"):
        _readme_checkpoint(ns)
    state = shardsafe.load("run/step-100")
    shardsafe.save("run/step-300", {**state, "step": 300}, base="run/step-100")
    return {}


def _torch_file(ns: dict[str, Any]) -> dict[str, Any]:
    """model.pt, a torch.save file of a model's state dict."""
    torch.save(ns["model"].state_dict(), "model.pt")
    return {}


def _hf_folder(ns: dict[str, Any]) -> dict[str, Any]:
    """hf-model/, the folder save_pretrained writes for a tiny GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained("hf-model")
    return {}


def _readme_checkpoint(ns: dict[str, Any]) -> dict[str, Any]:
    """run/step-100 as the README saves it: what docs/loading.md loads."""
    shardsafe.save("run/step-100", {"model": ns["model"], "optimizer": ns["opt"], "scheduler": ns["sched"], "step": 1})
    return {}


def _fabric_file(ns: dict[str, Any]) -> dict[str, Any]:
    """old.ckpt, a Fabric (torch.save) checkpoint: a dict of state dicts."""
    torch.save({"model": ns["model"].state_dict(), "optimizer": ns["opt"].state_dict(), "step": 5}, "old.ckpt")
    return {}


def _dcp_folder(ns: dict[str, Any]) -> dict[str, Any]:
    """dcp-ckpt/, a torch.distributed.checkpoint folder of a model and its optimizer, keyed by name; the
    names net and net_opt (that model and optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    placeholders = _placeholders()
    net, net_opt = placeholders["model"], placeholders["opt"]
    msd, osd = get_state_dict(net, net_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id="dcp-ckpt")  # one process: no process group
    return {"net": net, "net_opt": net_opt}


FILES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "run/step-100": _readme_checkpoint,
    "old.ckpt": _fabric_file,
    "gpt2": _gpt2,
    "gpt2 as run/step-100": _gpt2_at_100,
    "run/step-300": _incremental,
    "model.pt": _torch_file,
    "hf-model/": _hf_folder,
    "dcp-ckpt/": _dcp_folder,
}
"""Stand-ins made in the page's folder (names a snippet gives in ``needs``), each given the placeholders
and returning the names it adds to the page."""

SCRIPT_PRELUDE = {
    "MyModel": """
        import torch

        class MyModel(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(8, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.layer(x)
        """,
    "make_loader": """
        import torch

        def make_loader() -> torch.utils.data.DataLoader:
            data = torch.utils.data.TensorDataset(torch.randn(64, 8))
            batch = lambda items: torch.stack([x for (x,) in items])  # noqa: E731
            return torch.utils.data.DataLoader(data, batch_size=4, collate_fn=batch)
        """,
}
"""Definitions put before a script snippet (names it gives in ``needs``)."""


CONDITIONS: dict[str, Callable[[], str | None]] = {"fsdp-on-cpu": fsdp_on_cpu_problem}
"""What a snippet may require of the installed torch (``if NAME``): each gives why it cannot, or None."""


@dataclass
class _Page:
    folder: Path
    namespace: dict[str, Any]


_pages: dict[str, _Page] = {}


@pytest.fixture
def page(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Page]:
    snippet: Snippet = request.param
    if snippet.page not in _pages:
        _pages[snippet.page] = _Page(tmp_path_factory.mktemp(Path(snippet.page).stem), {"__name__": "snippet"})
    state = _pages[snippet.page]
    cwd = os.getcwd()
    os.chdir(state.folder)
    try:
        yield state
    finally:
        _settle(state.namespace)
        os.chdir(cwd)


def _settle(ns: dict[str, Any]) -> None:
    """Wait for the async saves a snippet left in flight; close the managers it left open."""
    for value in ns.values():
        if isinstance(value, shardsafe.SaveHandle):
            value.wait()
        elif isinstance(value, shardsafe.CheckpointManager):
            value.close()


@pytest.mark.parametrize("page", SNIPPETS, ids=[f"{s.page}:{s.line}" for s in SNIPPETS], indirect=True)
def test_snippet_runs(page: _Page, request: pytest.FixtureRequest) -> None:
    snippet: Snippet = request.node.callspec.params["page"]
    compiled = compile(snippet.code, f"{snippet.page}:{snippet.line}", "exec")  # every snippet parses
    if snippet.skip is not None:
        pytest.skip(f"{snippet.page}:{snippet.line}: {snippet.skip}")
    for condition in snippet.conditions:
        problem = CONDITIONS[condition]()
        if problem is not None:
            pytest.skip(f"{snippet.page}:{snippet.line}: not on this torch: {problem}")
    if snippet.script:
        _run_script(snippet, page.folder)
        return
    ns = page.namespace
    placeholders = _placeholders()
    for name in snippet.needs:
        if name in FILES:
            ns.update(FILES[name](placeholders))
        else:
            assert name in placeholders, f"{snippet.page}:{snippet.line}: no stand-in for {name!r}"
            ns.setdefault(name, placeholders[name])
    exec(compiled, ns)


def _run_script(snippet: Snippet, folder: Path) -> None:
    prelude = "".join(textwrap.dedent(SCRIPT_PRELUDE[name]) for name in snippet.needs)
    script = folder / f"snippet_{snippet.line}.py"
    script.write_text(prelude + "\n" + snippet.code)
    run = subprocess.run(
        [sys.executable, str(script)], cwd=folder, capture_output=True, text=True, timeout=240, env=dict(os.environ)
    )
    assert run.returncode == 0, f"{snippet.page}:{snippet.line} exited {run.returncode}:\n{run.stderr[-4000:]}"


@pytest.mark.parametrize("block", SHELL, ids=[f"{b.page}:{b.line}" for b in SHELL])
def test_shell_block_runs(
    block: Shell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each command of the block, in order, in a folder of its own holding what ``needs`` names: exit 0."""
    from shardsafe.cli import main

    monkeypatch.chdir(tmp_path)
    placeholders = _placeholders()
    for name in block.needs:
        assert name in FILES, f"{block.page}:{block.line}: no stand-in for {name!r}"
        FILES[name](placeholders)
    for command in block.commands:
        argv = _argv(command)
        assert argv[0] == "shardsafe", command
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{block.page}:{block.line}: `{command}` exited {code}:\n{out[-1000:]}{err[-2000:]}"


def test_every_skip_is_on_purpose() -> None:
    skipped = {(s.page, s.first): s.skip for s in SNIPPETS if s.skip is not None}
    assert set(skipped) == set(SKIPPED), f"skipped now: {sorted(skipped)}"
    for key, word in SKIPPED.items():
        assert word in (skipped[key] or ""), (key, skipped[key])


def test_the_docs_have_snippets() -> None:
    """The extraction finds what is there: a page's fences are all seen, none is left unparsed."""
    assert len(SNIPPETS) >= 18, len(SNIPPETS)
    assert {b.page for b in SHELL} >= {"README.md", "docs/interop.md"}, SHELL
    for path in PAGES:
        assert path.read_text().count("```python") == sum(s.page == str(path.relative_to(ROOT)) for s in SNIPPETS)
