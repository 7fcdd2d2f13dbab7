"""A real FSDP2 save of 720 tensors on 2 and 16 CPU ranks (gloo): 180 parameters of a 20-layer
Llama-style model under ``fully_shard`` and AdamW's state (two moments per parameter: 540 DTensors,
and 180 step tensors), saved by shardsafe and by DCP (``get_state_dict`` + ``dcp.save``) in the same
session. Measured: the metadata shardsafe writes (the manifest, and the header and index of every
data file) against DCP's ``.metadata``; then the 16-rank checkpoint is loaded into one plain process
(no process group) and into 3 FSDP2 ranks, and compared with the saved state, bit for bit.

    .venv/bin/python bench/scale_real.py                 # writes bench/results/scale_real.json

16 ranks on 2 cores take a few minutes; the suite does not run this (tests/test_ruled_layouts.py
checks the same on 4 and 3 ranks)."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.ranks import run_session  # noqa: E402

LAYERS, DIM, HIDDEN, KV = 20, 64, 96, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Module()
        for name, rows, cols in (("wq", DIM, DIM), ("wk", KV, DIM), ("wv", KV, DIM), ("wo", DIM, DIM)):
            self.attention.add_module(name, nn.Linear(cols, rows, bias=False))
        self.feed_forward = nn.Module()
        for name, rows, cols in (("w1", HIDDEN, DIM), ("w2", DIM, HIDDEN), ("w3", HIDDEN, DIM)):
            self.feed_forward.add_module(name, nn.Linear(cols, rows, bias=False))
        self.attention_norm = nn.LayerNorm(DIM, bias=False)
        self.ffn_norm = nn.LayerNorm(DIM, bias=False)


class Model(nn.Module):
    """20 blocks of 9 parameters: 180 (no forward: the state is what is saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Model()
    if dist.is_initialized():
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p) if not dist.is_initialized() else torch.ones_like(p) * (seed + 1)
    opt.step()
    return model, opt


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    """(every rank: a collective for DTensors) Every parameter and moment, whole, as dtype, shape and bytes."""
    out = {}
    for name, p in model.named_parameters():
        for key, v in [(name, p), *((f"{name}/{k}", t) for k, t in opt.state[p].items())]:
            t = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
            out[key] = repr((t.dtype, tuple(t.shape))).encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return out


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import shardsafe

    model, opt = build(world, 0)
    tensors = len(list(model.parameters())) + sum(len(s) for s in opt.state.values())
    started = time.perf_counter()
    shardsafe.save(f"{root}/shardsafe-{world}", {"model": model, "optim": opt}, timeout=600)
    ours = time.perf_counter() - started
    msd, osd = get_state_dict(model, opt)
    started = time.perf_counter()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp-{world}")
    theirs = time.perf_counter() - started
    state = full_state(model, opt)
    kept = _keep(state, Path(root) / f"state-{world}.pickle") if rank == 0 else None
    return {"tensors": tensors, "seconds": ours, "dcp_seconds": theirs, "state": kept}


def _load(rank: int, world: int, path: str) -> str | None:
    import shardsafe

    model, opt = build(world, 7)
    shardsafe.load(path, {"model": model, "optim": opt}, timeout=600)
    state = full_state(model, opt)
    return _keep(state, Path(path).parent / "loaded-3.pickle") if rank == 0 else None


def metadata(path: Path) -> dict[str, int]:
    """The manifest's bytes, and the headers' and indexes' of every data file."""
    headers = indexes = 0
    for f in path.iterdir():
        if not f.name.startswith("data-"):
            continue
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        headers += 8 + n
        indexes += header.get("/index", {"shape": [0]})["shape"][0]
    manifest = (path / "MANIFEST.json").stat().st_size
    return {"manifest": manifest, "headers": headers, "indexes": indexes, "total": manifest + headers + indexes}


def same(a: dict[str, bytes], b: dict[str, bytes]) -> bool:
    return a == b and len(a) == 180 * 4  # every parameter, both moments and the step


def _keep(state: dict[str, bytes], path: Path) -> str:
    """Rank 0's whole state to a file (a large result through the session's queue can outlast the rank)."""
    import pickle

    path.write_bytes(pickle.dumps(state))
    return str(path)


def _kept(path: str) -> dict[str, bytes]:
    import pickle

    out: dict[str, bytes] = pickle.loads(Path(path).read_bytes())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,16")
    parser.add_argument("--out", default=str(HERE / "results" / "scale_real.json"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="scale-real-", dir=str(HERE / "results")))
    result: dict[str, Any] = {"worlds": {}}
    try:
        saved: dict[int, Any] = {}
        for world in map(int, args.worlds.split(",")):
            outs = run_session(_save, world, str(root), timeout=3600)
            saved[world] = _kept(outs[0]["state"])
            dcp_bytes = (root / f"dcp-{world}" / ".metadata").stat().st_size
            ours = metadata(root / f"shardsafe-{world}")
            result["worlds"][str(world)] = {
                "tensors": outs[0]["tensors"],
                "shardsafe": ours,
                "dcp_metadata": dcp_bytes,
                "ratio_to_dcp": ours["total"] / dcp_bytes,
                "save_seconds": max(o["seconds"] for o in outs),
                "dcp_save_seconds": max(o["dcp_seconds"] for o in outs),
            }
            print(world, json.dumps(result["worlds"][str(world)]), flush=True)
        worlds = sorted(saved)
        small, big = worlds[0], worlds[-1]
        result["growth"] = (
            result["worlds"][str(big)]["shardsafe"]["total"] / result["worlds"][str(small)]["shardsafe"]["total"]
        )
        path = str(root / f"shardsafe-{big}")
        plain = build(1, 7)
        import shardsafe

        shardsafe.load(path, {"model": plain[0], "optim": plain[1]})
        result["one_process_equal"] = same(full_state(*plain), saved[big])
        three = run_session(_load, 3, path, timeout=3600)
        result["three_ranks_equal"] = same(_kept(three[0]), saved[big])
        print(json.dumps({k: v for k, v in result.items() if k != "worlds"}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
