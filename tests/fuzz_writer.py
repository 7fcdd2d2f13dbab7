"""Seeded fuzzing of the writer (run by tests/test_fuzz_writer.py): incremental saves over damaged or
mutated bases, and an incremental ``CheckpointManager`` over a damaged root.

The parent builds, once, two templates (:func:`build_templates`) and a full reference save of each
state variant; each case (:func:`plan`) names a template, a mutation of its checkpoints, a save and
a state variant. ``python fuzz_writer.py SPEC.json`` (a child process) copies the template, damages
it, saves, checks, and removes the copy, appending a ``start`` line before each case and one line
with its outcome and violations after it (the parent kills a child silent on one case past its
deadline: a hang). Violations:

- ``escape``: the save raised something other than a ``CheckpointError`` (or a ``MemoryError``);
- ``silent``: the save returned, but its checkpoint does not load bit for bit the state saved;
- ``corrupt``: the save returned, but its checkpoint does not pass ``verify``;
- ``partial``: the save raised, and the target is not as it was (a new manifest, a staging
  directory left, a half-written folder);
- ``write``: anything outside the root changed (the case's ``elsewhere`` folder, the scratch
  directory), or, for a save to a new path, anything in the root but the new checkpoint;
- ``stopped``: an incremental manager's save raised (a damaged checkpoint must never stop a run
  from checkpointing).

Templates (checksum block of 64 bytes, so chunks span several blocks):

- ``direct``: ``root/s1`` a full save of variant 0, ``big`` and ``x`` moved into data files of their
  own (``x`` in three row ranges); ``root/s2`` an incremental save of variant 1 on ``s1`` (its
  unchanged chunks refer to ``s1``'s files);
- ``manager``: ``root/step-00000001`` .. ``-3``, saved by an incremental manager (variants 0, 1, 3);
  ``step-1``'s ``big`` in a file of its own;
- ``elsewhere/kept`` beside each root, a checkpoint outside it (symlink targets).
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import shutil
import stat
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

import shardsafe
from fuzz_cases import _bytes, _fs, _header, _json
from hostile import BLOCK, make_state, manifest_of, reshard, write_manifest
from shardsafe.manager import CheckpointManager

VARIANTS = 16
MANAGER_STEPS = {1: 0, 2: 1, 3: 3}  # step -> variant saved there
MUTATIONS = {
    "none": 2,
    "json": 6,
    "header": 3,
    "bytes": 6,
    "fs": 4,
    "stale-digest": 5,
    "forged-digest": 4,
    "forged-sums": 3,
    "swap-ranges": 3,
    "rename-valid": 3,
    "rename-other-sid": 2,
    "delete-file": 3,
    "refs-entry": 3,
    "base-symlink": 2,
    "retired": 2,
    "base-gone": 2,
    "manifest-swap": 2,
}
"""Mutation kind -> weight."""
MODES = {"direct": 5, "async": 1, "overwrite": 2, "manager": 4}
"""Save kind -> weight."""


# --------------------------------------------------------------------------------- states


def state_for(variant: int) -> dict[str, Any]:
    """A state of :func:`hostile.make_state`'s kinds plus frozen tensors; each bit of ``variant``
    changes one part (``x``, ``frozen/f1``, the model, ``big``), so two variants share some chunks."""
    state = make_state()
    state["frozen"] = {
        f"f{i}": torch.arange(i * 96, (i + 1) * 96, dtype=torch.float32).reshape(24, 4) for i in range(3)
    }
    state["big"] = torch.linspace(0, 1, 400).reshape(100, 4)
    if variant & 1:
        state["x"] = state["x"] + 1
    if variant & 2:
        state["frozen"]["f1"] = state["frozen"]["f1"] * 2
    if variant & 4:
        with torch.no_grad():
            state["model"].weight.add_(1)
    if variant & 8:
        state["big"] = state["big"] + 0.5
    state["step"] = variant
    return state


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Everything a load returns, by path: tensors and arrays as (dtype, shape, bytes), other values
    as their repr."""
    out: dict[str, Any] = {}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        out[prefix] = (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        out[prefix] = (value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        out[prefix] = ("dict", repr(list(value)))
        for k, v in value.items():
            out.update(flat(v, f"{prefix}/{k}"))
    elif isinstance(value, (list, tuple)):
        out[prefix] = (type(value).__name__, len(value))
        for i, v in enumerate(value):
            out.update(flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = repr(value)
    return out


def _with_block(fn: Any) -> Any:
    old = os.environ.get("SHARDSAFE_CHECKSUM_BLOCK_BYTES")
    os.environ["SHARDSAFE_CHECKSUM_BLOCK_BYTES"] = str(BLOCK)
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["SHARDSAFE_CHECKSUM_BLOCK_BYTES"]
        else:
            os.environ["SHARDSAFE_CHECKSUM_BLOCK_BYTES"] = old


def build_templates(where: Path) -> None:
    """(the parent, once) ``where/direct``, ``where/manager`` and ``where/refs/v<N>`` (a full save of
    each variant: the reference a save must load equal to)."""

    def build() -> None:
        for v in range(VARIANTS):
            shardsafe.save(where / "refs" / f"v{v}", state_for(v))
        for name in ("direct", "manager"):
            shardsafe.save(where / name / "elsewhere" / "kept", {"w": torch.ones(8)}, metadata={"step": 0})
        root = where / "direct" / "root"
        shardsafe.save(root / "s1", state_for(0))
        reshard(root / "s1", "big", [0])
        _rename_file(root / "s1", "data-00090-", "data-00099-")  # reshard names its files from 90 on
        reshard(root / "s1", "x", [0, 3, 7])
        shardsafe.save(root / "s2", state_for(1), base=root / "s1")
        root = where / "manager" / "root"
        for step, v in MANAGER_STEPS.items():
            with CheckpointManager(root, incremental=True, keep_last=None, save_on_signals=(), timeout=60) as mgr:
                mgr.save(step, state_for(v))
            if step == 1:
                reshard(root / "step-00000001", "big", [0])

    _with_block(build)
    for name in ("direct", "manager"):
        for ckpt in (where / name / "root").iterdir():
            shardsafe.verify(ckpt)
    assert shardsafe.inspect(where / "direct" / "root" / "s2").bases == ["s1"]
    assert shardsafe.inspect(where / "manager" / "root" / "step-00000003").bases


def _rename_file(ckpt: Path, old: str, new: str) -> None:
    """Rename the data file whose name starts with ``old`` to start with ``new`` (manifest too)."""
    doc = manifest_of(ckpt)
    (name,) = [n for n in doc["files"] if n.startswith(old)]
    renamed = new + name[len(old) :]
    os.rename(ckpt / name, ckpt / renamed)
    doc["files"][renamed] = doc["files"].pop(name)
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            if c["file"] == name:
                c["file"] = renamed
    write_manifest(ckpt, doc)


def plan(seed: int) -> dict[str, Any]:
    """(the parent) Case ``seed``: its mode, mutation, variant and options, all drawn from ``seed``."""
    rng = random.Random(seed)
    mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
    mutation = rng.choices(list(MUTATIONS), weights=list(MUTATIONS.values()))[0]
    case: dict[str, Any] = {"seed": seed, "mode": mode, "mutation": mutation, "variant": rng.randrange(VARIANTS)}
    if mode == "manager":
        case["victim"] = rng.choice(["step-00000001", "step-00000002", "step-00000003", "step-00000003"])
        case["keep_last"] = rng.choice([1, 2, None])
        case["every"] = rng.choice([2, 3, 10])
        case["saves"] = rng.choice([1, 2])
        case["link_entry"] = rng.random() < 0.3  # root/step-00000000 -> elsewhere/kept
    else:
        case["base"] = rng.choice(["s1", "s2"])
        case["victim"] = rng.choice(["s1", "s2", case["base"]])
        case["target"] = "new" if mode != "overwrite" else ("s2" if case["base"] == "s1" else "s1")
    return case


# ------------------------------------------------------------------------------ mutations


def _data_files(ckpt: Path) -> list[str]:
    return sorted(manifest_of(ckpt)["files"])


def _chunks(ckpt: Path, own: bool = True) -> list[tuple[str, int, dict[str, Any]]]:
    """(tensor, index, chunk) of the checkpoint's chunks with bytes (in its own files if ``own``)."""
    doc = manifest_of(ckpt)
    return [
        (name, i, c)
        for name, t in sorted(doc["tensors"].items())
        for i, c in enumerate(t["chunks"])
        if c["end"] > c["begin"] and (c["ref"] is None or not own)
    ]


def _referrers(root: Path, holder: Path) -> list[Path]:
    out = []
    for p in sorted(root.iterdir()):
        if p != holder and (p / "MANIFEST.json").is_file():
            refs = manifest_of(p).get("refs", {})
            if holder.name in refs:
                out.append(p)
    return out


def _sums(raw: bytes, block: int) -> list[str]:
    return [xxhash.xxh3_64_hexdigest(raw[i : i + block]) for i in range(0, len(raw), block)] or [
        xxhash.xxh3_64_hexdigest(b"")
    ]


def _edit_chunk(root: Path, holder: Path, name: str, index: int, change: Any) -> None:
    """Apply ``change(chunk)`` to chunk ``index`` of tensor ``name`` in ``holder`` and to the chunks of
    its referrers that point at the same bytes (so they stay consistent with it); re-sealed."""
    doc = manifest_of(holder)
    c = doc["tensors"][name]["chunks"][index]
    key = (c["file"], c["begin"])
    change(c)
    write_manifest(holder, doc)
    for other in _referrers(root, holder):
        theirs = manifest_of(other)
        for t in theirs["tensors"].values():
            for rc in t["chunks"]:
                if rc["ref"] == holder.name and (rc["file"], rc["begin"]) == key:
                    change(rc)
        write_manifest(other, theirs)


def mutate(rng: random.Random, case: dict[str, Any], casedir: Path, refs: Path) -> str:
    """Damage the case's copy as ``case["mutation"]`` says; returns what was done."""
    root = casedir / "root"
    victim = root / case["victim"]
    kind = case["mutation"]
    if kind == "none":
        return "none"
    if kind in ("json", "header", "bytes", "fs"):
        fn = {"json": _json, "header": _header, "bytes": _bytes, "fs": _fs}[kind]
        return f"{victim.name}: {fn(rng, victim, casedir)}"
    if kind in ("stale-digest", "forged-digest", "forged-sums", "swap-ranges"):
        own = _chunks(victim)
        if not own:
            return "no chunk of its own"
        name, index, c = rng.choice(own)
        if kind == "stale-digest":  # other bytes, their checksums made right, the digest left
            fpath = victim / c["file"]
            data = bytearray(fpath.read_bytes())
            new = bytes((b + 1 + rng.randrange(255)) % 256 for b in data[c["begin"] : c["end"]])
            data[c["begin"] : c["end"]] = new
            fpath.write_bytes(bytes(data))
            block = manifest_of(victim)["checksum"]["block_bytes"]
            _edit_chunk(root, victim, name, index, lambda ch: ch.update(checksums=_sums(new, block)))
            return f"{victim.name}: stale digest of {name!r}"
        want = _ref_chunk(refs / f"v{case['variant']}", name, c)
        if kind in ("forged-digest", "forged-sums"):
            if want is None:
                return f"{victim.name}: no counterpart of {name!r} in the state"
            fields = ["digest"] + (["checksums"] if kind == "forged-sums" else [])
            _edit_chunk(root, victim, name, index, lambda ch: ch.update({f: want[f] for f in fields}))
            return f"{victim.name}: {name!r} claims the state's {fields}"
        others = [
            (n, i, o) for n, i, o in own if (n, i) != (name, index) and o["end"] - o["begin"] == c["end"] - c["begin"]
        ]
        if not others:
            return f"{victim.name}: no chunk to swap {name!r} with"
        other, oindex, _ = rng.choice(others)
        doc = manifest_of(victim)
        a, b = doc["tensors"][name]["chunks"][index], doc["tensors"][other]["chunks"][oindex]
        moved = ("file", "key", "begin", "end", "checksums")
        saved = {f: a[f] for f in moved}
        a.update({f: b[f] for f in moved})
        b.update(saved)
        write_manifest(victim, doc)  # valid (same dtype and sizes), digests left where they were
        return f"{victim.name}: byte ranges of {name!r} and {other!r} swapped"
    if kind in ("rename-valid", "rename-other-sid", "delete-file"):
        files = _data_files(victim)
        old = rng.choice(files)
        if kind == "delete-file":
            (victim / old).unlink()
            return f"{victim.name}: {old} deleted"
        new = (
            rng.choice(["weights.safetensors", "model-1.safetensors"])
            if kind == "rename-valid"
            else (f"data-0000{rng.randrange(10)}-0{rng.randrange(10**6)}x.safetensors")
        )
        os.rename(victim / old, victim / new)
        doc = manifest_of(victim)
        doc["files"][new] = doc["files"].pop(old)
        for t in doc["tensors"].values():
            for ch in t["chunks"]:
                if ch["file"] == old and ch["ref"] is None:
                    ch["file"] = new
        write_manifest(victim, doc)
        return f"{victim.name}: {old} renamed {new} (manifest updated)"
    if kind == "refs-entry":
        doc = manifest_of(victim)
        if not doc.get("refs"):
            return f"{victim.name}: refers to nothing"
        ref = rng.choice(sorted(doc["refs"]))
        entry = doc["refs"][ref]
        fname = rng.choice(sorted(entry["files"]))
        what = rng.choice(["size", "header_checksum", "save_id"])
        if what == "size":
            entry["files"][fname]["size"] += rng.choice([8, -8, 64])
        elif what == "header_checksum":
            entry["files"][fname]["header_checksum"] = "0" * 16
        else:
            entry["save_id"] = "0" + entry["save_id"][1:]
        write_manifest(victim, doc)
        return f"{victim.name}: refs[{ref}] {what} of {fname} altered"
    if kind == "base-symlink":  # the checkpoint folder moved elsewhere, a link left in the root
        away = casedir / "elsewhere" / f"moved-{victim.name}"
        shutil.move(victim, away)
        os.symlink(away, victim)
        return f"{victim.name} -> symlink to {away}"
    if kind == "retired":
        os.rename(victim / "MANIFEST.json", victim / ".MANIFEST.json.deleting")
        return f"{victim.name}: retired (manifest -> tombstone)"
    if kind == "base-gone":
        shutil.rmtree(victim)
        return f"{victim.name}: removed"
    # manifest-swap: another checkpoint's manifest in its place (another save id, other files)
    others = [p for p in sorted(root.iterdir()) if p != victim and (p / "MANIFEST.json").is_file()]
    if not others:
        return "no other manifest"
    src = rng.choice(others)
    shutil.copyfile(src / "MANIFEST.json", victim / "MANIFEST.json")
    return f"{victim.name}: holds {src.name}'s manifest"


def _ref_chunk(ref: Path, name: str, chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The chunk of the same tensor and box in the reference save of the case's state, if any."""
    t = manifest_of(ref)["tensors"].get(name)
    if t is None:
        return None
    found: dict[str, Any] | None = next(
        (c for c in t["chunks"] if c["offsets"] == chunk["offsets"] and c["sizes"] == chunk["sizes"]), None
    )
    return found


# ---------------------------------------------------------------------------------- runner


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> list[tuple[str, int, int, int]]:
    """Every entry under ``root`` (not following symlinks): path, mode, size, mtime; names starting
    with one of ``skip`` at the top level are left out."""
    out = []
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        if dirpath == str(root) and skip:
            dirnames[:] = [d for d in dirnames if not d.startswith(skip)]
            filenames = [f for f in filenames if not f.startswith(skip)]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out.append((os.path.relpath(p, root), st.st_mode, st.st_size, st.st_mtime_ns))
    return sorted(out)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "does not verify" in record.getMessage():
            self.count += 1


class Runner:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.templates = Path(spec["templates"])
        self.work = Path(spec["work"])
        self.scratch = Path(spec["scratch"])
        self.memory = int(spec["memory"])
        self.refs = {v: flat(shardsafe.load(self.templates / "refs" / f"v{v}")) for v in range(VARIANTS)}
        # torch imports some modules on a process's first save, and may write while doing so (torch
        # 2.6's torch.distributed.nn writes a generated module into TMPDIR): that happens here, once,
        # not inside the first case, whose check would take it for a write of shardsafe's.
        warm = self.scratch / "warm-up"
        net = torch.nn.Linear(2, 2)
        shardsafe.async_save(warm, {"w": torch.zeros(2), "m": net, "o": torch.optim.SGD(net.parameters())}).wait()
        shardsafe.load(warm)
        shutil.rmtree(warm)
        self.warnings = _Warnings()
        logging.getLogger("shardsafe").addHandler(self.warnings)
        logging.getLogger("shardsafe").setLevel(logging.WARNING)
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + self.memory, resource.RLIM_INFINITY))

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        casedir = self.work / f"c{case['id']:06d}"
        template = self.templates / ("manager" if case["mode"] == "manager" else "direct")
        shutil.copytree(template, casedir, symlinks=True)
        rng = random.Random(case["seed"] * 7919 + 1)
        try:
            what = mutate(rng, case, casedir, self.templates / "refs")
        except (OSError, KeyError, ValueError, IndexError) as err:  # a mutation that does not apply here
            what = f"mutation stopped part way ({type(err).__name__}: {err})"
        root = casedir / "root"
        if case.get("link_entry"):
            os.symlink(casedir / "elsewhere" / "kept", root / "step-00000000")
        # An overwrite whose target was moved away and linked back goes through the link: the user
        # named that path (a save to a symlinked target writes where it points; retention never does).
        through = f"elsewhere/moved-{case['target']}" if case["mode"] == "overwrite" else "\0"

        def outside_root() -> tuple[list[Any], list[Any]]:
            mine = [e for e in snapshot(casedir, skip=("root",)) if not e[0].startswith(through)]
            return mine, snapshot(self.scratch)

        outside = outside_root()
        violations: list[dict[str, str]] = []
        self.warnings.count = 0
        try:
            outcome, refs = (self._manager if case["mode"] == "manager" else self._save)(case, root, violations)
        except Exception as err:  # the runner's own failure: reported, the run goes on
            outcome, refs = f"runner {type(err).__name__}", 0
            violations.append({"kind": "crash", "detail": "".join(traceback.format_exception(err))[-3000:]})
        if outside_root() != outside:
            violations.append({"kind": "write", "detail": "something outside the root changed"})
        shutil.rmtree(casedir, ignore_errors=True)
        return {
            "what": what,
            "outcome": outcome,
            "refs": refs,
            "warnings": self.warnings.count,
            "violations": violations,
        }

    # ------------------------------------------------------------------------- direct saves

    def _save(self, case: dict[str, Any], root: Path, violations: list[dict[str, str]]) -> tuple[str, int]:
        target, base = root / case["target"], root / case["base"]
        before_target, existed = _manifest_bytes(target), os.path.lexists(target)
        before_root = snapshot(root, skip=(case["target"], f".{case['target']}."))
        state = state_for(case["variant"])

        def save() -> None:
            if case["mode"] == "async":
                _with_block(lambda: shardsafe.async_save(target, state, base=base).wait())
            else:
                _with_block(lambda: shardsafe.save(target, state, base=base, overwrite=case["mode"] == "overwrite"))

        raised = self._attempt("save", save, violations)
        if raised is None:
            refs = self._check_written(target, case["variant"], violations)
            outcome = "ok"
        else:
            refs, outcome = 0, raised
            if _manifest_bytes(target) != before_target or _staging_left(root, case["target"]):
                violations.append({"kind": "partial", "detail": "the failed save changed its target"})
            if not existed and os.path.lexists(target):
                violations.append({"kind": "partial", "detail": "the failed save left a folder at its target"})
        if case["mode"] != "overwrite" and snapshot(root, skip=(case["target"], f".{case['target']}.")) != before_root:
            violations.append({"kind": "write", "detail": "a save to a new path changed something else in the root"})
        return outcome, refs

    # ------------------------------------------------------------------------ manager saves

    def _manager(self, case: dict[str, Any], root: Path, violations: list[dict[str, str]]) -> tuple[str, int]:
        outcome, refs = "ok", 0
        for k in range(case["saves"]):
            step = 4 + k
            variant = (case["variant"] + k) % VARIANTS

            def save(step: int = step, variant: int = variant) -> None:
                with CheckpointManager(
                    root,
                    incremental=True,
                    keep_last=case["keep_last"],
                    full_save_every=case["every"],
                    leftover_age=0,
                    save_on_signals=(),
                    timeout=30,
                ) as mgr:
                    _with_block(lambda: mgr.save(step, state_for(variant)))

            raised = self._attempt(f"manager save {step}", save, violations)
            if raised is not None:
                violations.append({"kind": "stopped", "detail": f"manager save {step}: {raised}"})
                return raised, refs
            refs += self._check_written(root / f"step-{step:08d}", variant, violations)
        return outcome, refs

    # ----------------------------------------------------------------------------- checks

    @staticmethod
    def _attempt(op: str, fn: Any, violations: list[dict[str, str]]) -> str | None:
        try:
            fn()
        except Exception as err:
            if not isinstance(err, (shardsafe.CheckpointError, MemoryError)):
                violations.append({"kind": "escape", "detail": "".join(traceback.format_exception(err))[-3000:]})
            return f"{type(err).__name__}: {str(err)[:300]}"
        return None

    def _check_written(self, target: Path, variant: int, violations: list[dict[str, str]]) -> int:
        """A save returned: its checkpoint verifies and loads the state saved, bit for bit. Returns the
        number of chunks it refers to."""
        try:
            shardsafe.verify(target)
        except Exception as err:
            violations.append({"kind": "corrupt", "detail": f"{type(err).__name__}: {str(err)[:500]}"})
            return 0
        try:
            got = flat(shardsafe.load(target))
        except Exception as err:
            violations.append({"kind": "corrupt", "detail": f"load: {type(err).__name__}: {str(err)[:500]}"})
            return 0
        want = self.refs[variant]
        if got != want:
            diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            violations.append({"kind": "silent", "detail": f"loads other data at {diff[:8]}"})
        doc = manifest_of(target)
        return sum(1 for t in doc["tensors"].values() for c in t["chunks"] if c["ref"] is not None)


def _manifest_bytes(target: Path) -> bytes | None:
    """The manifest's bytes, or for anything but a regular file (a mutation may have left a FIFO or a
    link to ``/dev/zero`` there) a description of it; ``None`` when there is none."""
    where = target / "MANIFEST.json"
    try:
        st = os.lstat(where)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return repr((st.st_mode, os.readlink(where) if stat.S_ISLNK(st.st_mode) else None)).encode()
    return where.read_bytes()


def _staging_left(root: Path, target: str) -> bool:
    return any(p.name.startswith(f".{target}.staging-") for p in root.iterdir())


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    runner = Runner(spec)
    with open(spec["results"], "a", buffering=1) as results:
        for case in spec["cases"]:
            results.write(json.dumps({"start": case["id"]}) + "\n")
            started = time.monotonic()
            outcome = runner.run(case)
            results.write(json.dumps({"id": case["id"], "seconds": time.monotonic() - started, **outcome}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
