"""A load reads what the state asks for: loading ``{"model": model}`` from a model+optimizer checkpoint
leaves the optimizer's bytes on disk (not read, not decoded, not returned), unless ``rest="all"`` asks
for every unrequested entry. Small unrequested entries (plain values, a step counter, an RNG state)
still come back, as Fabric's remainder does; ``rest="none"`` returns nothing, as DCP does.

The memory test runs the load in a fresh process and measures the growth of its peak resident memory
(VmHWM, reset before the load): before this change the optimizer (twice the model's size, Adam) was read
and returned whole, unsharded, on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe.format.manifest import parse_manifest

from harness import check_ok, run_ranks
from models import build, needs_fsdp2_on_cpu, train

ROOT = Path(__file__).resolve().parents[1]


def _model_and_adam(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = {
        "model": model,
        "optimizer": opt,
        "step": 7,
        "rng": torch.get_rng_state(),  # a small tensor entry: comes back by default
        "big": torch.zeros(1 << 19),  # a 2 MiB plain tensor entry: stays on disk by default
        "notes": {"lr": [0.1, 0.01]},
    }
    shardsafe.save(path, state)
    return model, opt


def _corrupt(path: Path, prefix: str) -> None:
    """Flip every byte of every chunk of the tensors whose name starts with ``prefix``: a load that
    read any of them would raise CorruptCheckpointError."""
    manifest = parse_manifest((path / "MANIFEST.json").read_bytes(), str(path))
    chunks = [c for name, t in manifest.tensors.items() if name.startswith(prefix) for c in t.chunks]
    assert chunks, f"no tensor named {prefix}*"
    for c in chunks:
        with open(path / c.file, "r+b") as f:
            f.seek(c.begin)
            data = f.read(c.end - c.begin)
            f.seek(c.begin)
            f.write(bytes(b ^ 0xFF for b in data))


def test_loading_the_model_leaves_the_optimizer_on_disk(tmp_path: Path) -> None:
    model, _ = _model_and_adam(tmp_path / "c")
    _corrupt(tmp_path / "c", "optimizer/")  # never read: its damage cannot matter
    _corrupt(tmp_path / "c", "big")
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    rest = shardsafe.load(tmp_path / "c", {"model": fresh})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    assert sorted(rest) == ["notes", "rng", "step"]
    assert rest["step"] == 7 and rest["notes"] == {"lr": [0.1, 0.01]}
    assert rest["rng"].dtype == torch.uint8 and rest["rng"].shape == torch.get_rng_state().shape
    with pytest.raises(shardsafe.MissingKeysError, match=r"'optimizer'.*left on disk.*rest='all'") as info:
        rest["optimizer"]
    assert info.value.missing == ["optimizer"] and isinstance(info.value, KeyError)
    assert rest.get("optimizer") is None and "optimizer" not in rest


def test_rest_all_reads_every_entry_and_rest_none_nothing(tmp_path: Path) -> None:
    _, opt = _model_and_adam(tmp_path / "c")
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    everything = shardsafe.load(tmp_path / "c", {"model": fresh}, rest="all")
    assert sorted(everything) == ["big", "notes", "optimizer", "rng", "step"]
    saved = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(everything["optimizer"]["state"]["0.weight"]["exp_avg"], saved)
    assert shardsafe.load(tmp_path / "c", {"model": fresh}, rest="none") == {}
    whole = shardsafe.load(tmp_path / "c")  # no state: everything, as before
    assert sorted(whole) == ["big", "model", "notes", "optimizer", "rng", "step"]
    with pytest.raises(shardsafe.InvalidArgumentError, match=r"rest='optim'.*'values', 'all' or 'none'"):
        shardsafe.load(tmp_path / "c", {"model": fresh}, rest="optim")  # type: ignore[arg-type]


def test_a_plain_state_dict_entry_is_left_on_disk_by_size(tmp_path: Path) -> None:
    """DCP-style states save state dicts as plain values: the large ones stay on disk too."""
    model = torch.nn.Linear(512, 512)  # 1 MiB + 2 KiB of tensors
    shardsafe.save(tmp_path / "c", {"model": model.state_dict(), "ema": model.state_dict(), "epoch": 2})
    _corrupt(tmp_path / "c", "ema/")
    fresh = torch.nn.Linear(512, 512)
    rest = shardsafe.load(tmp_path / "c", {"model": fresh.state_dict()})
    assert torch.equal(fresh.weight, model.weight) and rest == {"epoch": 2}


def _fsdp_model_only(rank: int, world: int, path: str) -> dict[str, Any]:
    model, opt = build("fsdp")
    train(model, opt, 1)
    shardsafe.save(path, {"model": model, "optimizer": opt, "step": 1}, timeout=60)
    if rank == 0:
        _corrupt(Path(path), "optimizer/")
    shardsafe.load(path, {"model": model}, timeout=60)  # barrier: the corruption is in place on every rank
    fresh, _ = build("fsdp", seed=3)
    rest = shardsafe.load(path, {"model": fresh}, timeout=60)

    def whole(t: Any) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    pairs = zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    same = all(torch.equal(whole(a), whole(b)) for a, b in pairs)
    return {"rest": sorted(rest), "same": same}


@needs_fsdp2_on_cpu
def test_fsdp_ranks_loading_the_model_read_no_optimizer(tmp_path: Path) -> None:
    for out in check_ok(run_ranks(_fsdp_model_only, 2, str(tmp_path / "c"), timeout=120)):
        assert out == {"rest": ["step"], "same": True}


MEASURE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import shardsafe

    MiB = 2**20
    root, mib = sys.argv[1], int(sys.argv[2])
    width = 2048
    layers = max(1, mib * MiB // (width * width * 4))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))

    def rss():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    def peak_growth(fn):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        before, _ = rss()
        fn()
        return rss()[1] - before

    if sys.argv[3] == "save":
        m = model()
        opt = torch.optim.Adam(m.parameters())
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        shardsafe.save(f"{root}/adam", {"model": m, "optimizer": opt, "step": 1})
        shardsafe.save(f"{root}/weights", {"model": m, "step": 1})
        shardsafe.save(f"{root}/tiny", {"model": torch.nn.Linear(4, 4), "optimizer": {"x": torch.ones(3)}})
    else:
        m = model()
        shardsafe.load(f"{root}/tiny", {"model": torch.nn.Linear(4, 4)})  # imports and pools warmed up
        out = {"model_bytes": sum(p.numel() * 4 for p in m.parameters())}
        out["weights_only"] = peak_growth(lambda: shardsafe.load(f"{root}/weights", {"model": m}))
        out["model_of_adam"] = peak_growth(lambda: shardsafe.load(f"{root}/adam", {"model": m}))
        print(json.dumps(out))
    """
)


def measure(root: Path, mib: int) -> dict[str, int]:
    """Save a ``mib`` MiB model with Adam (and weights only), then load the model alone in a fresh
    process: peak RSS growth of each load, in bytes."""
    script = root / "measure.py"
    script.write_text(MEASURE)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for what in ("save", "load"):
        proc = subprocess.run(
            [sys.executable, str(script), str(root), str(mib), what],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS reset needs Linux /proc")
def test_loading_the_model_does_not_read_the_optimizer_into_memory(tmp_path: Path) -> None:
    out = measure(tmp_path, 64)
    optimizer_bytes = 2 * out["model_bytes"]  # Adam: exp_avg and exp_avg_sq
    # before: the optimizer was read and returned whole (+128 MiB at least); a fraction of it is slack
    # for the reader's buffers, which the weights-only load pays as well
    assert out["model_of_adam"] < optimizer_bytes / 2, out
    assert out["model_of_adam"] < out["weights_only"] + optimizer_bytes / 8, out
