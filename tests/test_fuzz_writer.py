"""Seeded fuzzing of the writer (tests/fuzz_writer.py builds and runs the cases): ``save`` and
``async_save`` with ``base=`` over damaged or mutated bases (flipped bytes in data and headers,
stale or forged digests and checksums, swapped byte ranges, renamed, missing, truncated files,
FIFOs, symlinks, hostile manifests, retired, removed or symlinked bases), overwrites, and an
incremental ``CheckpointManager`` saving over a damaged root (retention and cleanup included).

Asserted, in children with a memory cap and a per-case deadline: a save either commits a checkpoint
that verifies and loads exactly the state saved (bit for bit), or raises a ``CheckpointError`` and
leaves its target as it was; an incremental manager's save never fails because of a damaged
checkpoint; nothing outside the root is written, and a save to a new path changes nothing else in
the root; no case runs past its deadline.

``SHARDSAFE_FUZZ_CASES`` (default 30 here) and ``SHARDSAFE_FUZZ_SEED`` (default 12) choose the run;
``SHARDSAFE_FUZZ_DUMP=FILE`` writes every case's outcome there.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import shardsafe
from fuzz_writer import build_templates, plan, snapshot

CASES = int(os.environ.get("SHARDSAFE_FUZZ_CASES", "30"))
SEED = int(os.environ.get("SHARDSAFE_FUZZ_SEED", "12"))
WORKERS = 2
DEADLINE = 60.0  # seconds per case: a hang detector (a case takes ~0.1 s), not a timing
MEMORY = 1 << 30  # bytes a child may grow by beyond importing torch
TESTS = Path(__file__).resolve().parent
SRC = Path(shardsafe.__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300 + CASES)


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


def _worker(top: Path, name: str, cases: list[dict[str, Any]], results: dict[int, dict[str, Any]]) -> None:
    """Run ``cases`` in children, one at a time; a child silent on one case for ``DEADLINE`` seconds is
    killed, the case recorded as a hang, and a new child takes the rest."""
    scratch, work = top / f"scratch-{name}", top / f"work-{name}"
    scratch.mkdir()
    work.mkdir()
    todo = list(cases)
    attempt = 0
    while todo:
        attempt += 1
        out, spec = top / f"results-{name}-{attempt}.jsonl", top / f"spec-{name}-{attempt}.json"
        spec.write_text(
            json.dumps(
                {
                    "templates": str(top / "templates"),
                    "work": str(work),
                    "scratch": str(scratch),
                    "memory": MEMORY,
                    "cases": todo,
                    "results": str(out),
                }
            )
        )
        out.touch()
        stderr = top / f"stderr-{name}-{attempt}.txt"
        with open(stderr, "w") as err:
            child = subprocess.Popen(
                [sys.executable, str(TESTS / "fuzz_writer.py"), str(spec)],
                env=_env(scratch),
                cwd=scratch,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
            started: int | None = None
            killed = False
            last, seen = time.monotonic() + 120, 0  # the child's start: torch import, the references
            while True:
                lines = [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]
                if len(lines) > seen:
                    seen, last = len(lines), time.monotonic()
                    for rec in lines:
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
                    killed = True
                    break
                time.sleep(0.1)
        done = {c["id"] for c in todo if c["id"] in results}
        if killed and started is not None and started not in done:
            results[started] = {"id": started, "violations": [{"kind": "hang"}]}
            done.add(started)
        elif child.returncode not in (0, None) and len(done) < len(todo):
            first = started if started is not None else next(c["id"] for c in todo if c["id"] not in done)
            results[first] = {"id": first, "violations": [{"kind": "crash", "detail": stderr.read_text()[-2000:]}]}
            done.add(first)
        todo = [c for c in todo if c["id"] not in done]


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    top = tmp_path_factory.mktemp("fuzzw")
    started = time.monotonic()
    build_templates(top / "templates")
    cases = [{"id": i, **plan(SEED * 1_000_003 + i)} for i in range(CASES)]
    before = snapshot(top / "templates")
    built = time.monotonic()
    results: dict[int, dict[str, Any]] = {}
    threads = [threading.Thread(target=_worker, args=(top, str(w), cases[w::WORKERS], results)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outside = snapshot(top / "templates") != before or any(os.listdir(top / f"work-{w}") for w in range(WORKERS))
    by_id = {c["id"]: {**c, **results.get(c["id"], {"violations": [{"kind": "lost"}]})} for c in cases}
    took = time.monotonic() - started
    mix = collections.Counter(f"{c['mode']}/{c['mutation']}" for c in cases)
    outcomes = collections.Counter(
        f"{c['mode']}: {'ok' if c.get('outcome') == 'ok' else str(c.get('outcome', '?')).split(':')[0]}"
        for c in by_id.values()
    )
    referred = sum(1 for c in by_id.values() if c.get("refs"))
    warned = sum(1 for c in by_id.values() if c.get("warnings"))
    violations = sum(len(c["violations"]) for c in by_id.values())
    in_cases = sum(c.get("seconds", 0) for c in by_id.values())
    print(
        f"\nwriter fuzz: {CASES} cases (seed {SEED}) in {took:.1f}s (templates {built - started:.1f}s, "
        f"{in_cases:.1f}s in cases); {violations} violations; outcomes {dict(sorted(outcomes.items()))}; "
        f"{referred} saves referred to base chunks, {warned} warned of a base file that does not verify; "
        f"modes {dict(collections.Counter(c['mode'] for c in cases))}; "
        f"mutations {dict(collections.Counter(c['mutation'] for c in cases))}; {len(mix)} mode/mutation pairs"
    )
    if os.environ.get("SHARDSAFE_FUZZ_DUMP"):
        Path(os.environ["SHARDSAFE_FUZZ_DUMP"]).write_text(json.dumps(list(by_id.values()), indent=1))
    return {"cases": by_id, "outside": outside}


def test_writer_fuzz_commits_only_exact_checkpoints_or_raises_checkpoint_errors(fuzz: dict[str, Any]) -> None:
    assert not fuzz["outside"], "a case wrote into the templates or left files behind"
    problems = [
        f"case {c['id']} ({c['mode']}/{c['mutation']}: {c.get('what', '?')}): {v['kind']}: {v.get('detail', '')}"
        for c in fuzz["cases"].values()
        for v in c["violations"]
    ]
    assert not problems, f"{len(problems)} violations:\n" + "\n".join(problems[:40])
