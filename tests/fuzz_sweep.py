"""Seeded fuzzing of the sweep of leftovers, the target check and the delete rule (run by
tests/test_fuzz_sweep.py; ``python tests/fuzz_sweep.py --cases N --seed S`` runs a big campaign and
prints its figures).

Each case (:func:`plan`, then :func:`run_case`) copies a root holding one committed checkpoint
``ck`` (local path or ``file://``), litters it with entries, and runs one operation:

- the writer: ``overwrite`` (a save over ``ck``, whose sweep meets the litter), ``skewed`` (the same
  on a host whose clock is up to 2 h ahead or behind), ``concurrent`` (a second save of ``ck``, on a
  skewed host, runs while the first builds its manifest), ``long`` (the same, the first save's files
  made older than the leftover age first: it took too long), ``link_target`` (a save to a link),
  ``link_base`` (``base=`` a link to ``ck``), ``import`` (``import_checkpoint`` into ``ck``);
- the cleanup and the delete rule: ``cleanup`` (a manager's cleanup of the root, maybe skewed),
  ``delete`` (:func:`shardsafe.catalog.delete.delete_checkpoint` of ``ck`` or of a link to it);
- the reader: ``ls`` (``shardsafe ls --json`` of the root) and, after every case, ``verify`` and
  ``load`` of what should be committed.

The litter (before the operation, or, for the target's entries, while the save builds its manifest:
a target holding what shardsafe does not write is refused): foreign names, names with non-ASCII
digits, symbolic links named like data files or pending directories (to files and folders outside
the root, dangling), FIFOs, sockets and folders named like data files, orphans old and fresh, saves
in flight (a fresh in-flight marker, old files) and abandoned ones, pending directories fresh and
old (with dotted save ids, some holding a foreign file), clock probes old and fresh.

Violations: ``escape`` (an exception other than the expected ``CheckpointError``), ``outside``
(anything outside the root changed: link targets), ``kept`` (an entry that must stay changed or went:
foreign, non-ASCII, links, FIFOs, sockets, folders, fresh files, saves in flight, whatever the
clocks), ``swept`` (an old orphan, abandoned save, abandoned pending directory or old probe stayed
after an unskewed sweep), ``refusal`` (a refused save changed something, or a save that had to be
refused was not), ``loads`` (the checkpoint does not verify, or does not load the state of the last
save that returned), ``ls`` (a pending directory missing from the listing).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import shardsafe
from shardsafe.catalog.delete import delete_checkpoint
from shardsafe.catalog.names import PENDING_DIR, clock_probe, data_file, pending_name, temp_manifest
from shardsafe.cli.ls import ls_main
from shardsafe.engine import commit
from shardsafe.manager.cleanup import remove_leftovers
from shardsafe.manager.listing import scan
from shardsafe.storage import get_storage

OLD = 3 * 3600.0
"""How far back an "old" entry is dated (the leftover age is 1 h)."""
AGE = 3600.0
SKEWS = (-7200.0, -3000.0, 3000.0, 7200.0)
SKEWABLE = ("skewed", "concurrent", "long", "cleanup")
MODES = {
    "overwrite": 6,
    "skewed": 3,
    "concurrent": 2,
    "long": 2,
    "cleanup": 3,
    "link_target": 1,
    "link_base": 1,
    "import": 1,
    "delete": 2,
    "ls": 1,
}
TARGET_KINDS = {
    "foreign": 3,
    "unicode": 2,
    "link_file": 2,
    "link_dangling": 1,
    "fifo": 2,
    "socket": 1,
    "dir": 2,
    "staged_name": 1,
    "orphan_old": 4,
    "orphan_fresh": 2,
    "in_flight": 3,
    "abandoned": 3,
    "probe_old": 1,
    "probe_fresh": 1,
}
ROOT_KINDS = {
    "pending_fresh": 2,
    "pending_old": 3,
    "pending_foreign": 2,
    "pending_link": 2,
    "pending_fifo": 1,
    "pending_unicode": 1,
    "foreign": 1,
}
OWN = {"orphan_old", "orphan_fresh", "in_flight", "abandoned", "probe_old", "probe_fresh"}
"""Target entries of shardsafe's own names and kinds (a target holding only these is not refused)."""
UNICODE_DIGITS = ["\u0660", "\u06f0", "\u0966", "\uff10", "\u1040", "\u0e50"]


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((32,), value), "b": torch.arange(4.0) + value, "step": int(value)}


