"""The child process of tests/test_fuzz.py: ``python fuzz_child.py SPEC.json``.

Runs each case of the spec through ``inspect``, ``verify``, ``load()``, ``load(state)`` and the CLI's
``verify`` (``shardsafe.cli.main``, as ``python -m shardsafe`` runs it), under an address-space cap of
``memory`` bytes beyond what importing torch takes, and appends to the results file a ``start`` line
before each case and one line with its outcomes and violations after it (the parent kills a child
that stays on one case past its deadline). Violations:

- ``escape``: an exception that is not a ``CheckpointError``; for the CLI: a traceback, a wrong exit
  status, or other than one line of output;
- ``alloc``: a failed allocation anywhere in an exception's chain, or the peak RSS growing by more
  than ``memory / 2`` (the checkpoint declares a few KB);
- ``silent``: a load that succeeded on a damaged checkpoint (``verify`` refuses it, or its bytes or
  files were damaged) and gave anything but the original tensor bytes (and values, for byte-level
  damage);
- ``state``: ``load(state)`` raised and the state is not as it was, except that tensors filled in
  place (the model's, ``x``) may hold some of the checkpoint's correct bytes: every byte of those
  that changed equals the byte a successful load gives (a damaged block found while reading stops
  the load after the blocks verified before it landed, never a damaged or misplaced byte; values,
  optimizer and scheduler change only after every read succeeded);
- ``write``: anything in the case directory or the scratch directory (cwd, TMPDIR, HOME) changed.
"""

from __future__ import annotations

import io
import json
import os
import resource
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import torch

import shardsafe
from hostile import fresh_state, state_snapshot
from shardsafe.cli import main as cli


def tensor_bytes(value: Any, prefix: str = "") -> dict[str, bytes]:
    """Raw bytes of every tensor or array in ``value``, by path (dtype and shape left out: the bytes
    are what a damaged file could change)."""
    out: dict[str, bytes] = {}
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(value, np.ndarray):
        out[prefix] = np.ascontiguousarray(value).tobytes()
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(tensor_bytes(v, f"{prefix}/{k}"))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(tensor_bytes(v, f"{prefix}/{i}"))
    return out


def loaded_view(state: dict[str, Any]) -> dict[str, Any]:
    """What ``load(state)`` put into a :func:`fresh_state` state, as plain values and tensors."""
    return {
        "model": dict(state["model"].state_dict()),
        "optim": state["optim"].state_dict(),
        "sched": state["sched"].state_dict(),
        "x": state["x"],
        "step": state["step"],
        "values": state["values"],
    }


