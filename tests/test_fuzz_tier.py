"""Seeded fuzzing of the node-local tier's folders (tests/fuzz_tier.py builds and runs the cases): the read
side of resume for 4 ranks placed on nodes at random (report, plan, load, then the deletes of resume and
retention), a whole one-rank manager (resume, save, resume), and a replica server taking in hostile
pushes and serving booby-trapped pulls; over folders holding links (steps, entries, files, the run's own
folder), FIFOs, foreign names, another run's shares, misplaced copies, damaged or edited manifests, flipped
bytes, tombstones, leftovers of crashed transfers and saves, a damaged or changed run record, a lost node.

Asserted, in children with a memory cap and a per-case deadline: only ``CheckpointError``\\ s escape; a
resume (planned or whole) uses only the run's counted saves and loads exactly what that save wrote for
each rank, never a step mixed from two saves, and never passes over the newest counted save that no
mutation touched; nothing that is not the run's (another run's folder or share, a foreign name, a link
or what it points to) changes or goes, nor the copies a resume was made from; a push leaves no transfer
behind and a server takes a good push after any hostile one; a manager that saved resumes its save.

``SHARDSAFE_FUZZ_CASES`` (default 8 here) and ``SHARDSAFE_FUZZ_SEED`` (default 31) choose the run; the long
run is e.g. ``SHARDSAFE_FUZZ_CASES=2000``. ``SHARDSAFE_FUZZ_DUMP=FILE`` writes every case's outcome there.
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
from fuzz_tier import _clear, build_templates, plan, snapshot

CASES = int(os.environ.get("SHARDSAFE_FUZZ_CASES", "8"))
SEED = int(os.environ.get("SHARDSAFE_FUZZ_SEED", "31"))
WORKERS = 2
DEADLINE = 90.0  # seconds per case: a hang detector (a case takes ~0.3 s), not a timing
MEMORY = 1 << 30
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
        "SHARDSAFE_TIER_SOCKET_SECONDS": "10",
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
                [sys.executable, str(TESTS / "fuzz_tier.py"), str(spec)],
                env=_env(scratch),
                cwd=scratch,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
            started: int | None = None
            killed = False
            last, seen = time.monotonic() + 120, 0
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
            _clear(work / f"c{started}")  # the copy the killed child was working on
        elif child.returncode not in (0, None) and len(done) < len(todo):
            first = started if started is not None else next(c["id"] for c in todo if c["id"] not in done)
            results[first] = {"id": first, "violations": [{"kind": "crash", "detail": stderr.read_text()[-2000:]}]}
            done.add(first)
            _clear(work / f"c{first}")
        todo = [c for c in todo if c["id"] not in done]


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    top = tmp_path_factory.mktemp("fuzzt")
    started = time.monotonic()
    build_templates(top / "templates")
    before = snapshot({top / "templates"})
    cases = [{"id": i, **plan(SEED * 1_000_003 + i)} for i in range(CASES)]
    built = time.monotonic()
    results: dict[int, dict[str, Any]] = {}
    threads = [threading.Thread(target=_worker, args=(top, str(w), cases[w::WORKERS], results)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    changed = snapshot({top / "templates"}) != before
    left = [f"{d}-{w}/{n}" for w in range(WORKERS) for d in ("work", "scratch") for n in os.listdir(top / f"{d}-{w}")]
    outside = (["the templates changed"] if changed else []) + left
    by_id = {c["id"]: {**c, **results.get(c["id"], {"violations": [{"kind": "lost"}]})} for c in cases}
    took = time.monotonic() - started
    modes = collections.Counter(c["mode"] for c in cases)
    mutations = collections.Counter(m for c in cases for m in c.get("mutations", []))
    kinds = collections.Counter(c["kind"] for c in cases if c["mode"] == "receive")
    resumed = collections.Counter(
        f"{c['mode']}: {'none' if c.get('chosen') is None else 'a step'}"
        for c in by_id.values()
        if c["mode"] != "receive"
    )
    failed = collections.Counter(str(c.get("outcome", "")).split(":")[0] for c in by_id.values() if c.get("outcome"))
    violations = sum(len(c["violations"]) for c in by_id.values())
    in_cases = sum(c.get("seconds", 0) for c in by_id.values())
    print(
        f"\ntier fuzz: {CASES} cases (seed {SEED}) in {took:.1f}s (templates {built - started:.1f}s, "
        f"{in_cases:.1f}s in cases); {violations} violations; modes {dict(modes)}; resumed {dict(resumed)}; "
        f"raised {dict(failed)}; mutations {dict(mutations)}; receive kinds {len(kinds)}"
    )
    if os.environ.get("SHARDSAFE_FUZZ_DUMP"):
        Path(os.environ["SHARDSAFE_FUZZ_DUMP"]).write_text(json.dumps(list(by_id.values()), indent=1))
    return {"cases": by_id, "outside": outside}


def test_tier_fuzz_uses_only_the_runs_own_saves_and_deletes_nothing_else(fuzz: dict[str, Any]) -> None:
    assert not fuzz["outside"], f"a case wrote into the templates or left files behind: {fuzz['outside'][:10]}"
    problems = [
        f"case {c['id']} ({c['mode']}: {c.get('mutations') or c.get('kind')}; {c.get('what', '')}): {v['kind']}: "
        f"{v.get('detail', '')}"
        for c in fuzz["cases"].values()
        for v in c["violations"]
    ]
    assert not problems, f"{len(problems)} violations:\n" + "\n".join(problems[:40])
