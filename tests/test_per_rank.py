"""Values that differ between ranks (RNG states, data-loader positions) are kept per rank, found at save
without a marker or marked with ``shardsafe.per_rank``, and come back to the same rank; on another
world size they are refused by name (strict) or left untouched (strict=False), never replaced by
another rank's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError, CorruptCheckpointError, MissingKeysError

from harness import check_ok, run_ranks
from models import build


class Sampler:
    """A Stateful data-loader position: differs per rank."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "seed": 7}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]


def _state(rank: int, strategy: str, seed: int) -> dict[str, Any]:
    rng = torch.get_rng_state()
    model, _ = build(strategy, seed=seed)
    return {
        "model": model,
        "rng": rng,
        "loader": {"pos": 10 * rank, "epoch": 2, "hist": torch.full((2,), float(rank))},
        "marked": shardsafe.per_rank(torch.tensor([rank])),
        "sampler": Sampler(3 * rank),
        "step": 5,
    }


def _save(rank: int, world: int, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:  # ranks that pass different entries are refused on every rank, naming the rank
        shardsafe.save(path + "-keys", {"a": 1, **({"b": 2} if rank == 1 else {})}, timeout=60)
    except CheckpointError as err:
        out["keys"] = str(err)
    torch.manual_seed(100 + rank)
    state = _state(rank, "fsdp", 0)
    out["rng"] = state["rng"].clone()
    shardsafe.save(path, state, timeout=60)
    return out


def _load(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    state = _state(0, "fsdp", 9)  # rank 0's values everywhere, to be replaced by each rank's own
    rng = state["rng"]
    state["marked"] = torch.zeros(1, dtype=torch.int64)
    shardsafe.load(path, state, timeout=60)
    return {
        "rng": rng.clone(),
        "rng_in_place": state["rng"] is rng,
        "loader": (state["loader"]["pos"], state["loader"]["epoch"], state["loader"]["hist"].tolist()),
        "marked": state["marked"].tolist(),
        "sampler": state["sampler"].pos,
        "step": state["step"],
    }


def test_per_rank_values_come_back_to_their_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    saved = check_ok(run_ranks(_save, 2, path, timeout=120))
    assert "ranks [1] passed a state with other entries than rank 0" in saved[0]["keys"]
    assert "failed on rank 0" in saved[1]["keys"] and "ranks [1] passed" in saved[1]["keys"]
    assert not torch.equal(saved[0]["rng"], saved[1]["rng"])
    loaded = check_ok(run_ranks(_load, 2, path, timeout=120))
    for rank, out in enumerate(loaded):
        assert torch.equal(out["rng"], saved[rank]["rng"]) and out["rng_in_place"], rank
        assert out["loader"] == (10 * rank, 2, [float(rank)] * 2), rank
        assert out["marked"] == [rank] and out["sampler"] == 3 * rank and out["step"] == 5, rank
    # only what differs is per rank: the loader's epoch and the sampler's seed are stored once
    objects = json.loads((tmp_path / "c" / "MANIFEST.json").read_text())["objects"]
    assert objects["rng"]["value"]["$"] == "per_rank" and len(objects["rng"]["value"]["ranks"]) == 2
    loader = dict(objects["loader"]["value"]["items"])
    assert loader["pos"] == {"$": "per_rank", "ranks": [0, 10]} and loader["epoch"] == 2
    assert dict(objects["sampler"]["value"]["items"])["seed"] == 7
    assert objects["step"]["value"] == 5
    # another world size: refused by name, or left untouched with strict=False
    rng = torch.zeros_like(saved[0]["rng"])
    state: dict[str, Any] = {"rng": rng, "loader": {"pos": -1, "epoch": 0, "hist": torch.zeros(2)}, "step": 0}
    with pytest.raises(MissingKeysError, match=r"rng \(kept per rank by the 2-rank save; this load runs on 1 rank\)"):
        shardsafe.load(path, state)
    assert state["step"] == 0 and not rng.any()
    shardsafe.load(path, state, strict=False)
    assert state["step"] == 5 and not rng.any() and state["loader"]["pos"] == -1 and state["loader"]["epoch"] == 2
    whole = shardsafe.load(path)  # one process, no state: every rank's value
    assert sorted(whole["rng"]) == [0, 1] and torch.equal(whole["rng"][1], saved[1]["rng"])
    assert whole["loader"]["pos"] == {0: 0, 1: 10} and whole["marked"][1].tolist() == [1]


def test_per_rank_marker_in_one_process(tmp_path: Path) -> None:
    saved = {"cfg": {"seen": shardsafe.per_rank([1, 2]), "lr": 0.1}, "sampler": shardsafe.per_rank(Sampler(4))}
    shardsafe.save(tmp_path / "c", saved)
    sampler = Sampler(0)
    state: dict[str, Any] = {"cfg": {"seen": shardsafe.per_rank(None), "lr": 0.0}, "sampler": sampler}
    marker = state["cfg"]["seen"]
    shardsafe.load(tmp_path / "c", state)
    assert state["cfg"]["seen"] is marker and marker.value == [1, 2] and state["cfg"]["lr"] == 0.1
    assert sampler.pos == 4
    whole = shardsafe.load(tmp_path / "c")
    assert whole["cfg"] == {"seen": {0: [1, 2]}, "lr": 0.1} and whole["sampler"] == {0: {"pos": 4, "seed": 7}}


def test_per_rank_node_with_wrong_rank_count_is_corrupt(tmp_path: Path) -> None:
    from shardsafe.format.manifest import seal_manifest

    shardsafe.save(tmp_path / "c", {"seen": shardsafe.per_rank(3), "step": 1})
    doc = json.loads((tmp_path / "c" / "MANIFEST.json").read_text())
    doc["objects"]["seen"]["value"]["ranks"].append(4)
    (tmp_path / "c" / "MANIFEST.json").write_text(json.dumps(seal_manifest(doc)))
    state: dict[str, Any] = {"seen": 0, "step": 0}
    with pytest.raises(
        CorruptCheckpointError, match="'seen' holds a per-rank value of 2 ranks in a checkpoint saved by 1"
    ):
        shardsafe.load(tmp_path / "c", state)
    assert state == {"seen": 0, "step": 0}


def test_per_rank_of_a_module_is_refused(tmp_path: Path) -> None:
    with pytest.raises(shardsafe.UnsafeValueError, match="per_rank"):
        shardsafe.save(tmp_path / "c", {"model": shardsafe.per_rank(torch.nn.Linear(2, 2))})
