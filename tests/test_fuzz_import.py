"""Seeded, structure-aware fuzzing of the importer (torch.save zip and legacy files, DCP folders, Hugging
Face safetensors) and of export targets: tests/fuzz_import.py builds the cases and runs them in children
with a memory cap and a per-case deadline.

Asserted: only ``CheckpointError``\\ s escape (``shardsafe import`` too: exit 1 for damage, never
``--allow-pickle`` advice for it, one line); no case runs past its deadline; nothing allocates beyond
the cap (the sources are a few KB); an import that succeeds on damaged bytes holds exactly the source's
tensors and values where the format has checksums (zip records, DCP items) and the same names, dtypes and
shapes where it has none (legacy files, DCP metadata, safetensors: such changes are counted, not
failed); nothing changes beside the import's destination or the export's target, and a failed operation
leaves nothing behind; no payload runs; an export that succeeds is complete and holds the source's data.

``SHARDSAFE_FUZZ_CASES`` (default 100) and ``SHARDSAFE_FUZZ_SEED`` (default 22) choose the run; the long
run is e.g. ``SHARDSAFE_FUZZ_CASES=2000``. ``SHARDSAFE_FUZZ_DUMP=FILE`` writes every case's outcome there.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import shardsafe

pytest.importorskip("safetensors")
from fuzz_import import build, references

CASES = int(os.environ.get("SHARDSAFE_FUZZ_CASES", "100"))
SEED = int(os.environ.get("SHARDSAFE_FUZZ_SEED", "22"))
WORKERS = 2
DEADLINE = 60.0  # seconds per case: a hang detector (a case takes ~0.05 s), not a timing
MEMORY = 1 << 30  # bytes a child may grow by beyond importing torch
TESTS = Path(__file__).resolve().parent
SRC = Path(shardsafe.__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300 + 2 * CASES)


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
        "HF_HUB_OFFLINE": "1",
    }


def _worker(root: Path, name: str, cases: list[dict[str, Any]], refs: dict[str, str], out: dict[int, Any]) -> None:
    """Run ``cases`` in children, one at a time; a child silent on one case for ``DEADLINE`` seconds is
    killed, the case recorded as a hang, and a new child takes the rest."""
    scratch = root / f"scratch-{name}"
    scratch.mkdir()
    todo, attempt = list(cases), 0
    while todo:
        attempt += 1
        results, spec = root / f"results-{name}-{attempt}.jsonl", root / f"spec-{name}-{attempt}.json"
        spec.write_text(
            json.dumps(
                {"refs": refs, "cases": todo, "results": str(results), "scratch": str(scratch), "memory": MEMORY,
                 "cli_every": 4}
            )
        )  # fmt: skip
        results.touch()
        child = subprocess.Popen(
            [sys.executable, str(TESTS / "fuzz_import.py"), str(spec)],
            env=_env(scratch),
            cwd=scratch,
            stdout=subprocess.DEVNULL,
            stderr=open(root / f"stderr-{name}-{attempt}.txt", "w"),  # noqa: SIM115
            start_new_session=True,
        )
        started: int | None = None
        killed = False
        last, seen = time.monotonic() + 120, 0  # the child's start: torch and the reference imports
        while True:
            complete = [json.loads(x) for x in results.read_text().splitlines() if x.endswith("}")]
            if len(complete) > seen:
                seen, last = len(complete), time.monotonic()
                for rec in complete:
                    if "start" in rec:
                        started = rec["start"]
                    else:
                        out[rec["id"]], started = rec, None
            if child.poll() is not None:
                break
            if time.monotonic() - last > (DEADLINE if started is not None else 180):
                child.kill()
                child.wait()
                killed = True
                break
            time.sleep(0.05)
        done = {c["id"] for c in todo if c["id"] in out}
        err = (root / f"stderr-{name}-{attempt}.txt").read_text()[-2000:]
        if started is not None and started not in done:  # killed at its deadline, or died on the case
            what = "hang" if killed else "crash"
            out[started] = {"id": started, "outcome": what, "violations": [{"kind": what, "op": "any", "detail": err}]}
            done.add(started)
        elif child.returncode not in (0, None) and len(done) < len(todo):
            first = next(c["id"] for c in todo if c["id"] not in done)
            out[first] = {
                "id": first,
                "outcome": "crash",
                "violations": [{"kind": "crash", "op": "any", "detail": err}],
            }
            done.add(first)
        todo = [c for c in todo if c["id"] not in done]


def _outside(root: Path) -> list[str]:
    """Everything under ``root`` but the case folders and the harness's own files."""
    skip = ("cases", "scratch-", "results-", "spec-", "stderr-", "refs")
    return sorted(n for n in os.listdir(root) if not n.startswith(skip))


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzz-import")
    started = time.monotonic()
    refs = {k: str(v) for k, v in references(root / "refs").items()}
    cases = []
    for i in range(CASES):
        folder = root / "cases" / f"c{i:05d}"
        meta = build({k: Path(v) for k, v in refs.items()}, folder, SEED * 1_000_003 + i)
        cases.append({"id": i, "dir": str(folder), **meta})
    built = time.monotonic()
    before = _outside(root)
    results: dict[int, Any] = {}
    threads = [
        threading.Thread(target=_worker, args=(root, str(w), cases[w::WORKERS], refs, results)) for w in range(WORKERS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_id = {
        c["id"]: {**c, **results.get(c["id"], {"outcome": "lost", "violations": [{"kind": "lost"}]})} for c in cases
    }
    took = time.monotonic() - started
    kinds = collections.Counter(c["kind"] for c in cases)
    outcomes = collections.Counter(f"{c['kind']}: {c['outcome']}" for c in by_id.values())
    undetectable = sum(1 for c in by_id.values() if c.get("undetectable"))
    in_cases = sum(c.get("seconds", 0) for c in by_id.values())
    print(
        f"\nimport/export fuzz: {CASES} cases (seed {SEED}) in {took:.1f}s (build {built - started:.1f}s, "
        f"{in_cases:.1f}s in cases): {dict(sorted(kinds.items()))}; outcomes {dict(sorted(outcomes.items()))}; "
        f"{undetectable} imports changed bytes no checksum covers (legacy, DCP metadata, safetensors)"
    )
    if os.environ.get("SHARDSAFE_FUZZ_DUMP"):
        Path(os.environ["SHARDSAFE_FUZZ_DUMP"]).write_text(json.dumps(list(by_id.values()), indent=1))
    outside = _outside(root) != before
    shutil.rmtree(root / "cases", ignore_errors=True)
    return {"cases": by_id, "outside": outside}


def test_fuzz_imports_and_exports_raise_only_checkpoint_errors_bounded_no_silent_damage(fuzz: dict[str, Any]) -> None:
    assert not fuzz["outside"], "a case wrote outside its folder"
    problems = [
        f"case {c['id']} ({c['kind']}: {c['what']}): {v['kind']} in {v.get('op')}: {str(v.get('detail', ''))[:1500]}"
        for c in fuzz["cases"].values()
        for v in c["violations"]
    ]
    assert not problems, f"{len(problems)} violations:\n" + "\n".join(problems[:30])