def _pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def plan(seed: int) -> dict[str, Any]:
    """The case of ``seed``: its mode, backend, skew and litter."""
    rng = random.Random(seed)
    mode = _pick(rng, MODES)
    entries: list[dict[str, Any]] = []
    for _ in range(rng.randint(0, 5)):
        kind = _pick(rng, TARGET_KINDS)
        when = "before" if kind in OWN or rng.random() < 0.3 else "during"
        if mode in ("concurrent", "long", "link_base") and kind not in OWN:
            when = "during"
        entries.append({"where": "target", "kind": kind, "when": when, "id": len(entries)})
    for _ in range(rng.randint(0, 3)):
        entries.append({"where": "root", "kind": _pick(rng, ROOT_KINDS), "when": "before", "id": len(entries)})
    return {
        "seed": seed,
        "mode": mode,
        "backend": rng.choice(["local", "file"]),
        "skew": rng.choice(SKEWS)
        if mode in ("skewed", "concurrent", "long", "cleanup") and rng.random() < 0.8
        else 0.0,
        "overwrite": rng.random() < 0.7,
        "entries": entries,
    }


# ------------------------------------------------------------------------------------- the litter


def _sid(rng: random.Random, started: float, dotted: bool = False) -> str:
    if dotted:
        return rng.choice(["a.b", "run_1.x", "z-9.q_", "..-_"]) + f".{rng.getrandbits(20):05x}"
    return f"{int(started)}{rng.getrandbits(40):010x}"


def _date(path: Path, when: float) -> None:
    os.utime(path, (when, when), follow_symlinks=False)


def _file(path: Path, data: bytes, when: float) -> Path:
    path.write_bytes(data)
    _date(path, when)
    return path


