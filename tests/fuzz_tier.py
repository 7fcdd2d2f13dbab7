"""Seeded fuzzing of the node-local tier's folders (run by tests/test_fuzz_tier.py): what resume reads,
what a local save and retention write and delete, and what a replica server takes in, over folders that
links, FIFOs, foreign names, shares of another run, damaged manifests and leftovers have been put into.

The parent builds two templates once (:func:`build_templates`), synthetically, as the protocol lays them
out (manager/tiers.py): run ``RUN`` with five saves (:data:`SAVES`) by two incarnations, the first one's
step 3 abandoned by the second (resumed from step 2), and beside it another run's complete step 9, a
step of the layout before runs were recorded, and ``elsewhere/`` (checkpoints outside, for links):

- ``multi``: 4 ranks on nodes 0 and 1 (``local-0``: ranks 0, 1; ``local-1``: ranks 2, 3), every share
  replicated to the peer node;
- ``solo``: 1 rank, ``local-0`` only; with the durable root ``durable`` (its run record).

``python fuzz_tier.py SPEC.json`` (a child) runs cases: copies a template, mutates it, runs one mode,
checks, removes the copy; a ``start`` line before each case and a result line after it (the parent kills
a child silent on one case past its deadline: a hang). Modes:

- ``multi`` (the read side of resume, and its deletes, for 4 ranks placed on nodes at random): each
  rank's report (manager/local.py:report), rank 0's plan (manager/local.py:plan), each rank loading its
  share from the source the plan names, then each rank's ``forget`` and ``retain``;
- ``manager`` (a whole one-rank manager): resume, a local save of the next step, resume again;
- ``receive`` (what a replica server takes in: the import of a copy from the network): a hostile or
  damaged push, or a pull of a damaged or booby-trapped entry; then a good push, which must work.

Violations:

- ``escape``: an exception that is not a ``CheckpointError``;
- ``foreign``: a run, a load or a plan used a copy that is not one of the run's counted saves (another
  run, an abandoned incarnation, a misplaced copy), or loaded bytes other than what that save wrote;
- ``mixed``: the ranks' shares of a resumed step come from two saves;
- ``missed``: the newest counted save that no mutation touched was passed over for an older one;
- ``deleted``: something not the run's (another run's folder or share, a foreign name, a link or what it
  points to, ``elsewhere/``) changed or went; or the resumed save lost a copy it was resumed from;
- ``leftover``: a transfer (``.incoming-``) remains after a push;
- ``dead``: the server does not take a good push after the hostile one; ``lost``: a manager that resumed
  and saved does not resume its own save.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import shutil
import socket
import stat
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import shardsafe
from shardsafe.coord.resolve import SOLO
from shardsafe.deadline import Deadline
from shardsafe.manager import local as tier_local
from shardsafe.manager import replica, tiers
from shardsafe.manager.lineage import RECORD, RunRecord, read_record, write_record
from shardsafe.storage import get_storage

RUN, OTHER = "0123456789abcdef", "fedcba9876543210"
INC1, INC2, INC3 = "1" * 16, "2" * 16, "3" * 16


def sid(k: int) -> str:
    return f"{1700000000 + k:010d}{k:010x}"


SAVES = [(1, sid(1), INC1), (2, sid(2), INC1), (3, sid(3), INC1), (3, sid(4), INC2), (4, sid(5), INC2)]
"""(step, save id, incarnation) of run ``RUN``; the record says INC2 resumed from step 2, so (3, sid(3))
is abandoned."""
RECORD_INCARNATIONS = ((INC1, -1), (INC2, 2))
OTHER_SAVE = (9, sid(9), INC3)
MULTI_NODES = ["0", "0", "1", "1"]
PLACEMENTS = [
    ["0", "0", "1", "1"],
    ["1", "1", "0", "0"],
    ["0", "1", "0", "1"],
    ["0", "0", "0", "0"],
    ["1", "0", "2", "2"],
]
MODES = {"multi": 5, "manager": 3, "receive": 2}
MUTATIONS = {
    "none": 1,
    "link-step": 3,
    "link-entry": 3,
    "link-run": 1,
    "link-file": 2,
    "fifo-file": 3,
    "fifo-entry": 2,
    "foreign-name": 3,
    "other-run-share": 3,
    "misplaced-share": 2,
    "damaged-manifest": 4,
    "meta-edit": 3,
    "flip-byte": 3,
    "tombstone": 2,
    "delete-entry": 2,
    "leftovers": 2,
    "record": 2,
    "lose-node": 1,
}


def _hash_seed(rank: int, step: int, save: str) -> int:
    return (rank * 1_000_003 + step * 7919 + int(save[:10]) * 31 + int(save[10:], 16)) & 0x7FFFFFFF


def state_of(rank: int, step: int, save: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(_hash_seed(rank, step, save))
    return {"w": torch.randn(12, generator=g), "extra": {"step": step, "save": save, "rank": rank}}


def empty() -> dict[str, Any]:
    return {"w": torch.zeros(12), "extra": {"step": -1, "save": "", "rank": -1}}


def exact(state: dict[str, Any], rank: int, step: int, save: str) -> bool:
    want = state_of(rank, step, save)
    return state["extra"] == want["extra"] and bool(torch.equal(state["w"], want["w"]))


# ------------------------------------------------------------------------------------------ templates


def _share(path: Path, rank: int, step: int, save: str, inc: str, run: str, world: int) -> None:
    meta = {"step": step, "rank": rank, "world_size": world, "run": run, "save": save, "incarnation": inc}
    shardsafe.save(path, state_of(rank, step, save), group=SOLO, metadata=meta)


def _lay_out(top: Path, nodes: list[str], run: str, saves: list[tuple[int, str, str]]) -> None:
    world = len(nodes)
    for step, save, inc in saves:
        for r in range(world):
            where = top / f"local-{nodes[r]}" / tiers.run_name(run) / tiers.step_name(step, save)
            _share(where / tiers.share_name(r), r, step, save, inc, run, world)
            for p in tiers.peers(nodes, r, 1):
                dst = top / f"local-{nodes[p]}" / tiers.run_name(run) / tiers.step_name(step, save)
                shutil.copytree(where / tiers.share_name(r), dst / tiers.replica_name(r))


def build_templates(top: Path) -> None:
    for name, nodes in (("multi", MULTI_NODES), ("solo", ["0"])):
        t = top / name
        _lay_out(t, nodes, RUN, SAVES)
        _lay_out(t, nodes, OTHER, [OTHER_SAVE])
        old = t / "local-0" / "step-00000010" / "rank-00000"  # the layout before runs were recorded
        shardsafe.save(old, state_of(0, 10, sid(10)), metadata={"step": 10, "rank": 0, "world_size": len(nodes)})
        fs = get_storage(str(t / "durable"))
        write_record(fs, str(t / "durable"), RunRecord(RUN, RECORD_INCARNATIONS), 30)
        for k in range(3):  # targets of links: checkpoints named like the tier's entries, and a plain file
            ck = t / "elsewhere" / f"tree-{k}"
            _share(ck / tiers.share_name(0), 0, 20 + k, sid(20 + k), INC2, RUN, len(nodes))
            shutil.copytree(ck / tiers.share_name(0), ck / tiers.replica_name(0))
        (t / "elsewhere" / "secret.bin").write_bytes(b"secret" * 100)


# ------------------------------------------------------------------------------------------ planning


def plan(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
    if mode == "receive":
        return {"mode": mode, "kind": rng.choice(RECEIVE_KINDS), "seed": seed}
    k = rng.choices([1, 1, 2, 3])[0]
    mutations = rng.choices(list(MUTATIONS), weights=list(MUTATIONS.values()), k=k)
    out = {"mode": mode, "mutations": mutations, "seed": seed}
    if mode == "multi":
        out["placement"] = rng.choice(PLACEMENTS)
        out["durable"] = rng.choice([None, None, None, 1, 2, 3])
    return out


# ------------------------------------------------------------------------------------------ mutations


class Case:
    """One copy of a template being mutated: what must stay as it is, and which saves were touched."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.protected: set[Path] = {root / "elsewhere", root / "local-0" / "step-00000010"}
        for node in root.glob("local-*"):
            self.protected.add(node / tiers.run_name(OTHER))
        self.touched: set[tuple[int, str]] = set()
        self.everything = False
        self.what: list[str] = []

    def entries(self) -> list[Path]:
        return [
            p
            for p in self.steps()
            for p in sorted(p.glob("*"))
            if tiers.real_dir(str(p)) and not p.name.startswith(".")
        ]

    def steps(self) -> list[Path]:
        return sorted(
            p
            for p in self.root.glob(f"local-*/run-{RUN}/step-*")
            if tiers.real_dir(str(p)) and tiers.real_dir(str(p.parent))
        )

    def touch(self, path: Path) -> None:
        for part in (path, *path.parents):
            m = tiers.STEP_RE.match(part.name)
            if m:
                self.touched.add((int(m.group(1)), m.group(2)))
                return
        self.everything = True

    def pick(self, items: list[Path]) -> Path | None:
        """One of ``items``, half the time among those of the newest steps (so that resume falls back)."""
        newest = [p for p in items if any(f"step-{s:08d}-" in str(p) for s in (3, 4))]
        return self.rng.choice(newest if newest and self.rng.random() < 0.5 else items) if items else None


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def mutate(case: Case, kind: str) -> None:
    rng, root = case.rng, case.root
    elsewhere = sorted((root / "elsewhere").glob("tree-*"))
    if kind == "none":
        return
    if kind == "link-step":
        runs = sorted(root.glob(f"local-*/run-{RUN}"))
        target = rng.choice(elsewhere)
        if rng.random() < 0.5 and (victim := case.pick(case.steps())):  # an existing step becomes a link
            case.touch(victim)
            _remove(victim)
            link = victim
        elif runs:  # a newer step appears as a link
            link = rng.choice(runs) / tiers.step_name(rng.choice([5, 7, 99]), sid(rng.randrange(30, 40)))
        else:  # no step to replace and no run folder left (a lost node): nothing to link
            return
        link.symlink_to(target, target_is_directory=True)
        case.protected.add(link)
        case.what.append(f"{link.relative_to(root)} -> {target.name}")
    elif kind == "link-entry":
        victim = case.pick(case.entries())
        if victim is None:
            return
        case.touch(victim)
        _remove(victim)
        target = rng.choice(elsewhere) / rng.choice([tiers.share_name(0), tiers.replica_name(0)])
        victim.symlink_to(target, target_is_directory=True)
        case.protected.add(victim)
        case.what.append(f"{victim.relative_to(root)} -> {target.relative_to(root)}")
    elif kind == "link-run":
        run = case.pick(sorted(root.glob(f"local-*/run-{RUN}")))
        if run is None:
            return
        case.everything = True
        moved = root / "elsewhere" / f"moved-{run.parent.name}"
        run.rename(moved)
        run.symlink_to(moved, target_is_directory=True)
        case.protected.add(run)
        case.what.append(f"{run.relative_to(root)} -> {moved.name}")
    elif kind in ("link-file", "fifo-file"):
        entry = case.pick(case.entries())
        if entry is None:
            return
        files = sorted(p for p in entry.iterdir() if _regular(p))
        victim = case.pick(files)
        if victim is None:
            return
        case.touch(victim)
        victim.unlink()
        if kind == "fifo-file":
            os.mkfifo(victim)
        else:
            victim.symlink_to(rng.choice([root / "elsewhere" / "secret.bin", Path("/dev/zero"), victim]))
        case.what.append(f"{kind} {victim.relative_to(root)}")
    elif kind == "fifo-entry":
        where = case.pick(case.steps())
        if where is None:
            return
        name = rng.choice([tiers.share_name(rng.randrange(4)), tiers.replica_name(rng.randrange(4)), "MANIFEST.json"])
        path = where / name
        case.touch(path)
        if path.exists() or path.is_symlink():
            _remove(path)
        os.mkfifo(path)
        case.protected.add(path)
        case.what.append(f"fifo {path.relative_to(root)}")
    elif kind == "foreign-name":
        places = [*root.glob("local-*"), *root.glob(f"local-*/run-{RUN}"), *case.steps(), *case.entries()]
        where = rng.choice(places)
        name = rng.choice(["notes.txt", "rank-x", "step-1", "run-zz", ".hidden", "rank-00007.bak", "data.safetensors"])
        path = where / name
        if path.exists() or path.is_symlink():
            return
        if rng.random() < 0.5:
            path.write_bytes(b"not the tier's")
        else:
            path.mkdir()
            (path / "inside").write_bytes(b"not the tier's either")
        case.protected.add(path)
        case.what.append(f"foreign {path.relative_to(root)}")
    elif kind == "other-run-share":  # another run's copy, in a step folder of this run
        src = case.pick(sorted(root.glob(f"local-*/run-{OTHER}/step-*/*")))
        where = case.pick(case.steps())
        if src is None or where is None:
            return
        name = rng.choice([tiers.share_name(rng.randrange(4)), tiers.replica_name(rng.randrange(4))])
        dst = where / name
        case.touch(dst)
        if dst.exists() or dst.is_symlink():
            _remove(dst)
        shutil.copytree(src, dst)
        case.protected.add(dst)
        case.what.append(f"other run's {src.name} as {dst.relative_to(root)}")
    elif kind == "misplaced-share":  # this run's copy of one save, in another save's folder or rank's name
        src = case.pick(case.entries())
        where = case.pick(case.steps())
        if src is None or where is None:
            return
        name = rng.choice([tiers.share_name(rng.randrange(4)), tiers.replica_name(rng.randrange(4))])
        dst = where / name
        if dst == src:
            return
        case.touch(dst)
        if dst.exists() or dst.is_symlink():
            _remove(dst)
        shutil.copytree(src, dst, symlinks=True)
        case.what.append(f"{src.relative_to(root)} copied to {dst.relative_to(root)}")
    elif kind in ("damaged-manifest", "meta-edit", "flip-byte", "tombstone"):
        entry = case.pick(case.entries())
        if entry is None or not _regular(entry / "MANIFEST.json"):
            return
        case.touch(entry)
        manifest = entry / "MANIFEST.json"
        if kind == "damaged-manifest":
            raw = manifest.read_bytes()
            choice = rng.randrange(4)
            if choice == 0:
                raw = raw[: rng.randrange(len(raw))]
            elif choice == 1:
                i = rng.randrange(len(raw))
                raw = raw[:i] + bytes([raw[i] ^ (1 << rng.randrange(8))]) + raw[i + 1 :]
            elif choice == 2:
                raw = b'{"format_version": 1}'
            else:
                raw = b"\x00" * 64
            manifest.write_bytes(raw)
            case.what.append(f"damaged manifest {entry.relative_to(root)} ({choice})")
        elif kind == "meta-edit":  # a valid copy whose metadata is not its place's
            meta = shardsafe.inspect(entry).metadata
            was = dict(meta)
            field = rng.choice(["step", "rank", "run", "save", "incarnation", "world_size"])
            others = [
                v
                for v in {
                    "step": [1, 2, 3, 4, 7],
                    "rank": [0, 1, 2, 3],
                    "run": [OTHER],
                    "save": [sid(k) for k in range(1, 6)],
                    "incarnation": [INC1, INC2, INC3],
                    "world_size": [1, 2, 4],
                }[field]
                if v != was[field]
            ]
            if not others:  # e.g. the run of a copy that is already another run's
                return
            meta[field] = rng.choice(others)
            shutil.rmtree(entry)
            # its bytes: the original share's, or (for a claim of another place) that place's; an edited
            # incarnation alone keeps the original bytes (a forged copy consistent with its place and its
            # checksums cannot be told from a genuine one: not a case)
            moved = field != "incarnation" and rng.random() < 0.5
            source = meta if moved else was
            shardsafe.save(entry, state_of(source["rank"], source["step"], source["save"]), metadata=meta)
            if meta["run"] != RUN:
                case.protected.add(entry)
            case.what.append(
                f"metadata {field}={meta[field]!r} in {entry.relative_to(root)} ({'moved' if moved else 'same'} bytes)"
            )
        elif kind == "flip-byte":
            data = case.pick(sorted(p for p in entry.iterdir() if p.name.startswith("data-") and _regular(p)))
            if data is None:
                return
            raw = bytearray(data.read_bytes())
            i = rng.randrange(len(raw))
            raw[i] ^= 1 << rng.randrange(8)
            data.write_bytes(bytes(raw))
            case.what.append(f"flipped byte {i} of {data.relative_to(root)}")
        else:
            tomb = entry / ".MANIFEST.json.deleting"
            if rng.random() < 0.5:
                tomb.mkdir()
                (tomb / "x").write_bytes(b"x")
                case.protected.add(tomb / "x")
            else:
                tomb.write_bytes(rng.choice([manifest.read_bytes(), b"garbage"]))  # a regular file: checked above
            if rng.random() < 0.5:
                manifest.unlink()
            case.what.append(f"tombstone in {entry.relative_to(root)}")
    elif kind == "delete-entry":
        victim = case.pick(case.entries())
        if victim is not None:
            case.touch(victim)
            shutil.rmtree(victim)
            case.what.append(f"deleted {victim.relative_to(root)}")
    elif kind == "leftovers":
        where = case.pick(case.steps())
        if where is None:
            return
        r = rng.randrange(4)
        inc = where / f".incoming-rank-{r:05d}-{rng.randrange(1, 99999)}-{rng.randrange(1 << 32):08x}"
        inc.mkdir()
        (inc / ".MANIFEST.json.tmp-abcd").write_bytes(b"{")
        (inc / "data-00000-xyz.safetensors").write_bytes(b"partial")
        pend = where / f".rank-{r:05d}.staging-{sid(rng.randrange(50, 60))}"
        pend.mkdir()
        (pend / f"data-00000-{pend.name.rsplit('-', 1)[1]}.safetensors").write_bytes(b"partial")
        case.what.append(f"leftovers in {where.relative_to(root)}")
    elif kind == "record":
        path = root / "durable" / RECORD
        choice = rng.randrange(4)
        case.everything = True
        if choice == 0:
            shutil.rmtree(path)
        elif choice == 1:
            (path / "MANIFEST.json").write_bytes(b"{not json")
        elif choice == 2:  # INC2 resumed from step 3: INC1's step 3 counts again
            write_record(
                get_storage(str(root / "durable")), str(root / "durable"), RunRecord(RUN, ((INC1, -1), (INC2, 3))), 30
            )
        else:  # a third job resumed from nothing: nothing counts
            write_record(
                get_storage(str(root / "durable")),
                str(root / "durable"),
                RunRecord(RUN, (*RECORD_INCARNATIONS, (INC3, -1))),
                30,
            )
        case.what.append(f"run record {choice}")
    elif kind == "lose-node":
        node = case.pick(sorted(root.glob("local-*")))
        if node is not None:
            case.everything = True
            case.protected = {p for p in case.protected if node not in (p, *p.parents)}
            shutil.rmtree(node)
            case.what.append(f"lost {node.name}")


