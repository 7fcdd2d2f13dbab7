"""Format v3 on real FSDP2 ranks: sharded tensors are saved as rules (no chunk list), uneven and empty
pieces included (Net's 3- and 5-row tensors leave the last of 4 ranks without rows); a rank loading
its own shards reads the index of its own data file and of no other; the checkpoint reshards to 3
ranks and loads into one plain process, equal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import shardsafe

from harness import check_ok, run_ranks
from models import Net, assert_same, build, full_state, needs_fsdp2_on_cpu, train


def _save_then_load_own(rank: int, world: int, path: str) -> dict[str, Any]:
    from shardsafe.format import resolve

    model, opt = build("fsdp")
    train(model, opt, 2)
    shardsafe.save(path, {"model": model, "optim": opt, "step": 2}, timeout=60)
    read: set[str] = set()
    real = resolve.ChunkSource.index

    def spy(self: Any, file: str) -> Any:
        read.add(file)
        return real(self, file)

    fresh, fresh_opt = build("fsdp", seed=5)
    resolve.ChunkSource.index = spy  # type: ignore[method-assign]
    try:
        shardsafe.load(path, {"model": fresh, "optim": fresh_opt}, timeout=60)
    finally:
        resolve.ChunkSource.index = real  # type: ignore[method-assign]
    # an incremental save on the ruled checkpoint: the unchanged chunks refer into its ruled regions
    shardsafe.save(path + "-inc", {"model": model, "optim": opt, "step": 3}, base=path, timeout=60)
    return {"saved": full_state(model, opt), "loaded": full_state(fresh, fresh_opt), "read": sorted(read)}


def _load_on_three(rank: int, world: int, path: str) -> dict[str, Any]:
    model, opt = build("fsdp", seed=9)
    shardsafe.load(path, {"model": model, "optim": opt}, timeout=60)
    return full_state(model, opt)


@needs_fsdp2_on_cpu
def test_fsdp2_saves_rules_and_each_rank_reads_only_its_own_index(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results = check_ok(run_ranks(_save_then_load_own, 4, path, timeout=180))
    doc = json.loads((tmp_path / "ckpt" / "MANIFEST.json").read_text())
    sid = doc["save_id"]
    assert doc["format_version"] == 3 and doc["meshes"] == [{"shape": [4], "ranks": [0, 1, 2, 3]}]
    ruled = {n for n, t in doc["tensors"].items() if "sharding" in t}
    listed = {n for n, t in doc["tensors"].items() if "chunks" in t}
    assert len(ruled) == 18 and all(doc["tensors"][n]["sharding"] == {"mesh": 0, "dims": [[0, 1]]} for n in ruled)
    assert all(n.endswith("/step") or n.endswith(".scale") for n in listed), listed  # plain tensors only
    assert len(doc["files"]) == 4
    for rank, out in enumerate(results):
        assert_same(out["saved"], out["loaded"])
        assert out["read"] == [f"data-{rank:05d}-{sid}.safetensors"], out["read"]  # its own, no other
    saved = results[0]["saved"]
    for loaded in check_ok(run_ranks(_load_on_three, 3, path, timeout=180)):
        assert_same(saved, loaded)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    shardsafe.load(path, {"model": model, "optim": opt})
    assert_same(saved, full_state(model, opt))
    summary = shardsafe.verify(path)
    assert summary.files == 4 and summary.bytes == sum((tmp_path / "ckpt" / f).stat().st_size for f in doc["files"])
    info = {e.name: e for e in shardsafe.inspect(path).entries}
    assert info["model/head.bias"].chunks == 3  # 3 rows on 4 ranks: the last holds none
    inc = json.loads((tmp_path / "ckpt-inc" / "MANIFEST.json").read_text())
    refs = [c["ref"] for t in inc["tensors"].values() for c in t["chunks"]]  # an incremental save lists every chunk
    assert refs.count("ckpt") >= 18 * 3 and set(inc["refs"]) == {"ckpt"}, refs  # every ruled chunk referred to
    assert inc["files"] == {} or all(f["index_checksum"] is None for f in inc["files"].values())
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    shardsafe.load(tmp_path / "ckpt-inc", {"model": model, "optim": opt})
    assert_same(saved, full_state(model, opt))
    assert shardsafe.verify(tmp_path / "ckpt-inc").files == 4