class Litter:
    """Makes the entries of a case and says what each must become: ``keep`` (there, unchanged) or
    ``gone`` (removed by an unskewed sweep that reaches it)."""

    def __init__(self, root: Path, outside: Path, rng: random.Random) -> None:
        self.root, self.outside, self.rng = root, outside, rng
        self.keep: list[Path] = []
        self.gone: list[Path] = []
        self.sockets: list[socket.socket] = []
        self.now = time.time()
        self.made_outside: dict[str, Any] = {}
        """What the litter made outside the root (link targets), as :func:`snapshot` shows it."""

    def make(self, entry: dict[str, Any]) -> None:
        rng, now = self.rng, time.time()
        old = now - OLD
        target = self.root / "ck"
        kind = entry["kind"]
        sid_old = _sid(rng, old)
        if entry["where"] == "target":
            if kind == "foreign":
                names = [f"{data_file(0, sid_old)}.part", f"x{data_file(0, sid_old)}", "data-0000-ab.safetensors"]
                name = rng.choice(["notes.txt", ".hidden", "MANIFEST.json.bak", *names])
                self.keep.append(_file(target / name, b"the user's", old))
            elif kind == "unicode":
                digits = "".join(rng.choice(UNICODE_DIGITS) for _ in range(5))
                self.keep.append(_file(target / f"data-{digits}-{sid_old}.safetensors", b"the user's", old))
            elif kind == "link_file":
                dest = _file(self.outside / f"f{entry['id']}", b"outside", old)
                self.made_outside[dest.name] = ("file", b"outside")
                link = target / data_file(rng.randint(0, 3), sid_old)
                link.symlink_to(dest)
                _date(link, old)
                self.keep.append(link)
            elif kind == "link_dangling":
                link = target / data_file(rng.randint(0, 3), sid_old)
                link.symlink_to(self.outside / "nowhere")
                self.keep.append(link)
            elif kind == "fifo":
                fifo = target / data_file(rng.randint(0, 3), sid_old)
                os.mkfifo(fifo)
                _date(fifo, old)
                self.keep.append(fifo)
            elif kind == "socket":
                sock = target / data_file(rng.randint(0, 3), sid_old)
                server = socket.socket(socket.AF_UNIX)
                here = os.getcwd()
                os.chdir(target)  # a socket's path is short: bound by its name in its folder
                try:
                    server.bind(sock.name)
                finally:
                    os.chdir(here)
                self.sockets.append(server)
                _date(sock, old)
                self.keep.append(sock)
            elif kind == "dir":
                folder = target / data_file(rng.randint(0, 3), sid_old)
                folder.mkdir()
                self.keep.append(_file(folder / data_file(0, sid_old), b"inside a folder", old))
                _date(folder, old)
            elif kind == "staged_name":
                self.keep.append(_file(target / "MANIFEST.json.tmp", b"the user's", old))
            elif kind == "orphan_old":
                self.gone.append(_file(target / data_file(rng.randint(0, 3), sid_old), b"orphan", old))
            elif kind == "orphan_fresh":
                self.keep.append(_file(target / data_file(rng.randint(0, 3), sid_old), b"fresh", now))
            elif kind == "in_flight":
                sid = _sid(rng, rng.choice([old, now]))
                self.keep.append(_file(target / temp_manifest(sid), b"", now))  # its marker changed just now
                self.keep.append(_file(target / data_file(rng.randint(0, 3), sid), b"in flight", old))
            elif kind == "abandoned":
                self.gone.append(_file(target / temp_manifest(sid_old), b"", old))
                self.gone.append(_file(target / data_file(rng.randint(0, 3), sid_old), b"abandoned", old))
            elif kind == "probe_old":
                self.gone.append(_file(target / clock_probe(sid_old), b"", old))
            elif kind == "probe_fresh":
                self.keep.append(_file(target / clock_probe(_sid(rng, now)), b"", now))
            return
        dotted = rng.random() < 0.4
        if kind == "foreign":
            self.keep.append(_file(self.root / rng.choice(["README", ".ck.staging", ".ck.litter-x"]), b"x", old))
            return
        if kind == "pending_unicode":
            digits = "".join(rng.choice(UNICODE_DIGITS) for _ in range(3))
            folder = self.root / f".ck.staging-{digits}"
            folder.mkdir()
            self.keep.append(_file(folder / data_file(0, digits), b"the user's", old))
            _date(folder, old)
            return
        sid = _sid(rng, old, dotted)
        pending = self.root / pending_name("ck", sid)
        if kind == "pending_link":
            elsewhere = self.outside / f"d{entry['id']}"
            elsewhere.mkdir()
            self.keep.append(_file(elsewhere / data_file(0, sid), b"outside", old))
            self.made_outside[elsewhere.name] = ("dir",)
            self.made_outside[f"{elsewhere.name}/{data_file(0, sid)}"] = ("file", b"outside")
            pending.symlink_to(elsewhere)
            _date(pending, old)
            self.keep.append(pending)
            return
        if kind == "pending_fifo":
            os.mkfifo(pending)
            _date(pending, old)
            self.keep.append(pending)
            return
        pending.mkdir()
        when = now if kind == "pending_fresh" else old
        own = _file(pending / data_file(0, sid), b"pending", when)
        staged = _file(pending / "MANIFEST.json", b"{}", when)
        if kind == "pending_fresh":
            self.keep += [own, staged]
        elif kind == "pending_old":
            self.gone += [own, staged, pending]
        else:
            self.gone += [own, staged]
            self.keep.append(_file(pending / "user.txt", b"the user's", old))
        _date(pending, when)

    def close(self) -> None:
        for s in self.sockets:
            s.close()


# ------------------------------------------------------------------------------------- snapshots


def snapshot(top: Path) -> dict[str, Any]:
    """Every entry under ``top`` (links not followed) with its kind and, for files, bytes."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath, name)
            rel = os.path.relpath(p, top)
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            elif p.is_file():
                out[rel] = ("file", p.read_bytes())
            else:
                out[rel] = ("other",)
    return out


def _state_of(path: Path) -> Any:
    if path.is_symlink():
        return ("link", os.readlink(path))
    if path.is_dir():
        return ("dir",)
    if path.is_file():
        return ("file", path.read_bytes())
    if path.exists():
        return ("other",)
    return None


# ------------------------------------------------------------------------------------- running


@contextlib.contextmanager
def _skewed(seconds: float) -> Iterator[None]:
    """This host's clock ``seconds`` off (``time.time`` only: monotonic deadlines are untouched)."""
    if not seconds:
        yield
        return
    real = time.time
    time.time = lambda: real() + seconds  # type: ignore[assignment]
    try:
        yield
    finally:
        time.time = real  # type: ignore[assignment]


