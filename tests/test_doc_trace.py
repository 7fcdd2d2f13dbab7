"""The walks of docs/architecture.md ("One save, hop by hop", "One load, hop by hop") and their figures,
checked against a traced save and load: a doc that drifts from the code fails here.

Every shardsafe function a call runs is recorded (``sys.setprofile``, and ``threading.setprofile`` for the
threads it starts: writers, readers, the save's thread), with the thread of its first call and every
caller-to-callee pair; what runs while a module is being imported is left out. Traced: a plain save and
load (one process, a local folder, a small model and its AdamW state; ``SHARDSAFE_PROGRESS_INTERVAL``
set past the call, so that a slow machine runs the same calls), an async save with blocking and
with background staging, an incremental save, a save and a load on URL storage (``memory://``), and a
save and a load on 2 ranks holding a sharded tensor (DTensor).

A hop is a ``<file>.py:<name>`` reference in a numbered step of a walk (a module constant such as a
round's declaration is not a hop; a bare ``<file>.py`` is a module the call enters). Untagged, it is a
function (a class: one of its methods) that the plain call runs, and the untagged hops are first called
in the order the walk names them; on rank 0 of the 2-rank save, so are these and the ``[2 ranks]`` and
``[sharded]`` hops it runs. A hop followed by a tag in brackets (``[async]``) is one the plain
call does not run: it runs in the traced call the tag names (:data:`TAGS`), or the tag says it is not
traced (``[FSDP1]``). The table "Measured from a trace" of docs/architecture.md is measured here.

``python tests/test_doc_trace.py`` prints the measured table and the traces' first calls."""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import shardsafe

from harness import check_ok, run_ranks

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="the trace names functions by co_qualname (3.11)")

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "shardsafe"
DOC = ROOT / "docs" / "architecture.md"
SAVE, LOAD = "## One save, hop by hop", "## One load, hop by hop"

TAGS: dict[str, dict[str, tuple[str, ...]]] = {
    SAVE: {
        "async": ("async",),
        "background": ("background",),
        "URL": ("url save",),
        "incremental": ("incremental",),
        "2 ranks": ("rank 0 save", "rank 1 save"),
        "sharded": ("rank 0 save", "rank 1 save"),
    },
    LOAD: {"URL": ("url load",), "2 ranks": ("rank 0 load", "rank 1 load"), "sharded": ("rank 0 load", "rank 1 load")},
}
"""Per walk, each tag and the traces a hop so tagged must be called in (any of them)."""
UNTRACED = {"FSDP1"}
"""Tags of paths not traced here (an FSDP1 model needs a process group per wrapped unit): their hops are
only resolved (``tests/test_doc_references.py``)."""

Key = tuple[str, str]  # (module file relative to src/shardsafe, qualified name)


@dataclass
class Trace:
    calls: dict[Key, str] = field(default_factory=dict)
    """Every function called, in the order of its first call, with the name of that call's thread."""
    edges: set[tuple[Key, Key]] = field(default_factory=set)
    """(caller, callee), both named by the function a comprehension or lambda belongs to."""
    daemon: dict[str, bool] = field(default_factory=dict)
    """Every thread that ran a shardsafe function: whether it is a daemon thread."""
    left: list[str] = field(default_factory=list)
    """The threads of shardsafe (``shardsafe-*``) still alive when the call returned."""

    def first(self) -> dict[Key, int]:
        return {key: i for i, key in enumerate(self.calls)}


def _named(qualname: str) -> str:
    """The named function a comprehension, lambda or generator expression belongs to."""
    parts = qualname.split(".")
    while len(parts) > 1 and parts[-1].startswith("<"):  # "<listcomp>", "<lambda>", the "<locals>" before
        parts.pop()
    return ".".join(parts)


