"""Do a tensor's chunks tile its shape exactly? In bounded work, whatever the number of chunks.

The manifest reader has already checked that every chunk lies inside the shape and that the chunks'
element counts add up to the shape's; what is left is that no two chunks overlap (then they cover
every element exactly once). A pairwise test is quadratic (one tensor may well have 10,000
one-element chunks), so:

- dimensions that every non-empty chunk spans whole are dropped;
- with one dimension left, the chunks are intervals: sorted, each must start at or after the end of
  the one before (O(n log n));
- with more, corner counting: the signed sum, over all chunks, of their corners (sign ``(-1)^k`` for
  a corner at the upper end in ``k`` dimensions) equals the shape's own corners if and only if the
  coverage count is exactly 1 everywhere (the coverage function is recovered from those corner
  weights by prefix sums). O(n 2^d) in the d dimensions left, capped by :data:`CORNER_BUDGET`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

from shardsafe.errors import CorruptCheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)

CORNER_BUDGET = 2**21
"""Most corner updates spent on one tensor (chunks x 2^dimensions split): beyond, a layout so
fragmented in so many dimensions is refused rather than checked."""


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], here: str) -> None:
    """Raise :class:`CorruptCheckpointError` if two of ``boxes`` overlap (see the module docstring
    for what is assumed already checked)."""
    full = [b for b in boxes if all(s > 0 for s in b[1])]
    if len(full) < 2:
        return
    split = [k for k in range(len(shape)) if any(b[0][k] != 0 or b[1][k] != shape[k] for b in full)]
    if not split:
        raise CorruptCheckpointError(f"{here}: chunks overlap ({len(full)} chunks each cover the whole tensor)")
    if len(split) == 1:
        (k,) = split
        spans = sorted((b[0][k], b[0][k] + b[1][k], b[0]) for b in full)
        for (_, prev_end, prev), (start, _, at) in itertools.pairwise(spans):
            if start < prev_end:
                raise CorruptCheckpointError(f"{here}: chunks at {list(prev)} and {list(at)} overlap")
        return
    if len(full) * 2 ** len(split) > CORNER_BUDGET:
        raise CorruptCheckpointError(
            f"{here}: {len(full)} chunks split {len(split)} dimensions: too fragmented to validate "
            f"(more than {CORNER_BUDGET} corner checks)"
        )
    corners = [(mask, -1 if sum(mask) % 2 else 1) for mask in itertools.product((0, 1), repeat=len(split))]
    weight: Counter[tuple[int, ...]] = Counter()
    for offsets, sizes in full:
        ends = [(offsets[k], offsets[k] + sizes[k]) for k in split]
        for mask, sign in corners:
            weight[tuple(e[m] for e, m in zip(ends, mask, strict=True))] += sign
    for mask, sign in corners:  # minus the shape's own corners: all that must remain is nothing
        weight[tuple(shape[k] if m else 0 for k, m in zip(split, mask, strict=True))] -= sign
    if any(weight.values()):
        raise CorruptCheckpointError(
            f"{here}: chunks overlap: they hold as many elements as the shape, but do not tile it exactly"
        )
