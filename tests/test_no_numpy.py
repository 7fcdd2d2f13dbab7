"""numpy is not a dependency (pyproject.toml): saving, loading, verifying, exporting and importing work in
a Python without it. The test runs in a child where ``import numpy`` fails, as in a fresh venv that
installed shardsafe's dependencies only (torch imports without numpy; its ``Tensor.numpy()`` then raises
"Numpy is not available"). A package missing is never reported as a damaged checkpoint or source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import shardsafe

SRC = Path(__file__).parent.parent / "src"

CHILD = r"""
import json, os, sys
sys.modules["numpy"] = None  # import numpy raises ImportError, before torch is imported
import torch
import shardsafe
root = sys.argv[1]
at = lambda name: os.path.join(root, name)
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except Exception as err:
        out[name] = f"{type(err).__name__}: {err}"
torch.manual_seed(0)
state = {"model": torch.nn.Linear(16, 8), "big": torch.randn(300, 1000), "step": 3, "blob": b"x"}
p = os.path.join(root, "ckpt")
attempt("save", lambda: shardsafe.save(p, state))
attempt("async_save", lambda: shardsafe.async_save(os.path.join(root, "async"), state).wait())
attempt("load", lambda: shardsafe.load(p, {"model": torch.nn.Linear(16, 8)}))
attempt("load whole", lambda: shardsafe.load(p))
attempt("verify", lambda: shardsafe.verify(p))
attempt("inspect", lambda: shardsafe.inspect(p))
attempt("export_torch", lambda: shardsafe.export_torch(p, os.path.join(root, "out.pt"), key="model"))
attempt("export_hf", lambda: shardsafe.export_hf(p, os.path.join(root, "out-st"), key="model"))
torch.save(state["model"].state_dict(), os.path.join(root, "model.pt"))
torch.save(state["model"].state_dict(), os.path.join(root, "legacy.pt"), _use_new_zipfile_serialization=False)
for name in ("model.pt", "legacy.pt"):
    attempt(f"import {name}", lambda: shardsafe.import_checkpoint(at(name), at("i-" + name)))
attempt("import safetensors", lambda: shardsafe.import_checkpoint(at("out-st"), at("i-st")))
needs = {}
for what, call in [
    ("load", lambda: shardsafe.load(at("np"))),
    ("import", lambda: shardsafe.import_checkpoint(at("np.pt"), at("np-i"), allow_pickle=True)),
    ("import legacy", lambda: shardsafe.import_checkpoint(at("np-legacy.pt"), at("np-j"))),
]:
    try:
        call()
        needs[what] = ["ok", ""]
    except Exception as err:
        needs[what] = [type(err).__name__, str(err)]
print(json.dumps({"paths": out, "needs": needs}))
"""


def _child(root: Path, code: str = CHILD) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_every_public_path_works_without_numpy_and_what_needs_numpy_says_so(tmp_path: Path) -> None:
    import numpy as np  # the test's own Python has numpy: it writes what needs it

    shardsafe.save(tmp_path / "np", {"a": np.arange(4.0), "s": np.float32(2.5)})
    torch.save({"a": np.arange(4.0)}, tmp_path / "np.pt")
    torch.save({"a": np.arange(4.0)}, tmp_path / "np-legacy.pt", _use_new_zipfile_serialization=False)
    out = _child(tmp_path)
    failed = {k: v for k, v in out["paths"].items() if v != "ok"}
    assert not failed, failed
    loaded = shardsafe.load(tmp_path / "ckpt")
    assert loaded["step"] == 3 and loaded["big"].shape == (300, 1000)
    for name in ("i-model.pt", "i-legacy.pt"):
        assert torch.equal(shardsafe.load(tmp_path / name)["weight"], loaded["model"]["weight"])
    for what, (kind, message) in out["needs"].items():  # a package missing, never damage
        assert kind in ("MissingPackageError", "UnsafeValueError"), (what, kind, message)
        assert "numpy" in message and "damaged" not in message, (what, message)