# ------------------------------------------------------------------------------------------ snapshots


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def snapshot(paths: set[Path]) -> dict[str, Any]:
    """Every protected path (links not followed) with its kind and bytes, and what is under it."""
    out: dict[str, Any] = {}

    def one(p: Path) -> None:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            out[str(p)] = None
            return
        if stat.S_ISLNK(st.st_mode):
            out[str(p)] = ("link", os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            out[str(p)] = ("file", p.read_bytes())
        elif stat.S_ISDIR(st.st_mode):
            out[str(p)] = ("dir",)
            for n in sorted(os.listdir(p)):
                one(p / n)
        else:
            out[str(p)] = ("other", stat.S_IFMT(st.st_mode))

    for p in sorted(paths):
        one(p)
    return out


def counted(root: Path) -> set[tuple[int, str]]:
    """The saves of run ``RUN`` the run record on disk counts (none if it does not read)."""
    try:
        record = read_record(get_storage(str(root / "durable")), str(root / "durable"))
    except shardsafe.CheckpointError:
        return set()
    if record is None or record.run != RUN:
        return set()
    return {(s, v) for s, v, inc in SAVES if record.counts(inc, s)}


# ------------------------------------------------------------------------------------------ modes


def run_multi(case: Case, spec: dict[str, Any], result: dict[str, Any]) -> None:
    nodes, durable = spec["placement"], spec["durable"]
    world = len(nodes)
    root = case.root
    record = None
    try:
        record = read_record(get_storage(str(root / "durable")), str(root / "durable"))
    except shardsafe.CheckpointError:
        record = None
    members = {n: [r for r in range(world) if nodes[r] == n] for n in set(nodes)}
    folder = {r: str(root / f"local-{nodes[r]}") for r in range(world)}
    reports = [tier_local.report(folder[r], RUN, r, members[nodes[r]], world) for r in range(world)]
    candidates = tier_local.plan(reports, nodes, durable, record)
    legit = {k for k in counted(root) if durable is None or k[0] > durable}
    violations = result["violations"]
    chosen = None
    for step, save, _inc, sources in candidates:
        if (step, save) not in legit:
            violations.append({"kind": "foreign", "detail": f"plan offered ({step}, {save}), not a counted save"})
            return
        loaded = []
        for r in range(world):
            holder, name = sources[r]
            path = Path(folder[holder]) / tiers.run_name(RUN) / tiers.step_name(step, save) / name
            state = empty()
            try:
                shardsafe.load(path, state)
            except shardsafe.CheckpointError:
                break
            if not exact(state, r, step, save):
                violations.append({"kind": "foreign", "detail": f"rank {r} loaded {state['extra']} from {path}"})
                return
            loaded.append(path)
        else:
            chosen = (step, save, loaded)
            break
    result["chosen"] = None if chosen is None else list(chosen[:2])
    untouched = sorted(k for k in legit if k not in case.touched)
    if not case.everything and untouched and (chosen is None or chosen[:2] < untouched[-1]):
        violations.append({"kind": "missed", "detail": f"chose {chosen and chosen[:2]}, {untouched[-1]} was intact"})
    step = None if chosen is None else chosen[0]
    save = None if chosen is None else chosen[1]
    for r in range(world):
        tiers.forget(folder[r], RUN, r, members[nodes[r]], step, save)
    if chosen is not None:
        for r in range(world):
            tiers.retain(folder[r], RUN, r, members[nodes[r]], 2, durable, chosen[0], chosen[1])
        for path in chosen[2]:
            try:
                shardsafe.verify(path)
            except shardsafe.CheckpointError as err:
                violations.append({"kind": "deleted", "detail": f"the resumed copy {path} went: {err}"})


def run_manager(case: Case, spec: dict[str, Any], result: dict[str, Any]) -> None:
    root = case.root
    os.environ["SHARDSAFE_NODE"] = "0"
    tier = shardsafe.LocalTier(str(root / "local-{node}"), every_n_steps=1, replicas=1, keep=2)
    legit = counted(root)
    violations = result["violations"]
    state = empty()
    with shardsafe.CheckpointManager(str(root / "durable"), local=tier, timeout=30, save_on_signals=()) as mgr:
        step = mgr.resume(state)
        if step is not None:
            got = (state["extra"]["step"], state["extra"]["save"])
            if got not in legit or got[0] != step or not exact(state, 0, *got):
                violations.append({"kind": "foreign", "detail": f"resumed {step}: {state['extra']}"})
                return
        untouched = sorted(k for k in legit if k not in case.touched)
        if not case.everything and untouched and (step is None or step < untouched[-1][0]):
            violations.append({"kind": "missed", "detail": f"resumed {step}, {untouched[-1]} was intact"})
        result["chosen"] = step
        new = (step or 0) + 1
        try:
            mgr.save_local(new, state_of(0, new, "0" * 20))
        except shardsafe.CheckpointError as err:
            result["save"] = f"{type(err).__name__}: {str(err)[:200]}"
            return
    state = empty()
    with shardsafe.CheckpointManager(str(root / "durable"), local=tier, timeout=30, save_on_signals=()) as mgr:
        again = mgr.resume(state)
    if again != new or state["extra"]["step"] != new or not torch.equal(state["w"], state_of(0, new, "0" * 20)["w"]):
        violations.append({"kind": "lost", "detail": f"saved {new}, resumed {again}: {state['extra']}"})


RECEIVE_KINDS = [
    "good",
    "bad-token",
    "long-line",
    "not-json",
    "bad-run",
    "bad-save",
    "bad-step",
    "bad-name",
    "files-slash",
    "files-dotdot",
    "files-dup",
    "files-huge",
    "files-negative",
    "files-nomanifest",
    "short-bytes",
    "flip-bytes",
    "meta-mismatch",
    "meta-other-run",
    "target-other-run",
    "target-link-run",
    "target-fifo-step",
    "pull-link-file",
    "pull-fifo-file",
    "pull-damaged",
    "pull-link-entry",
    "pull-missing",
    "pull-good",
    "unknown-op",
]
META = {"step": 4, "rank": 1, "world_size": 4, "run": RUN, "save": sid(5), "incarnation": INC2}


def _raw(server: replica.ReplicaServer, head: dict[str, Any] | bytes, body: bytes, token: str | None = None) -> bytes:
    """Send a request as a hostile client may; return what the server answered."""
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.settimeout(30)
        s.sendall((token if token is not None else server.token).encode() + b"\n")
        s.sendall(head if isinstance(head, bytes) else json.dumps(head).encode() + b"\n")
        answer = b""
        try:
            answer = s.recv(4096)
            if b'"ok": true' in answer and body:
                s.sendall(body)
                s.shutdown(socket.SHUT_WR)
                while part := s.recv(4096):
                    answer += part
        except OSError:
            pass
        return answer


def run_receive(case: Case, spec: dict[str, Any], result: dict[str, Any]) -> None:
    kind, rng, root = spec["kind"], case.rng, case.root
    violations = result["violations"]
    node = root / "node"
    node.mkdir()
    share = root / "local-0" / tiers.run_name(RUN) / tiers.step_name(4, sid(5)) / tiers.share_name(1)
    files = replica.files_of(str(share))
    body = b"".join((share / n).read_bytes() for n, _ in files)
    head: dict[str, Any] = {
        "op": "push",
        "run": RUN,
        "step": 4,
        "save": sid(5),
        "rank": 1,
        "metadata": META,
        "files": files,
    }
    token = None
    raw_head: bytes | None = None
    protected = {root / "elsewhere"}
    if kind == "bad-token":
        token = "f" * 32
    elif kind == "long-line":
        raw_head = b"[" * (1 << 17)
    elif kind == "not-json":
        raw_head = b"\xff\xfe{]\n"
    elif kind == "bad-run":
        head["run"] = rng.choice(["../../elsewhere", "", "x" * 16, RUN.upper(), 5])
    elif kind == "bad-save":
        head["save"] = rng.choice(["../x", sid(5) + "/..", "", 7])
    elif kind == "bad-step":
        head["step"] = rng.choice([-1, True, "4", 10**15, 4.0])
    elif kind == "bad-name":
        head["rank"] = rng.choice([-1, "1", True, 10**9])
    elif kind == "files-slash":
        head["files"] = [[f"sub/{n}", s] for n, s in files]
    elif kind == "files-dotdot":
        head["files"] = [["../../elsewhere/secret.bin", 10], *files]
    elif kind == "files-dup":
        head["files"] = [*files, files[0]]
    elif kind == "files-huge":
        head["files"] = [[files[0][0], 1 << 40], *files[1:]]
    elif kind == "files-negative":
        head["files"] = [[files[0][0], -5], *files[1:]]
    elif kind == "files-nomanifest":
        head["files"] = [f for f in files if f[0] != "MANIFEST.json"]
        body = b"".join((share / n).read_bytes() for n, _ in head["files"])
    elif kind == "short-bytes":
        body = body[: rng.randrange(len(body))]
    elif kind == "flip-bytes":
        i = rng.randrange(len(body))
        body = body[:i] + bytes([body[i] ^ 0x10]) + body[i + 1 :]
    elif kind == "meta-mismatch":
        head["metadata"] = {**META, "incarnation": INC1}
    elif kind == "meta-other-run":
        head = {**head, "run": OTHER, "metadata": {**META, "run": OTHER}}
    elif kind == "target-other-run":
        dst = node / tiers.run_name(RUN) / tiers.step_name(4, sid(5)) / tiers.replica_name(1)
        src = next(root.glob(f"local-*/run-{OTHER}/step-*/rank-*"))
        shutil.copytree(src, dst)
        protected.add(dst)
    elif kind == "target-link-run":
        (node / tiers.run_name(RUN)).symlink_to(root / "elsewhere" / "tree-0", target_is_directory=True)
    elif kind == "target-fifo-step":
        (node / tiers.run_name(RUN)).mkdir()
        os.mkfifo(node / tiers.run_name(RUN) / tiers.step_name(4, sid(5)))
    elif kind == "unknown-op":
        head["op"] = "delete"
    before = snapshot(protected)
    server = replica.ReplicaServer(str(node), 0, "127.0.0.1")
    try:
        if kind.startswith("pull"):
            entry = node / tiers.run_name(RUN) / tiers.step_name(4, sid(5)) / tiers.share_name(1)
            if kind != "pull-missing":
                shutil.copytree(share, entry)
            data = next(iter(sorted(entry.glob("data-*")) if entry.exists() else []), None)
            if kind == "pull-link-file" and data is not None:
                data.unlink()
                data.symlink_to(root / "elsewhere" / "secret.bin")
            elif kind == "pull-fifo-file" and data is not None:
                data.unlink()
                os.mkfifo(data)
            elif kind == "pull-damaged":
                (entry / "MANIFEST.json").write_bytes(b"{")
            elif kind == "pull-link-entry":
                shutil.rmtree(entry)
                entry.symlink_to(root / "elsewhere" / "tree-1" / tiers.share_name(0), target_is_directory=True)
            protected.add(entry)
            before = snapshot(protected)
            mine = root / "puller"
            where = mine / tiers.run_name(RUN) / tiers.step_name(4, sid(5))
            where.mkdir(parents=True)
            try:
                got = replica.pull(
                    server.address, server.token, "rank-00001", str(where), META, Deadline.after(30, "io")
                )
                state = empty()
                shardsafe.load(got, state)
                if not exact(state, 1, 4, sid(5)):
                    violations.append({"kind": "foreign", "detail": f"pulled {state['extra']}"})
                if kind != "pull-good":
                    violations.append({"kind": "foreign", "detail": f"pulled a copy from a {kind} entry"})
            except shardsafe.CheckpointError as err:
                result["refused"] = f"{type(err).__name__}: {str(err)[:200]}"
                if kind == "pull-good":
                    violations.append({"kind": "dead", "detail": f"a good pull failed: {err}"})
            secret = (root / "elsewhere" / "secret.bin").read_bytes()
            for p in mine.rglob("*"):
                if p.is_file() and secret[:60] in p.read_bytes():
                    violations.append({"kind": "foreign", "detail": f"{p} holds bytes of a file outside the entry"})
        else:
            answer = _raw(server, raw_head if raw_head is not None else head, body, token)
            result["answer"] = answer[:200].decode(errors="replace")
            kept = node / tiers.run_name(RUN) / tiers.step_name(4, sid(5)) / tiers.replica_name(1)
            if kind == "good" and not (answer.count(b'"ok": true') == 2 and (kept / "MANIFEST.json").is_file()):
                violations.append({"kind": "dead", "detail": f"a good push was not kept: {answer[:300]!r}"})
        leftovers = [p for p in node.rglob(".incoming-*")]
        if leftovers:
            violations.append({"kind": "leftover", "detail": str(leftovers)})
        for p in node.rglob("replica-of-rank-*"):
            if p in protected or p.is_symlink():
                continue
            try:
                shardsafe.verify(p)
                state = empty()
                shardsafe.load(p, state)
                ok = shardsafe.inspect(p).metadata == META and exact(state, 1, 4, sid(5))
            except shardsafe.CheckpointError as err:
                ok = False
                result["bad"] = str(err)[:200]
            if not ok:
                violations.append({"kind": "foreign", "detail": f"the server kept {p}, not the share sent"})
        # the server lives on: a good push of another save goes through
        good = root / "good"
        meta = {**META, "run": "abcdefabcdefabcd", "save": sid(6)}
        shardsafe.save(good, state_of(1, 4, sid(6)), metadata=meta)
        try:
            replica.push(server.address, server.token, str(good), meta, Deadline.after(30, "io"))
        except shardsafe.CheckpointError as err:
            violations.append({"kind": "dead", "detail": f"{type(err).__name__}: {err}"})
    finally:
        server.close()
    if snapshot(protected) != before:
        violations.append({"kind": "deleted", "detail": f"a protected path changed: {sorted(map(str, protected))}"})


def run_case(templates: Path, work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(spec["seed"])
    result: dict[str, Any] = {"id": spec["id"], "violations": []}
    root = work / f"c{spec['id']}"
    shutil.copytree(templates / ("solo" if spec["mode"] == "manager" else "multi"), root, symlinks=True)
    case = Case(root, rng)
    started = time.monotonic()
    try:
        for kind in spec.get("mutations", []):
            try:
                mutate(case, kind)
            except (OSError, shardsafe.CheckpointError, shutil.Error) as err:  # an earlier mutation in the way
                case.everything = True
                case.what.append(f"{kind} not applied ({type(err).__name__})")
        result["what"] = case.what
        before = snapshot(case.protected)
        try:
            {"multi": run_multi, "manager": run_manager, "receive": run_receive}[spec["mode"]](case, spec, result)
        except shardsafe.CheckpointError as err:
            result["outcome"] = f"{type(err).__name__}: {str(err)[:300]}"
        except Exception as err:
            result["violations"].append({"kind": "escape", "detail": "".join(traceback.format_exception(err))[-3000:]})
        if spec["mode"] != "receive":
            after = snapshot(case.protected)
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            if changed:
                result["violations"].append({"kind": "deleted", "detail": f"changed or gone: {changed[:8]}"})
    finally:
        result["seconds"] = round(time.monotonic() - started, 3)
        _clear(root)
    return result


def _clear(root: Path) -> None:
    """Remove a case's copy (FIFOs and links included; nothing outside it), if it is there."""
    if not root.exists():
        return
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for n in filenames + dirnames:
            p = os.path.join(dirpath, n)
            if os.path.islink(p) or not os.path.isdir(p):
                os.unlink(p)
            else:
                os.rmdir(p)
    os.rmdir(root)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory"] + (3 << 30), resource.RLIM_INFINITY))
    logging.getLogger("shardsafe").setLevel(logging.ERROR)
    templates, work = Path(spec["templates"]), Path(spec["work"])
    with open(spec["results"], "a") as out:
        for case in spec["cases"]:
            out.write(json.dumps({"start": case["id"]}) + "\n")
            out.flush()
            result = run_case(templates, work, case)
            out.write(json.dumps(result) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    threading.stack_size(1 << 22)
    sys.exit(main(sys.argv[1]))
