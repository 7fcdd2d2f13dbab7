"""Seeded, structure-aware fuzzing of the read side (tests/fuzz_cases.py builds the cases,
tests/fuzz_child.py runs them): every damaged or hostile checkpoint, through ``inspect``, ``verify``,
``load()``, ``load(state)`` and the CLI, in children with a memory cap and a per-case deadline.

Asserted: only ``CheckpointError``\\ s escape; no case runs past its deadline; nothing allocates
beyond a small cap (the checkpoint declares a few KB); nothing is written in or around the
checkpoint; a load that succeeds on a damaged checkpoint gives the original bytes; ``python -m
shardsafe verify`` exits 1 with one line on every damaged case (sampled: each run is a fresh
interpreter). And ``load(state)`` that raises changes nothing but tensors filled in place, and those
only to the checkpoint's correct bytes (damage found while reading stops the load after the blocks
verified before it: no damaged or misplaced byte ever lands).

``SHARDSAFE_FUZZ_CASES`` (default 150) and ``SHARDSAFE_FUZZ_SEED`` (default 12) choose the run; the
long run is e.g. ``SHARDSAFE_FUZZ_CASES=3000``. ``SHARDSAFE_FUZZ_DUMP=FILE`` writes every case's
outcomes there.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import shardsafe
from fuzz_cases import build
from hostile import reshard, save_base

CASES = int(os.environ.get("SHARDSAFE_FUZZ_CASES", "150"))
SEED = int(os.environ.get("SHARDSAFE_FUZZ_SEED", "12"))
WORKERS = 2
DEADLINE = 60.0  # seconds per case: a hang detector (a case takes ~0.05 s), not a timing
MEMORY = 1 << 30  # bytes a child may grow by beyond importing torch
TESTS = Path(__file__).resolve().parent
SRC = Path(shardsafe.__file__).resolve().parents[1]
CLI_SAMPLES = max(2, CASES // 100)
pytestmark = pytest.mark.timeout(300 + CASES)  # a hang guard for the whole run, long runs included


def _env(scratch: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
        "TMPDIR": str(scratch),
        "HOME": str(scratch),
        "MALLOC_ARENA_MAX": "2",
        "OMP_NUM_THREADS": "1",
        "SHARDSAFE_IO_TIMEOUT": "30",
        "SHARDSAFE_TIMEOUT": "30",
    }


def _worker(root: Path, name: str, cases: list[dict[str, Any]], base: Path, results: dict[int, dict[str, Any]]) -> None:
    """Run ``cases`` in children, one at a time; a child silent on one case for ``DEADLINE`` seconds
    is killed, the case recorded as a hang, and a new child takes the rest."""
    scratch = root / f"scratch-{name}"
    scratch.mkdir()
    todo = list(cases)
    attempt = 0
    while todo:
        attempt += 1
        out = root / f"results-{name}-{attempt}.jsonl"
        spec = root / f"spec-{name}-{attempt}.json"
        spec.write_text(
            json.dumps(
                {"base": str(base), "cases": todo, "results": str(out), "scratch": str(scratch), "memory": MEMORY}
            )
        )
        out.touch()
        child = subprocess.Popen(
            [sys.executable, str(TESTS / "fuzz_child.py"), str(spec)],
            env=_env(scratch),
            cwd=scratch,
            stdout=subprocess.DEVNULL,
            stderr=open(root / f"stderr-{name}-{attempt}.txt", "w"),  # noqa: SIM115
            start_new_session=True,
        )
        started: int | None = None
        last = time.monotonic() + 120  # the child's start: torch import and the reference loads
        seen = 0
        while True:
            lines = out.read_text().splitlines()
            complete = [json.loads(line) for line in lines if line.endswith("}")]
            if len(complete) > seen:
                seen, last = len(complete), time.monotonic()
                for rec in complete:
                    if "start" in rec:
                        started = rec["start"]
                    else:
                        results[rec["id"]] = rec
                        started = None
            if child.poll() is not None:
                break
            if time.monotonic() - last > (DEADLINE if started is not None else 180):
                child.kill()
                child.wait()
                break
            time.sleep(0.1)
        done = {c["id"] for c in todo if c["id"] in results}
        if started is not None and started not in done:
            results[started] = {"id": started, "outcomes": {}, "violations": [{"kind": "hang", "op": "any"}]}
            done.add(started)
        elif child.returncode not in (0, None) and len(done) < len(todo):
            first = next(c["id"] for c in todo if c["id"] not in done)
            err = (root / f"stderr-{name}-{attempt}.txt").read_text()[-2000:]
            results[first] = {
                "id": first,
                "outcomes": {},
                "violations": [{"kind": "crash", "op": "any", "detail": err}],
            }
            done.add(first)
        todo = [c for c in todo if c["id"] not in done]


def _tree(root: Path, skip: tuple[str, ...]) -> list[tuple[str, int, int]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(skip)]
        for n in dirnames + filenames:
            if not n.startswith(skip):
                st = os.lstat(os.path.join(dirpath, n))
                out.append((os.path.relpath(os.path.join(dirpath, n), root), st.st_mode, st.st_size))
    return sorted(out)


def _cli_sample(case: dict[str, Any], scratch: Path) -> str | None:
    """``python -m shardsafe verify`` on one case, in a fresh interpreter under the memory cap: the
    problem, or None when it exited 1 with one line on stderr (0 with one on stdout when intact)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))

    try:
        run = subprocess.run(
            [sys.executable, "-m", "shardsafe", "verify", str(Path(case["dir"]) / "ckpt")],
            env=_env(scratch),
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=DEADLINE * 2,
            preexec_fn=cap,
        )
    except subprocess.TimeoutExpired:
        return "hang"
    intact = "verify" not in case["outcomes"]
    text = run.stdout if intact else run.stderr
    if run.returncode != (0 if intact else 1) or text.count("\n") != 1 or "Traceback" in run.stderr:
        return f"exit {run.returncode}: {run.stdout[-300:]!r} {run.stderr[-600:]!r}"
    return None


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzz")
    base = root / "base"
    save_base(base)
    reshard(base, "x", [0, 3, 7])  # a tensor in three chunks, in three more data files
    shardsafe.verify(base)
    # Every fourth case mutates an incremental checkpoint (format v2 references) of the same state,
    # whose unchanged chunks live in the sibling "prev" (a copy of base; x is resharded there, so
    # written again): the references, the refs table and the sibling's files are attacked too.
    inc = root / "inc"
    shutil.copytree(base, inc / "prev")
    save_base(inc / "ckpt", base=inc / "prev")
    assert shardsafe.inspect(inc / "ckpt").bases == ["prev"]
    shardsafe.verify(inc / "ckpt")
    started = time.monotonic()
    cases = []
    for i in range(CASES):
        incremental = i % 4 == 3
        src, siblings = (inc / "ckpt", (inc / "prev",)) if incremental else (base, ())
        meta = build(src, root / "cases" / f"c{i:05d}", SEED * 1_000_003 + i, siblings)
        cases.append({"id": i, "dir": str(root / "cases" / f"c{i:05d}"), "base": str(src), **meta})
    built = time.monotonic()
    before = _tree(root, ("scratch-", "results-", "spec-", "stderr-"))
    results: dict[int, dict[str, Any]] = {}

    def lane(w: int) -> None:  # each worker runs its share of the cases of each source checkpoint
        for src in (base, inc / "ckpt"):
            mine = [c for c in cases[w::WORKERS] if c["base"] == str(src)]
            _worker(root, f"{w}{src.parent.name}", mine, src, results)

    threads = [threading.Thread(target=lane, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outside = _tree(root, ("scratch-", "results-", "spec-", "stderr-")) != before
    by_id = {c["id"]: {**c, **results.get(c["id"], {"outcomes": {}, "violations": [{"kind": "lost"}]})} for c in cases}
    damaged = [c for c in by_id.values() if "verify" in c["outcomes"]]
    sample = damaged[:: max(1, len(damaged) // CLI_SAMPLES)][:CLI_SAMPLES]
    ran = time.monotonic()
    scratch = root / "scratch-cli"
    scratch.mkdir()
    with ThreadPoolExecutor(WORKERS) as pool:
        for case, problem in zip(sample, pool.map(lambda c: _cli_sample(c, scratch), sample), strict=True):
            if problem:
                case["violations"].append({"kind": "escape", "op": "python -m shardsafe verify", "detail": problem})
    if os.listdir(scratch):
        outside = True
    took = time.monotonic() - started
    kinds = collections.Counter(c["kind"] for c in cases)
    refused = collections.Counter(op for c in by_id.values() for op in c["outcomes"])
    in_cases = sum(c.get("seconds", 0) for c in by_id.values())
    print(
        f"\nfuzz: {CASES} cases (seed {SEED}) in {took:.1f}s (build {built - started:.1f}s, run {ran - built:.1f}s of "
        f"which {in_cases:.1f}s in cases, {len(sample)} CLI runs {time.monotonic() - ran:.1f}s): {dict(kinds)}; "
        f"refused per reader: {dict(refused)}"
    )
    if os.environ.get("SHARDSAFE_FUZZ_DUMP"):  # every case's outcomes, for a closer look
        Path(os.environ["SHARDSAFE_FUZZ_DUMP"]).write_text(json.dumps(list(by_id.values()), indent=1))
    shutil.rmtree(root / "cases", ignore_errors=True)
    return {"cases": by_id, "outside": outside}


def _report(cases: list[dict[str, Any]], kinds: set[str]) -> list[str]:
    lines = []
    for c in cases:
        for v in c["violations"]:
            if v["kind"] in kinds:
                lines.append(
                    f"case {c['id']} ({c['kind']}: {c['what']}): {v['kind']} in {v.get('op')}: {v.get('detail', '')}"
                )
    return lines


def test_fuzz_only_checkpoint_errors_bounded_no_writes_no_silent_damage(fuzz: dict[str, Any]) -> None:
    assert not fuzz["outside"], "a reader wrote outside the checkpoint"
    problems = _report(list(fuzz["cases"].values()), {"escape", "alloc", "silent", "write", "hang", "crash", "lost"})
    assert not problems, f"{len(problems)} violations:\n" + "\n".join(problems[:40])


def test_fuzz_failed_load_lands_no_damaged_byte_and_changes_nothing_else(fuzz: dict[str, Any]) -> None:
    problems = _report(list(fuzz["cases"].values()), {"state"})
    assert not problems, f"{len(problems)} failed loads changed the state:\n" + "\n".join(problems[:40])