@contextlib.contextmanager
def _at_commit(action: Callable[[], None] | None) -> Iterator[None]:
    """Run ``action()`` once, when the next save reaches ``save.commit`` (its data durable)."""
    if action is None:
        yield
        return
    real = commit.fault_point
    armed = [True]

    def hook(point: str, rank: int | None = None) -> None:
        if point == "save.commit" and armed[0]:
            armed[0] = False
            action()
        real(point, rank)

    commit.fault_point = hook  # type: ignore[assignment]
    try:
        yield
    finally:
        commit.fault_point = real  # type: ignore[assignment]


def build_template(top: Path) -> Path:
    """``top/root/ck``: one committed checkpoint of ``_state(1.0)``."""
    shardsafe.save(str(top / "root" / "ck"), _state(1.0))
    return top / "root"


def run_case(case: dict[str, Any], template: Path, work: Path) -> dict[str, Any]:
    """Run one case in ``work`` (emptied after); its outcome and violations."""
    rng = random.Random(case["seed"] * 7919 + 1)
    root, outside = work / "root", work / "outside"
    shutil.copytree(template, root, symlinks=True)
    outside.mkdir()
    litter = Litter(root, outside, rng)
    violations: list[dict[str, str]] = []
    out: dict[str, Any] = {"id": case["seed"], "mode": case["mode"], "violations": violations}
    try:
        _run(case, root, outside, litter, rng, out, violations)
    except Exception as err:  # the harness's own failure, or an escape it did not catch
        violations.append({"kind": "escape", "detail": "".join(traceback.format_exception(err))[-1500:]})
    finally:
        litter.close()
        shutil.rmtree(work / "root", ignore_errors=True)
        shutil.rmtree(work / "outside", ignore_errors=True)
    return out


def _url(case: dict[str, Any], path: Path) -> str:
    return f"file://{path}" if case["backend"] == "file" else str(path)