def trace(fn: Callable[[], object]) -> Trace:
    """Run ``fn`` with every shardsafe function call recorded, on this thread and on the threads it starts."""
    out = Trace()
    src = str(SRC) + os.sep
    importing: dict[int, int] = {}  # thread id -> module bodies running on it

    def hook(frame: FrameType, event: str, _arg: object) -> None:
        code = frame.f_code
        if event not in ("call", "return") or not code.co_filename.startswith(src):
            return
        if code.co_name == "<module>":
            tid = threading.get_ident()
            importing[tid] = importing.get(tid, 0) + (1 if event == "call" else -1)
            return
        if event == "return" or not code.co_flags & inspect.CO_NEWLOCALS or importing.get(threading.get_ident()):
            return  # a class body, or what a module runs as it is imported
        key = (code.co_filename[len(src) :], code.co_qualname)
        if key not in out.calls:
            thread = threading.current_thread()
            out.calls[key] = thread.name
            out.daemon[thread.name] = thread.daemon
        up = frame.f_back
        if up is not None and up.f_code.co_filename.startswith(src) and up.f_code.co_flags & inspect.CO_NEWLOCALS:
            caller = (up.f_code.co_filename[len(src) :], _named(up.f_code.co_qualname))
            out.edges.add((caller, (key[0], _named(key[1]))))

    before = set(threading.enumerate())  # a thread an earlier test of this process left is not the call's
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    out.left = sorted(t.name for t in threading.enumerate() if t.name.startswith("shardsafe-") and t not in before)
    return out


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _two_ranks(rank: int, world: int, root: str) -> tuple[Trace, Trace]:
    """(each rank) A save and a load of a model, its AdamW state and a tensor sharded over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {**_state(), "sharded": {"w": distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)])}}
    saved = trace(lambda: shardsafe.save(f"{root}/a", state))
    into = {**_state(), "sharded": {"w": distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)])}}
    loaded = trace(lambda: shardsafe.load(f"{root}/a", into))
    assert torch.equal(into["sharded"]["w"].full_tensor(), torch.arange(16.0).reshape(8, 2))
    return saved, loaded


def traces(ranks: bool = True) -> dict[str, Trace]:
    """Every traced call by name (module docstring); ``ranks=False`` leaves out the 2-rank run."""
    shardsafe.save, shardsafe.load, shardsafe.async_save  # noqa: B018  (the public names' imports)
    out: dict[str, Trace] = {}
    quiet = {"SHARDSAFE_PROGRESS_INTERVAL": "3600"}  # no progress report falls due: the same calls on a slow machine
    before = {name: os.environ.get(name) for name in quiet}
    os.environ.update(quiet)
    try:
        _traces(out, ranks, quiet)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return out


def _traces(out: dict[str, Trace], ranks: bool, env: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state = _state()
        out["save"] = trace(lambda: shardsafe.save(f"{tmp}/a", state))
        out["load"] = trace(lambda: shardsafe.load(f"{tmp}/a", _state()))
        out["async"] = trace(lambda: shardsafe.async_save(f"{tmp}/b", state).wait())
        out["background"] = trace(lambda: shardsafe.async_save(f"{tmp}/c", state, staging="background").wait())
        out["incremental"] = trace(lambda: shardsafe.save(f"{tmp}/d", state, base=f"{tmp}/a"))
        url = f"memory://doc-trace-{os.getpid()}"
        try:
            out["url save"] = trace(lambda: shardsafe.save(f"{url}/a", state))
            out["url load"] = trace(lambda: shardsafe.load(f"{url}/a", _state()))
        finally:
            import fsspec

            fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
        if ranks:
            (s0, l0), (s1, l1) = check_ok(run_ranks(_two_ranks, 2, f"{tmp}/ranks", timeout=120, env=env))
            out.update({"rank 0 save": s0, "rank 0 load": l0, "rank 1 save": s1, "rank 1 load": l1})


@pytest.fixture(scope="module")
def traced() -> dict[str, Trace]:
    return traces()


# --- the walks --------------------------------------------------------------------------------------

_HOP = re.compile(r"`((?:[a-z_]+/)*[a-z_]+\.py)(?::([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?))?`(?:\s+\[([\w ]+)\](?!\())?")


@dataclass(frozen=True)
class Hop:
    step: int
    file: str
    name: str | None  # None: the module itself
    tag: str | None

    def __str__(self) -> str:
        where = f"{self.file}:{self.name}" if self.name else self.file
        return f"step {self.step}: {where}" + (f" [{self.tag}]" if self.tag else "")


def walk(title: str, text: str | None = None) -> list[Hop]:
    """Every reference of the numbered steps of one walk, in the order of the text."""
    text = DOC.read_text() if text is None else text
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    steps = re.findall(r"(?ms)^(\d+)\. (.*?)(?=^\d+\. |^\S|\Z)", text[start : end if end > 0 else None])
    return [Hop(int(n), m[1], m[2], m[3]) for n, body in steps for m in _HOP.finditer(body)]


def _is_constant(file: str, name: str) -> bool:
    """A module-level assignment (a declaration the walk names, not a call)."""
    for node in ast.parse((SRC / file).read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def _called(hop: Hop, t: Trace) -> bool:
    if hop.name is None:
        return any(file == hop.file for file, _ in t.calls)
    return any(file == hop.file and (q == hop.name or q.startswith(hop.name + ".")) for file, q in t.calls)


def _first_call(hop: Hop, t: Trace, first: dict[Key, int]) -> int:
    assert hop.name is not None
    return min(
        i for (file, q), i in first.items() if file == hop.file and (q == hop.name or q.startswith(hop.name + "."))
    )


def path_hops(title: str, text: str | None = None, tags: frozenset[str] = frozenset()) -> list[Hop]:
    """The walk's hops of the plain call (and of the paths ``tags`` name): named functions and classes,
    each at its first mention."""
    seen: set[tuple[str, str]] = set()
    out = []
    for hop in walk(title, text):
        if (hop.tag is not None and hop.tag not in tags) or hop.name is None or (hop.file, hop.name) in seen:
            continue
        if not _is_constant(hop.file, hop.name):
            seen.add((hop.file, hop.name))
            out.append(hop)
    return out


def walk_problems(title: str, traced: dict[str, Trace], text: str | None = None) -> list[str]:
    """What the walk says that the traces contradict."""
    plain = traced["save" if title == SAVE else "load"]
    first = plain.first()
    bad = []
    for hop in walk(title, text):
        if hop.name is not None and _is_constant(hop.file, hop.name):
            continue
        if hop.tag is None:
            if not _called(hop, plain):
                bad.append(f"{hop}: not called by the plain call (tag it with the path that calls it)")
        elif hop.tag in UNTRACED:
            continue
        elif hop.tag not in TAGS[title]:
            bad.append(f"{hop}: unknown tag (known: {sorted(TAGS[title])} and, not traced, {sorted(UNTRACED)})")
        elif _called(hop, plain):
            bad.append(f"{hop}: the plain call runs it too, the tag is wrong")
        elif not any(_called(hop, traced[name]) for name in TAGS[title][hop.tag]):
            bad.append(f"{hop}: not called by the traced {' or '.join(TAGS[title][hop.tag])}")
    bad += order_problems(path_hops(title, text), plain, first)
    if title == SAVE and "rank 0 save" in traced:  # rank 0 of 2 takes the plain hops and its own in that order
        rank0 = traced["rank 0 save"]
        hops = [h for h in path_hops(title, text, frozenset({"2 ranks", "sharded"})) if _called(h, rank0)]
        bad += [f"rank 0 of 2: {problem}" for problem in order_problems(hops, rank0, rank0.first())]
    return bad


def order_problems(hops: list[Hop], t: Trace, first: dict[Key, int]) -> list[str]:
    """The hops of ``hops`` that ``t`` calls first before one named earlier."""
    hops = [h for h in hops if _called(h, t)]
    order = [_first_call(h, t, first) for h in hops]
    return [
        f"{b} is first called before {a}, which the walk names earlier"
        for (a, i), (b, j) in itertools.pairwise(zip(hops, order, strict=True))
        if j <= i
    ]


# --- the figures ------------------------------------------------------------------------------------


def package(file: str) -> str:
    """``engine/save.py`` -> ``engine``; a top-level module is its own package (``workers.py`` -> ``workers``)."""
    return file.split("/")[0] if "/" in file else file.removesuffix(".py")


def layers(text: str | None = None) -> dict[str, float]:
    """Each package's layer, from the table of docs/architecture.md (``11, 12``: the first of the row)."""
    text = DOC.read_text() if text is None else text
    out = {}
    for row in re.findall(r"(?m)^\| ([\d.]+)(?:, [\d.]+)? \| (.*?) \|", text):
        for unit in re.findall(r"`([a-z_]+)/?`", row[1]):
            out[unit] = float(row[0])
    out["__init__"] = out.pop("shardsafe")
    out["__main__"] = 12.0
    return out