def snapshot(root: Path) -> list[tuple[str, int, int, int]]:
    """Every entry under ``root`` (symlinks and FIFOs not followed or opened): path, mode, size, mtime."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out.append((os.path.relpath(os.path.join(dirpath, name), root), st.st_mode, st.st_size, st.st_mtime_ns))
    st = os.lstat(root)
    return sorted([*out, (".", st.st_mode, 0, st.st_mtime_ns)])


def chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


class Runner:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.memory = int(spec["memory"])
        self.scratch = Path(spec["scratch"])
        base = spec["base"]
        self.ref_load = shardsafe.load(base)
        state = fresh_state()
        shardsafe.load(base, state)
        self.ref_state = loaded_view(state)
        self.ref_snap = state_snapshot(state)
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + self.memory, resource.RLIM_INFINITY))
        self.rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        path = str(Path(case["dir"]) / "ckpt")
        damaged_files = case["kind"] in ("bytes", "fs")
        violations: list[dict[str, str]] = []
        before = (snapshot(Path(case["dir"])), snapshot(self.scratch))
        outcomes: dict[str, str] = {}

        def attempt(op: str, fn: Any) -> tuple[bool, Any]:
            try:
                return True, fn()
            except Exception as err:
                outcomes[op] = f"{type(err).__name__}: {str(err)[:300]}"
                if not isinstance(err, shardsafe.CheckpointError):
                    violations.append(
                        {"kind": "escape", "op": op, "detail": "".join(traceback.format_exception(err))[-3000:]}
                    )
                for e in chain(err):
                    if isinstance(e, MemoryError) or ("alloc" in str(e).lower() and isinstance(e, RuntimeError)):
                        violations.append({"kind": "alloc", "op": op, "detail": f"{type(e).__name__}: {str(e)[:300]}"})
                return False, err

        attempt("inspect", lambda: shardsafe.inspect(path))
        ok_verify, _ = attempt("verify", lambda: shardsafe.verify(path))
        damaged = damaged_files or not ok_verify
        ok, out = attempt("load", lambda: shardsafe.load(path))
        if ok and damaged and not self._same(out, self.ref_load, damaged_files):
            violations.append({"kind": "silent", "op": "load", "detail": "damaged, yet loaded other data"})
        state = fresh_state()
        snap = state_snapshot(state)
        ok, _ = attempt("load(state)", lambda: shardsafe.load(path, state))
        if ok and damaged and not self._same(loaded_view(state), self.ref_state, damaged_files):
            violations.append(
                {"kind": "silent", "op": "load(state)", "detail": "a damaged checkpoint loaded other data"}
            )
        if not ok:
            wrong = self._wrongly_changed(snap, state_snapshot(state))
            if wrong:
                violations.append({"kind": "state", "op": "load(state)", "detail": f"changed: {wrong}"})
        self._cli(path, ok_verify, violations)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if rss - self.rss0 > self.memory // 2:
            violations.append({"kind": "alloc", "op": "any", "detail": f"peak RSS grew by {rss - self.rss0} bytes"})
            self.rss0 = rss
        if (snapshot(Path(case["dir"])), snapshot(self.scratch)) != before:
            violations.append({"kind": "write", "op": "any", "detail": "the case or scratch directory changed"})
        return {"outcomes": outcomes, "violations": violations}

    def _wrongly_changed(self, before: dict[str, Any], after: dict[str, Any]) -> list[str]:
        """What a failed ``load(state)`` changed beyond landing correct bytes in tensors filled in place."""
        wrong = [k for k in before if k not in ("model", "tensors") and before[k] != after[k]]
        for group in ("model", "tensors"):
            for name, old in before[group].items():
                new, ref = after[group].get(name), self.ref_snap[group].get(name)
                if new == old:
                    continue
                if new is None or ref is None or not (len(new) == len(old) == len(ref)):
                    wrong.append(f"{group}{name}")
                    continue
                a, b, c = (np.frombuffer(x, dtype=np.uint8) for x in (old, new, ref))
                if not np.all((b == a) | (b == c)):
                    wrong.append(f"{group}{name}: bytes that are neither the old nor the checkpoint's")
        return wrong

    @staticmethod
    def _same(got: Any, want: Any, values_too: bool) -> bool:
        if tensor_bytes(got) != tensor_bytes(want):
            return False
        return not values_too or repr(_plain(got)) == repr(_plain(want))

    @staticmethod
    def _cli(path: str, ok_verify: bool, violations: list[dict[str, str]]) -> None:
        out, err = io.StringIO(), io.StringIO()
        try:
            with redirect_stdout(out), redirect_stderr(err):
                rc = cli(["verify", path])
        except BaseException as exc:  # a traceback is what the CLI must never show
            violations.append({"kind": "escape", "op": "cli", "detail": f"{type(exc).__name__}: {exc}"[:500]})
            return
        text = err.getvalue() if rc else out.getvalue()
        if rc != (0 if ok_verify else 1) or text.count("\n") != 1 or "Traceback" in text or (rc and out.getvalue()):
            violations.append({"kind": "escape", "op": "cli", "detail": f"exit {rc}: {text[:500]!r}"})


def _plain(value: Any) -> Any:
    """``value`` with tensors and arrays replaced by a marker (compared separately, as bytes)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return "<tensor>"
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


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