def _run(
    case: dict[str, Any],
    root: Path,
    outside: Path,
    litter: Litter,
    rng: random.Random,
    out: dict[str, Any],
    violations: list[dict[str, str]],
) -> None:
    mode, skew = case["mode"], case["skew"]
    target = root / "ck"
    url = _url(case, target)
    saves = mode not in ("cleanup", "delete", "ls")  # the others meet the whole litter before they start
    during = [e for e in case["entries"] if e["when"] == "during" and saves]
    for e in case["entries"]:
        if e not in during:
            litter.make(e)
    foreign_before = any(e["where"] == "target" and e["kind"] not in OWN and e not in during for e in case["entries"])
    outside_before = snapshot(outside)
    before = snapshot(root)
    expect: float | None = 1.0  # the state ck must load as afterwards
    sweeps = False  # whether an unskewed sweep reached the litter (then "gone" entries must be gone)

    def make_during() -> None:
        for e in during:
            litter.make(e)

    if mode in ("overwrite", "skewed"):
        with _at_commit(make_during if during else None), _skewed(skew):
            ok = _expect_save(lambda: shardsafe.save(url, _state(2.0), overwrite=True), foreign_before, violations)
        if ok:
            expect, sweeps = 2.0, not skew
        elif foreign_before:
            _unchanged(root, before, violations)
    elif mode in ("concurrent", "long"):
        results: dict[str, bool] = {}

        def second() -> None:
            make_during()
            if mode == "long":
                _age_in_flight(root, case["backend"], litter)
            with _skewed(skew):
                results["b"] = _expect_save(
                    lambda: shardsafe.save(url, _state(3.0), overwrite=True), False, violations, may_fail=True
                )

        with _at_commit(second):
            results["a"] = _expect_save(
                lambda: shardsafe.save(url, _state(2.0), overwrite=True), False, violations, may_fail=True
            )
        if mode == "concurrent" and not results["a"]:
            violations.append({"kind": "loads", "detail": "the first save failed, though nothing took too long"})
        expect = 2.0 if results["a"] else 3.0 if results.get("b") else 1.0
    elif mode == "cleanup":
        storage = get_storage(_url(case, root))
        with _skewed(skew):
            remove_leftovers(storage, storage, scan(storage, _url(case, root)), min_age=AGE)
        sweeps = not skew
    elif mode == "link_target":
        link = root / "latest"
        link.symlink_to(rng.choice(["ck", str(outside / "nowhere"), str(target)]))
        before = snapshot(root)
        with _at_commit(make_during if during else None):
            through = _url(case, link)
            _expect_save(lambda: shardsafe.save(through, _state(2.0), overwrite=case["overwrite"]), True, violations)
        _unchanged(root, before, violations)
        _check_outside(outside, outside_before, litter, violations)
        _loads(url, 1.0, violations)
        return
    elif mode == "link_base":
        (root / "latest").symlink_to("ck")
        new, latest = _url(case, root / "new"), _url(case, root / "latest")
        ok = _expect_save(lambda: shardsafe.save(new, _state(1.0), base=latest), False, violations)
        if ok:
            refs = json.loads((root / "new" / "MANIFEST.json").read_bytes()).get("refs", {})
            if list(refs) not in ([], ["ck"]):
                violations.append({"kind": "loads", "detail": f"base recorded as {list(refs)}"})
            with _at_commit(make_during if during else None):
                if _expect_save(lambda: shardsafe.save(url, _state(2.0), overwrite=True), False, violations):
                    expect = 2.0
            _loads(_url(case, root / "new"), 1.0, violations)
    elif mode == "import":
        source = outside / "source.pt"
        torch.save(_state(4.0), source)
        outside_before = snapshot(outside)
        with _at_commit(make_during if during else None):
            ok = _expect_save(
                lambda: shardsafe.import_checkpoint(str(source), url, overwrite=True), foreign_before, violations
            )
        if ok:
            expect = 4.0
        elif foreign_before:
            _unchanged(root, before, violations)
    elif mode == "delete":
        which = target
        if rng.random() < 0.3:
            which = root / "latest"
            which.symlink_to("ck")
        before = snapshot(root)
        try:
            delete_checkpoint(get_storage(_url(case, root)), _url(case, which))
        except ValueError as err:
            if which == target:
                violations.append({"kind": "escape", "detail": f"delete of ck refused: {err}"})
            _unchanged(root, before, violations)
        else:
            if which != target:
                violations.append({"kind": "refusal", "detail": "a delete through a link was not refused"})
            expect = None
            if (target / "MANIFEST.json").exists():
                violations.append({"kind": "loads", "detail": "ck still committed after its deletion"})
    elif mode == "ls":
        before = snapshot(root)
        buf = io.StringIO()
        code = ls_main(_url(case, root), verify=rng.random() < 0.5, as_json=True, out=buf)
        listed = {c["name"] for c in json.loads(buf.getvalue())["checkpoints"]}
        pending = {n for n in os.listdir(root) if PENDING_DIR.match(n) and (root / n).is_dir()}
        if code not in (0, 1) or not pending <= listed:
            violations.append(
                {"kind": "ls", "detail": f"exit {code}; listed {sorted(listed)}, pending {sorted(pending)}"}
            )
        _unchanged(root, before, violations, what="ls")
    _check_entries(litter, sweeps, violations)
    _check_outside(outside, outside_before, litter, violations)
    if expect is not None:
        _loads(url, expect, violations)
    out["outcome"] = "ok" if not violations else violations[0]["kind"]


def _age_in_flight(root: Path, backend: str, litter: Litter) -> None:
    """(inside the first save, before the second runs) Date the first save's files as if it began long
    ago: a save that took longer than the leftover age. The litter keeps its dates."""
    then = time.time() - OLD
    ours = {*litter.keep, *litter.gone}
    for p in root.iterdir():
        if (
            PENDING_DIR.match(p.name)
            and p.is_dir()
            and not p.is_symlink()
            and p not in ours
            and p not in {q.parent for q in ours}
        ):
            for q in p.iterdir():
                _date(q, then)
            _date(p, then)
    if backend == "file":
        target = root / "ck"
        listed = set(json.loads((target / "MANIFEST.json").read_bytes())["files"])
        for p in target.iterdir():
            if (
                p.is_file()
                and not p.is_symlink()
                and p.name not in listed
                and p.name != "MANIFEST.json"
                and p not in ours
            ):
                _date(p, then)