COLUMNS = (
    "functions",
    "modules",
    "packages",
    "calls into another package",
    "of them upward",
    "walk hops",
    "package changes",
)


def measured(title: str, t: Trace) -> tuple[int, ...]:
    """The row of the table "Measured from a trace" for one walk and its plain call."""
    named = {key for key in t.calls if not key[1].split(".")[-1].startswith("<")}
    crossing = {(a, b) for a, b in t.edges if package(a[0]) != package(b[0])}
    layer = layers()
    upward = {(a, b) for a, b in crossing if layer[package(b[0])] > layer[package(a[0])]}
    hops = path_hops(title)
    changes = sum(1 for a, b in itertools.pairwise(hops) if package(a.file) != package(b.file))
    files = {file for file, _ in named}
    return len(named), len(files), len({package(f) for f in files}), len(crossing), len(upward), len(hops), changes


def quoted(text: str | None = None) -> dict[str, tuple[int, ...]]:
    """The table "Measured from a trace" of docs/architecture.md: {"save": row, "load": row}."""
    text = DOC.read_text() if text is None else text
    head = "| call | " + " | ".join(COLUMNS) + " |"
    assert head in text, f"docs/architecture.md no longer holds the table headed {head}"
    rows = re.findall(r"(?m)^\| (save|load) \| ([\d |]+)\|$", text[text.index(head) :])
    return {call: tuple(int(c) for c in cells.split("|")) for call, cells in rows[:2]}


