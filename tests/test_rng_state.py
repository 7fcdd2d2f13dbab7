"""``shardsafe.RNGState``: Python's, NumPy's and torch's generators saved per rank and continued bit for
bit after a load, on 1 and 2 ranks; a load on another world size (2 -> 1, 2 -> 3) with each policy:
``"drop"`` keeps the caller's generators and warns, ``"error"`` refuses before anything changes."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardsafe

from harness import check_ok, run_ranks


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _draw() -> list[Any]:
    """A few numbers from every generator RNGState holds (Python's gauss keeps a cached value)."""
    return [
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.standard_normal(),
        torch.rand(3).tolist(),
        torch.nn.functional.dropout(torch.ones(16), 0.5).tolist(),
    ]


def _save_draw_reload(path: str, seed: int) -> tuple[list[Any], list[Any]]:
    """(every rank) Save the generators, draw, scramble, load, draw again: both draws."""
    _seed(seed)
    _draw()
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    shardsafe.save(path, {"rng": shardsafe.RNGState(), "step": 1})
    first = _draw()
    _seed(seed + 1000)
    state = {"rng": shardsafe.RNGState(), "step": 0}
    shardsafe.load(path, state)
    return first, _draw()


def test_one_process_continues_bitwise(tmp_path: Path) -> None:
    first, again = _save_draw_reload(str(tmp_path / "c"), 7)
    assert first == again
    everything = shardsafe.load(tmp_path / "c")
    assert set(everything["rng"]) == {0} and set(everything["rng"][0]) >= {"python", "numpy", "torch"}
    assert everything["rng"][0]["torch"].dtype == torch.uint8


def test_state_dict_is_a_plain_dict_torch_save_holds(tmp_path: Path) -> None:
    rng = shardsafe.RNGState()
    sd = rng.state_dict()
    assert type(sd) is dict and isinstance(sd["python"]["state"], torch.Tensor)
    torch.save(sd, tmp_path / "rng.pt")
    expected = _draw()
    _seed(3)
    rng.load_state_dict(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draw() == expected
    with pytest.raises(shardsafe.InvalidArgumentError, match="per_rank='keep'"):
        shardsafe.RNGState(per_rank="keep")  # type: ignore[arg-type]


def _two_ranks(rank: int, world: int, path: str) -> list[Any]:
    first, again = _save_draw_reload(path, 100 + rank)
    assert first == again, f"rank {rank}: the streams did not continue"
    return first


def _other_world(rank: int, world: int, path: str) -> dict[str, Any]:
    """(3 ranks, or one process) Load a 2-rank save with each policy."""
    out: dict[str, Any] = {}
    _seed(5 + rank)
    expected = _draw()
    _seed(5 + rank)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardsafe").addHandler(handler)
    try:
        state = {"rng": shardsafe.RNGState(), "step": 0}
        shardsafe.load(path, state)  # default: drop
    finally:
        logging.getLogger("shardsafe").removeHandler(handler)
    out["drop_kept"] = _draw() == expected and state["step"] == 1
    out["warned"] = [m for m in messages if "rng was kept per rank by the 2-rank save" in m]
    _seed(5 + rank)
    try:
        shardsafe.load(path, {"rng": shardsafe.RNGState(per_rank="error"), "step": 0})
        out["error"] = None
    except shardsafe.MissingKeysError as err:
        out["error"] = str(err)
    out["error_kept"] = _draw() == expected
    return out


@pytest.mark.timeout(180)
def test_two_ranks_continue_and_other_world_sizes_follow_the_policy(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    firsts = check_ok(run_ranks(_two_ranks, 2, path, timeout=120))
    assert firsts[0] != firsts[1]  # each rank's own streams were saved, not rank 0's for both
    saved = shardsafe.load(path)["rng"]
    assert sorted(saved) == [0, 1]
    for outcome in [_other_world(0, 1, path), *check_ok(run_ranks(_other_world, 3, path, timeout=120))]:
        assert outcome["drop_kept"] and outcome["warned"], outcome
        assert outcome["error"] is not None and "rng (kept per rank by the 2-rank save" in outcome["error"], outcome
        assert outcome["error_kept"], outcome