def _expect_save(
    call: Callable[[], Any], refused: bool, violations: list[dict[str, str]], *, may_fail: bool = False
) -> bool:
    """Run a save; whether it returned. A ``CheckpointError`` is expected when ``refused`` (or allowed
    with ``may_fail``); anything else escapes."""
    try:
        call()
    except shardsafe.CheckpointError as err:
        if not refused and not may_fail:
            violations.append({"kind": "escape", "detail": f"{type(err).__name__}: {err}"[:600]})
        return False
    except Exception as err:
        violations.append({"kind": "escape", "detail": f"{type(err).__name__}: {err}"[:600]})
        return False
    if refused:
        violations.append({"kind": "refusal", "detail": "a save to a target that must be refused returned"})
    return True


def _unchanged(root: Path, before: dict[str, Any], violations: list[dict[str, str]], what: str = "refusal") -> None:
    after = snapshot(root)
    if after != before:
        changed = sorted(set(after) ^ set(before)) or sorted(k for k in after if after[k] != before.get(k))
        violations.append({"kind": what, "detail": f"changed: {changed[:6]}"})


def _check_entries(litter: Litter, sweeps: bool, violations: list[dict[str, str]]) -> None:
    for path in litter.keep:
        if _state_of(path) is None:
            violations.append({"kind": "kept", "detail": f"{path.name} went"})
    if sweeps:
        left = [p.name for p in litter.gone if _state_of(p) is not None]
        if left:
            violations.append({"kind": "swept", "detail": f"left: {left}"})


def _check_outside(outside: Path, before: dict[str, Any], litter: Litter, violations: list[dict[str, str]]) -> None:
    after = snapshot(outside)
    before = {**before, **litter.made_outside}
    if after != before:
        changed = sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k))
        violations.append({"kind": "outside", "detail": f"changed outside the root: {changed[:6]}"})


def _loads(url: str, value: float, violations: list[dict[str, str]]) -> None:
    try:
        shardsafe.verify(url)
        got = shardsafe.load(url)
    except Exception as err:
        violations.append({"kind": "loads", "detail": f"{type(err).__name__}: {err}"[:600]})
        return
    if got["step"] != int(value) or not torch.equal(got["w"], _state(value)["w"]):
        violations.append({"kind": "loads", "detail": f"loads step {got['step']}, expected {int(value)}"})


def campaign(cases: int, seed: int, top: Path) -> dict[str, Any]:
    """Run ``cases`` cases from ``seed``; the figures and the violations."""
    import logging

    log = logging.getLogger("shardsafe")
    level = log.level
    log.setLevel(logging.CRITICAL)  # the cases log their refusals by design
    try:
        template = build_template(top / "template")
        started = time.monotonic()
        results = []
        for i in range(cases):
            work = top / "work"
            work.mkdir()
            results.append({**plan(seed * 1_000_003 + i), **run_case(plan(seed * 1_000_003 + i), template, work)})
            shutil.rmtree(work, ignore_errors=True)
    finally:
        log.setLevel(level)  # the caller's (a test run's later tests read the warnings)
    modes = collections.Counter(r["mode"] for r in results)
    kinds = collections.Counter(e["kind"] for r in results for e in r["entries"])
    problems = [
        f"case {r['seed']} ({r['mode']}, {r['backend']}, skew {r['skew']:+.0f}): {v['kind']}: {v.get('detail', '')}"
        for r in results
        for v in r["violations"]
    ]
    return {
        "cases": cases,
        "seed": seed,
        "seconds": round(time.monotonic() - started, 1),
        "violations": len(problems),
        "problems": problems,
        "modes": dict(sorted(modes.items())),
        "litter": dict(sorted(kinds.items())),
        "backends": dict(collections.Counter(r["backend"] for r in results)),
        "skewed": sum(1 for r in results if r["skew"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fuzz-sweep-") as top:
        figures = campaign(args.cases, args.seed, Path(top))
    print(json.dumps({k: v for k, v in figures.items() if k != "problems"}, indent=1))
    for line in figures["problems"][:40]:
        print(line)
    return 1 if figures["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
