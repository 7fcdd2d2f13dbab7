"""Seeded fuzzing of format v3 (tests/fuzz_v3_cases.py builds the cases, tests/fuzz_child.py runs
them, tests/test_fuzz.py's workers drive the children): manifests whose meshes and sharding rules are
damaged or hostile, and data file indexes damaged or rewritten by a hostile author, through
``inspect``, ``verify``, ``load()``, ``load(state)`` and the CLI, in children with a memory cap and a
per-case deadline. Asserted as for tests/test_fuzz.py: only ``CheckpointError``\\ s escape, no case
runs past its deadline or allocates beyond a small cap (a rule claiming 2^40 shards included),
nothing is written, a load that succeeds on a damaged checkpoint gives the original bytes, and a
failed ``load(state)`` lands no damaged byte.

``SHARDSAFE_FUZZ_V3_CASES`` (default 24: half manifests, half indexes) and ``SHARDSAFE_FUZZ_SEED``
(default 12) choose the run; the long run is e.g. ``SHARDSAFE_FUZZ_V3_CASES=4000``.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import shardsafe
from fuzz_v3_cases import build, rule_base
from hostile import manifest_of, save_base
from test_fuzz import WORKERS, _cli_sample, _report, _tree, _worker

CASES = int(os.environ.get("SHARDSAFE_FUZZ_V3_CASES", "24"))
SEED = int(os.environ.get("SHARDSAFE_FUZZ_SEED", "12"))
CLI_SAMPLES = max(1, CASES // 200)  # each a fresh interpreter: a handful in the long run
pytestmark = pytest.mark.timeout(300 + CASES)


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzz-v3")
    base = root / "base"
    save_base(base)
    rule_base(base)
    doc = manifest_of(base)
    assert {n for n, t in doc["tensors"].items() if "sharding" in t} == {"x", "optim/state/weight/exp_avg"}
    shardsafe.verify(base)
    started = time.monotonic()
    cases = []
    for i in range(CASES):
        meta = build(base, root / "cases" / f"c{i:05d}", SEED * 1_000_003 + i)
        cases.append({"id": i, "dir": str(root / "cases" / f"c{i:05d}"), "base": str(base), **meta})
    built = time.monotonic()
    before = _tree(root, ("scratch-", "results-", "spec-", "stderr-"))
    results: dict[int, dict[str, Any]] = {}
    threads = [
        threading.Thread(target=_worker, args=(root, f"v3-{w}", cases[w::WORKERS], base, results))
        for w in range(WORKERS)
    ]
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
    families = collections.Counter(c["family"] for c in cases)
    refused = collections.Counter(f"{c['family']}:{op}" for c in by_id.values() for op in c["outcomes"])
    print(
        f"\nfuzz v3: {CASES} cases (seed {SEED}) in {time.monotonic() - started:.1f}s (build {built - started:.1f}s, "
        f"run {ran - built:.1f}s, {len(sample)} CLI runs): {dict(families)}; refused per family and reader: "
        f"{dict(refused)}"
    )
    if os.environ.get("SHARDSAFE_FUZZ_DUMP"):
        Path(os.environ["SHARDSAFE_FUZZ_DUMP"]).write_text(json.dumps(list(by_id.values()), indent=1))
    shutil.rmtree(root / "cases", ignore_errors=True)
    return {"cases": by_id, "outside": outside}


def test_fuzz_v3_only_checkpoint_errors_bounded_no_writes_no_silent_damage(fuzz: dict[str, Any]) -> None:
    assert not fuzz["outside"], "a reader wrote outside the checkpoint"
    problems = _report(list(fuzz["cases"].values()), {"escape", "alloc", "silent", "write", "hang", "crash", "lost"})
    assert not problems, f"{len(problems)} violations:\n" + "\n".join(problems[:40])


def test_fuzz_v3_failed_load_lands_no_damaged_byte_and_changes_nothing_else(fuzz: dict[str, Any]) -> None:
    problems = _report(list(fuzz["cases"].values()), {"state"})
    assert not problems, f"{len(problems)} failed loads changed the state:\n" + "\n".join(problems[:40])


def test_fuzz_v3_damage_is_found(fuzz: dict[str, Any]) -> None:
    """Most cases are refused by some reader (a damaged index or rule is not silently ignored)."""
    cases = list(fuzz["cases"].values())
    refused = [c for c in cases if c["outcomes"]]
    assert len(refused) >= len(cases) // 2, [c["what"] for c in cases if not c["outcomes"]][:20]