def upward_calls(t: Trace) -> list[str]:
    layer = layers()
    return sorted(
        f"{a[0]}:{a[1]} -> {b[0]}:{b[1]}"
        for a, b in t.edges
        if package(a[0]) != package(b[0]) and layer[package(b[0])] > layer[package(a[0])]
    )


# --- the tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("title", [SAVE, LOAD])
def test_every_hop_of_the_walk_is_called_in_the_order_the_walk_names_it(title: str, traced: dict[str, Trace]) -> None:
    assert len(path_hops(title)) > 15
    problems = walk_problems(title, traced)
    assert not problems, f"docs/architecture.md, {title[3:]}, disagrees with the traced calls:\n" + "\n".join(problems)


_FIGURES = """
import json, test_doc_trace as t
got = t.traces(ranks=False)
print(json.dumps({"save": t.measured(t.SAVE, got["save"]), "load": t.measured(t.LOAD, got["load"])}))
"""


def test_the_figures_of_the_doc_are_the_traced_ones() -> None:
    """Measured in a fresh process: in one that ran other tests first, a call the first save or load of a
    process makes (or skips) would change the counts."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent / "src")])}
    done = subprocess.run(
        [sys.executable, "-c", _FIGURES], cwd=here, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = {call: tuple(row) for call, row in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    quote = quoted()
    table = "\n".join(f"| {call} | " + " | ".join(map(str, row)) + " |" for call, row in got.items())
    assert quote == got, f"docs/architecture.md's table 'Measured from a trace' is now:\n{table}"


def test_the_threads_the_docs_name(traced: dict[str, Trace]) -> None:
    """A synchronous save runs its steps on the caller's thread, its writes and fsyncs and a load's reads
    on daemon threads (``workers.py``); an async save steps 1-6 on the caller's and 7-11 on the save's
    thread; with background staging, steps 4-6 run on the save's thread too; no thread shardsafe
    starts keeps a process from exiting, and in one process none is left once the call returned
    (``wait()`` for an async save; docs/architecture.md, docs/async.md)."""

    def thread(name: str, file: str, qualname: str) -> str:
        return traced[name].calls[(file, qualname)]

    main = threading.main_thread().name
    for step in (
        ("engine/plan.py", "plan_save"),
        ("engine/save.py", "SaveJob.finish"),
        ("engine/commit.py", "Committer.run"),
    ):
        assert thread("save", *step) == main
    assert thread("async", "engine/staging.py", "stage") == main
    assert thread("async", "engine/staging.py", "fill") == main
    for name in ("async", "background"):
        assert thread(name, "engine/save.py", "SaveJob.finish").startswith("shardsafe-save-")
        assert thread(name, "engine/commit.py", "Committer.run").startswith("shardsafe-save-")
    assert thread("background", "engine/save.py", "SaveJob._capture") == main
    for step in (
        ("engine/save.py", "SaveJob._rendezvous"),
        ("engine/plan.py", "plan_save"),
        ("engine/snapshot.py", "BackgroundStaging.run"),
    ):
        assert thread("background", *step).startswith("shardsafe-save-")
    assert thread("async", "engine/inflight.py", "add") == main
    assert thread("save", "storage/local.py", "LocalWriter.close.<locals>.sync").startswith("shardsafe-write-")
    assert thread("load", "storage/local.py", "LocalStorage.read_into").startswith("shardsafe-read-")
    started = {name: daemon for t in traced.values() for name, daemon in t.daemon.items() if name != main}
    assert len(started) > 10
    assert [name for name, daemon in started.items() if not daemon] == []
    assert {name: t.left for name, t in traced.items() if not name.startswith("rank ") and t.left} == {}


def test_a_drifted_walk_fails(traced: dict[str, Trace]) -> None:
    """The checks above can fail: two hops swapped, a hop the plain call does not run left untagged or
    given the wrong tag, a hop renamed, a figure changed."""
    fake = {name: Trace(calls=dict.fromkeys(calls, "MainThread")) for name, calls in _FAKE.items()}
    head = "## One save, hop by hop\n\n1. "
    assert walk_problems(SAVE, fake, head + "`engine/api.py:save` → `engine/api.py:_start`.\n") == []
    swapped = head + "`engine/api.py:_start` → `engine/api.py:save`.\n"
    assert walk_problems(SAVE, fake, swapped) == [
        "step 1: engine/api.py:save is first called before step 1: engine/api.py:_start, which the walk names earlier"
    ]
    untagged = "## One save, hop by hop\n\n1. `engine/api.py:save`, `engine/inflight.py:add`.\n"
    assert walk_problems(SAVE, fake, untagged) == [
        "step 1: engine/inflight.py:add: not called by the plain call (tag it with the path that calls it)"
    ]
    assert walk_problems(SAVE, fake, untagged.replace("add`", "add` [async]")) == []
    assert walk_problems(SAVE, fake, untagged.replace("add`", "add`\n   [incremental]")) == [
        "step 1: engine/inflight.py:add [incremental]: not called by the traced incremental"
    ]
    assert walk_problems(SAVE, fake, untagged.replace("engine/api.py:save`", "engine/api.py:save` [async]")) == [
        "step 1: engine/api.py:save [async]: the plain call runs it too, the tag is wrong",
        "step 1: engine/inflight.py:add: not called by the plain call (tag it with the path that calls it)",
    ]
    text = DOC.read_text()
    gone = "engine/plan.py:" + "plan_write"  # spelt apart: tests/test_doc_references.py resolves this file too
    renamed = text.replace("`engine/plan.py:plan_writes`", f"`{gone}`", 1)
    assert walk_problems(SAVE, traced, renamed) == [
        f"step 5: {gone}: not called by the plain call (tag it with the path that calls it)"
    ]
    a, b = "`state/per_rank.py:apply`", "`engine/plan.py:plan_save`"
    swapped = text.replace(a, "\0").replace(b, a).replace("\0", b)
    problem = "step 5: state/per_rank.py:apply is first called before step 5: engine/plan.py:plan_save, "
    problem += "which the walk names earlier"
    assert walk_problems(SAVE, traced, swapped) == [problem, f"rank 0 of 2: {problem}"]
    row = quoted(text)["save"]
    line = "| save | " + " | ".join(map(str, row)) + " |"
    changed = text.replace(line, "| save | " + " | ".join(map(str, (row[0] + 1, *row[1:]))) + " |")
    assert quoted(changed)["save"] != measured(SAVE, traced["save"])


_FAKE: dict[str, list[Key]] = {
    "save": [("engine/api.py", "save"), ("engine/api.py", "_start")],
    "async": [("engine/inflight.py", "add")],
    "incremental": [],
}


def _main() -> Iterator[str]:
    got = traces()
    for title, name in ((SAVE, "save"), (LOAD, "load")):
        yield f"| {name} | " + " | ".join(map(str, measured(title, got[name]))) + " |"
        yield from (f"  upward: {line}" for line in upward_calls(got[name]))
        yield from (f"  {p}" for p in walk_problems(title, got))
    for name, t in got.items():
        yield f"## {name}: {len(t.calls)} first calls; threads left: {t.left}"
        yield from (f"{thread:24} {file}:{q}" for (file, q), thread in t.calls.items())


if __name__ == "__main__":
    for line in _main():
        print(line)
