"""Retention policies: pure functions from the committed checkpoints to the ones kept."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardsafe.manager.retention import RetentionPolicy, keep_best, keep_every_n_steps, keep_last


@dataclass(frozen=True)
class Ck:
    step: int
    metrics: Mapping[str, Any] = field(default_factory=dict)


def steps(ckpts: list[Ck]) -> list[int]:
    return [c.step for c in ckpts]


RUN = [Ck(s, {"loss": loss}) for s, loss in [(400, 0.9), (100, 0.5), (300, 0.2), (200, 0.7), (500, 0.4)]]


def test_keep_last_takes_highest_steps_whatever_the_input_order() -> None:
    assert steps(keep_last(RUN, 2)) == [400, 500]
    assert steps(keep_last(RUN, 10)) == [100, 200, 300, 400, 500]
    assert steps(keep_last(RUN, None)) == [100, 200, 300, 400, 500]
    assert keep_last([], 3) == []


def test_keep_best_by_mode() -> None:
    assert steps(keep_best(RUN, 2, "loss", "min")) == [300, 500]
    assert steps(keep_best(RUN, 2, "loss", "max")) == [200, 400]
    assert keep_best(RUN, 0, "loss", "min") == []


def test_keep_best_ignores_missing_nan_and_non_numbers_and_newer_wins_ties() -> None:
    ckpts = [
        Ck(1, {"loss": 0.1}),
        Ck(2, {}),
        Ck(3, {"loss": math.nan}),
        Ck(4, {"loss": "low"}),
        Ck(5, {"loss": True}),
        Ck(6, {"loss": 0.1}),
        Ck(7, {"loss": 0.3}),
    ]
    assert steps(keep_best(ckpts, 1, "loss", "min")) == [6]
    assert steps(keep_best(ckpts, 5, "loss", "min")) == [1, 6, 7]
    assert steps(keep_best(ckpts, 5, "acc", "max")) == []


def test_keep_every_n_steps_keeps_milestones() -> None:
    assert steps(keep_every_n_steps(RUN, 200)) == [200, 400]
    assert keep_every_n_steps(RUN, None) == []


def test_combined_policy_is_the_union_and_always_keeps_the_newest() -> None:
    policy = RetentionPolicy(keep_last=1, keep_best=1, monitor="loss", mode="min", keep_every_n_steps=200)
    assert steps(policy.select(RUN)) == [200, 300, 400, 500]
    assert steps(policy.to_delete(RUN)) == [100]
    # the newest is kept even when no policy would keep it
    only_best = RetentionPolicy(keep_last=None, keep_best=1, monitor="loss")
    assert steps(only_best.select(RUN)) == [100, 200, 300, 400, 500]  # keep_last=None keeps everything
    best_one = RetentionPolicy(keep_last=1, keep_best=1, monitor="loss", mode="max")
    assert steps(best_one.select(RUN)) == [400, 500]


def test_protected_steps_are_kept_and_input_objects_are_returned() -> None:
    policy = RetentionPolicy(keep_last=2)
    kept = policy.select(RUN, protect={100})
    assert steps(kept) == [100, 400, 500]
    assert all(any(k is c for c in RUN) for k in kept)
    assert steps(policy.to_delete(RUN, protect={100})) == [200, 300]
    assert policy.select([]) == []
