"""Which checkpoints to keep: pure functions over the committed checkpoints and their metrics.

Each policy takes the checkpoints (anything with ``.step`` and ``.metrics``) and returns the ones it
keeps, in step order; :func:`select` combines them (a checkpoint is kept when any policy keeps it,
and the newest is always kept, since it is what a run resumes from). Nothing here touches storage:
deletion lives in :mod:`shardsafe.manager.cleanup`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar


class Checkpoint(Protocol):
    """What a retention policy looks at."""

    @property
    def step(self) -> int: ...

    @property
    def metrics(self) -> Mapping[str, Any]: ...


C = TypeVar("C", bound=Checkpoint)


def _by_step(ckpts: Sequence[C]) -> list[C]:
    return sorted(ckpts, key=lambda c: c.step)


def keep_last(ckpts: Sequence[C], k: int | None) -> list[C]:
    """The ``k`` checkpoints with the highest steps; all of them when ``k`` is ``None``."""
    ordered = _by_step(ckpts)
    if k is None:
        return ordered
    return ordered[max(len(ordered) - k, 0) :]


def metric_value(ckpt: Checkpoint, monitor: str) -> float | None:
    """``ckpt.metrics[monitor]`` as a float, or ``None`` when it is missing, not a number, or NaN
    (such a checkpoint can never be among the best)."""
    value = ckpt.metrics.get(monitor)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def keep_best(ckpts: Sequence[C], k: int, monitor: str, mode: Literal["min", "max"]) -> list[C]:
    """The ``k`` checkpoints with the best ``metrics[monitor]`` (lowest for ``"min"``, highest for
    ``"max"``); on a tie the newer wins. Checkpoints without a usable value are never chosen."""
    if k <= 0:
        return []
    scored = [(v, c) for c in ckpts if (v := metric_value(c, monitor)) is not None]
    sign = 1.0 if mode == "min" else -1.0
    scored.sort(key=lambda vc: (sign * vc[0], -vc[1].step))
    return _by_step([c for _, c in scored[:k]])


def keep_every_n_steps(ckpts: Sequence[C], n: int | None) -> list[C]:
    """The checkpoints whose step is a multiple of ``n`` (milestones kept for good); none when ``n`` is
    ``None``."""
    if n is None:
        return []
    return _by_step([c for c in ckpts if c.step % n == 0])


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """The combination of every policy a :class:`~shardsafe.manager.ManagerConfig` names."""

    keep_last: int | None = 3
    keep_best: int = 0
    monitor: str | None = None
    mode: Literal["min", "max"] = "min"
    keep_every_n_steps: int | None = None

    def select(self, ckpts: Sequence[C], *, protect: Collection[int] = ()) -> list[C]:
        """The checkpoints to keep, in step order: the union of keep-last, keep-best and
        keep-every-n-steps, plus the newest one and any whose step is in ``protect``."""
        kept: dict[int, C] = {}
        chosen: list[C] = [*keep_last(ckpts, self.keep_last), *keep_every_n_steps(ckpts, self.keep_every_n_steps)]
        if self.monitor is not None:
            chosen += keep_best(ckpts, self.keep_best, self.monitor, self.mode)
        chosen += keep_last(ckpts, 1)
        chosen += [c for c in ckpts if c.step in protect]
        for c in chosen:
            kept[id(c)] = c
        return _by_step(list(kept.values()))

    def to_delete(self, ckpts: Sequence[C], *, protect: Collection[int] = ()) -> list[C]:
        """The complement of :meth:`select`: what retention would remove, oldest first."""
        keep = {id(c) for c in self.select(ckpts, protect=protect)}
        return _by_step([c for c in ckpts if id(c) not in keep])
