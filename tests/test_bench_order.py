"""The benchmarks' running order is fair: a comparison of two contenders (shardsafe against a baseline
revision, or against DCP) is only fair if neither always runs first, in a warmer or colder machine."""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.session import order


@pytest.mark.parametrize("n", range(1, 8))
def test_every_contender_takes_every_position_and_precedes_and_follows_every_other_equally(n: int) -> None:
    items = [f"c{i}" for i in range(n)]
    positions: Counter[tuple[str, int]] = Counter()
    before: Counter[tuple[str, str]] = Counter()
    after: Counter[tuple[str, str]] = Counter()  # (the one run right before, the one after it)
    for rep in range(2 * n):
        got = order(items, rep)
        assert sorted(got) == items
        positions.update((c, p) for p, c in enumerate(got))
        before.update(itertools.combinations(got, 2))
        after.update(itertools.pairwise(got))
    assert set(positions.values()) == {2} and len(positions) == n * n
    assert all(before[(a, b)] == n for a, b in itertools.permutations(items, 2))
    assert len({after[pair] for pair in itertools.permutations(items, 2)}) <= 1, after


def test_two_contenders_alternate_which_runs_first() -> None:
    firsts = [order(["shardsafe", "baseline"], rep)[0] for rep in range(8)]
    assert Counter(firsts) == {"shardsafe": 4, "baseline": 4}
