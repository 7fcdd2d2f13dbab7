"""The configuration of a :class:`~shardsafe.manager.CheckpointManager`: a keyword-only dataclass that
checks itself, and the checkpoint name template (``"step-{step:08d}"``) with its inverse."""

from __future__ import annotations

import math
import re
import signal
import string
from dataclasses import dataclass, field
from typing import Literal

from shardsafe.errors import InvalidArgumentError
from shardsafe.storage.base import MANIFEST_NAME

_INT_SPEC = re.compile(r"^0?\d*d?$")


@dataclass(frozen=True)
class NameTemplate:
    """A checkpoint directory name with one ``{step}`` field, e.g. ``"step-{step:08d}"``.

    :meth:`format` gives the name of a step; :meth:`parse` gives the step of a name (``None`` for a
    name this template did not produce), so a manager deletes only its own checkpoints (it resumes
    from committed checkpoints of any name, manager/resume.py).
    """

    template: str
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t = self.template
        fix = "give a plain name with one integer field, e.g. name='step-{step:08d}'"
        try:
            parts = list(string.Formatter().parse(t))
        except ValueError as err:
            raise InvalidArgumentError(f"name={t!r} is not a format string ({err}); {fix}") from None
        fields = [(f, spec, conv) for _, f, spec, conv in parts if f is not None]
        if len(fields) != 1 or fields[0][0] != "step":
            raise InvalidArgumentError(f"name={t!r} must contain exactly one field, {{step}}; {fix}")
        _, spec, conv = fields[0]
        if conv is not None or not _INT_SPEC.match(spec or ""):
            raise InvalidArgumentError(
                f"name={t!r}: the step field must be a plain integer format like {{step:08d}}; {fix}"
            )
        regex = "".join(re.escape(lit) + (r"(\d+)" if f is not None else "") for lit, f, _, _ in parts)
        object.__setattr__(self, "_pattern", re.compile(f"^{regex}$"))
        for step in (0, 7, 123456789):
            name = self.format(step)
            if "/" in name or "\\" in name or name.startswith(".") or name in (MANIFEST_NAME, ""):
                raise InvalidArgumentError(
                    f"name={t!r} gives {name!r} for step {step}: a checkpoint name must be a plain, "
                    f"non-hidden name inside the root (no '/', no leading '.'); {fix}"
                )
            if self.parse(name) != step:
                raise InvalidArgumentError(f"name={t!r}: the step cannot be read back from {name!r}; {fix}")

    def format(self, step: int) -> str:
        """The checkpoint name of ``step``."""
        return self.template.format(step=step)

    def parse(self, name: str) -> int | None:
        """The step of a checkpoint name this template produced, else ``None``."""
        m = self._pattern.match(name)
        if m is None:
            return None
        step = int(m.group(1))
        return step if self.format(step) == name else None


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """What a :class:`~shardsafe.manager.CheckpointManager` saves, when, and what it keeps.

    Every rank must build the same configuration. Invalid values raise ``ValueError`` naming the
    field and the fix.
    """

    root: str
    """The directory holding the checkpoints, one sub-directory per saved step."""
    every_n_steps: int | None = None
    """Save when ``step % every_n_steps == 0``."""
    every_seconds: float | None = None
    """Save when this many seconds have passed since the last save started (rank 0's clock decides,
    every rank follows; costs one round trip to the rendezvous store per step)."""
    keep_last: int | None = 3
    """Keep the newest K checkpoints; ``None`` keeps all of them."""
    keep_best: int = 0
    """Also keep the K best checkpoints by ``metrics[monitor]``."""
    monitor: str | None = None
    """The metric that ranks checkpoints for ``keep_best``."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower (``"min"``) or higher (``"max"``) ``monitor`` value is better."""
    keep_every_n_steps: int | None = None
    """Also keep every checkpoint whose step is a multiple of this, for good (milestones)."""
    name: str = "step-{step:08d}"
    """The name template of a checkpoint directory; must hold one integer field ``{step}``. Retention
    counts and deletes only checkpoints of this naming; ``resume`` considers every committed checkpoint
    under ``root`` whatever its name, by its recorded step (docs/manager.md)."""
    async_save: bool = False
    """Save in the background with :func:`shardsafe.async_save`; training continues once the state
    is staged."""
    staging: Literal["blocking", "background"] = "blocking"
    """With ``async_save``: ``"background"`` returns before copying the state (``async_save(...,
    staging=)``, docs/async.md); ``"blocking"`` copies this rank's share first."""
    save_on_signals: tuple[int, ...] = (signal.SIGTERM,)
    """Signals that ask for a checkpoint and a clean stop (preemption); ``()`` installs no handler.
    Stored as :class:`signal.Signals`."""
    timeout: float | None = None
    """Deadline in seconds for each save, load and agreement; ``None`` uses the library defaults."""
    leftover_age: float = 3600.0
    """Leftovers of crashed saves (pending directories, orphaned data files) are removed once nothing
    in them has changed for this many seconds, so a save still running elsewhere is never touched."""
    verify_on_resume: bool = False
    """``resume`` first checks every byte of a checkpoint (the ranks share the files) and loads it only
    if all of it is intact, so the state changes only from a checkpoint that verified whole; a damaged
    one is skipped untouched. Costs one extra read of each checkpoint tried."""
    incremental: bool = False
    """Each save refers to the newest committed checkpoint for the chunks that did not change since
    (``shardsafe.save(..., base=)``, docs/incremental.md); retention keeps the data a kept checkpoint
    refers to. Every ``full_save_every``-th save is a full one."""
    full_save_every: int | None = None
    """With ``incremental``: a full save every this many saves, bounding how long old data is kept
    for reference; ``None``: ``SHARDSAFE_FULL_SAVE_EVERY`` (default 10). Counted from what is on
    storage (each save records ``saves_since_full`` in its metadata), so restarts do not reset it."""
    template: NameTemplate = field(init=False, repr=False, compare=False)
    """``name``, parsed."""

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise InvalidArgumentError(f"root={self.root!r} must be a non-empty path to the checkpoint directory")
        _check_count("every_n_steps", self.every_n_steps, "or None to save on other triggers only")
        if self.every_seconds is not None and not (
            isinstance(self.every_seconds, (int, float))
            and not isinstance(self.every_seconds, bool)
            and math.isfinite(self.every_seconds)
            and self.every_seconds > 0
        ):
            raise InvalidArgumentError(
                f"every_seconds={self.every_seconds!r} must be a positive number of seconds, or None"
            )
        if self.keep_last == 0:
            raise InvalidArgumentError(
                "keep_last=0 would delete the checkpoint a run resumes from; use keep_last=1 to keep only "
                "the newest (besides keep_best / keep_every_n_steps), or None to keep everything"
            )
        _check_count("keep_last", self.keep_last, "or None to keep every checkpoint")
        if not _is_int(self.keep_best) or self.keep_best < 0:
            raise InvalidArgumentError(f"keep_best={self.keep_best!r} must be an integer >= 0 (0 turns it off)")
        if self.keep_best > 0 and not self.monitor:
            raise InvalidArgumentError(
                f"keep_best={self.keep_best} needs monitor=, the name of the metric that ranks checkpoints "
                "(e.g. monitor='val_loss', passed in save(..., metrics={'val_loss': ...}))"
            )
        if self.monitor is not None and (not isinstance(self.monitor, str) or not self.monitor):
            raise InvalidArgumentError(f"monitor={self.monitor!r} must be a metric name (a non-empty str)")
        if self.monitor and self.keep_best == 0:
            raise InvalidArgumentError(
                f"monitor={self.monitor!r} has no effect without keep_best; set keep_best=K to keep the K "
                "best checkpoints, or drop monitor="
            )
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(
                f"mode={self.mode!r} must be 'min' (lower is better) or 'max' (higher is better)"
            )
        _check_count("keep_every_n_steps", self.keep_every_n_steps, "or None for no milestones")
        if not isinstance(self.name, str):
            raise InvalidArgumentError(f"name={self.name!r} must be a str like 'step-{{step:08d}}'")
        object.__setattr__(self, "template", NameTemplate(self.name))
        if not isinstance(self.async_save, bool):
            raise InvalidArgumentError(f"async_save={self.async_save!r} must be True or False")
        if self.staging not in ("blocking", "background"):
            raise InvalidArgumentError(
                f"staging={self.staging!r} must be 'blocking' or 'background' (with async_save=True; docs/async.md)"
            )
        object.__setattr__(self, "save_on_signals", _signals(self.save_on_signals))
        if self.timeout is not None and not (
            isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool) and self.timeout > 0
        ):
            raise InvalidArgumentError(f"timeout={self.timeout!r} must be a positive number of seconds, or None")
        if not isinstance(self.verify_on_resume, bool):
            raise InvalidArgumentError(f"verify_on_resume={self.verify_on_resume!r} must be True or False")
        if not isinstance(self.incremental, bool):
            raise InvalidArgumentError(f"incremental={self.incremental!r} must be True or False")
        _check_count("full_save_every", self.full_save_every, "or None for SHARDSAFE_FULL_SAVE_EVERY (default 10)")
        if not isinstance(self.leftover_age, (int, float)) or not self.leftover_age >= 0:
            raise InvalidArgumentError(
                f"leftover_age={self.leftover_age!r} must be a number of seconds >= 0 (default 3600); keep it "
                "longer than your slowest save, or another run's save in progress could be removed"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_count(name: str, value: object, alternative: str) -> None:
    if value is not None and (not _is_int(value) or value < 1):  # type: ignore[operator]
        raise InvalidArgumentError(f"{name}={value!r} must be a positive integer, {alternative}")


def _signals(given: object) -> tuple[signal.Signals, ...]:
    if isinstance(given, (int, signal.Signals)):
        given = (given,)
    if not isinstance(given, (tuple, list)):
        raise InvalidArgumentError(
            f"save_on_signals={given!r} must be a tuple of signals, e.g. (signal.SIGTERM,), or ()"
        )
    out: list[signal.Signals] = []
    for sig in given:
        try:
            s = signal.Signals(sig)
        except (ValueError, TypeError):
            raise InvalidArgumentError(f"save_on_signals: {sig!r} is not a signal; use e.g. signal.SIGTERM") from None
        if s in (signal.SIGKILL, signal.SIGSTOP):
            raise InvalidArgumentError(
                f"save_on_signals: {s.name} cannot be caught by any process; use SIGTERM or SIGUSR1 and ask "
                "the scheduler to send it before the kill"
            )
        if s not in out:
            out.append(s)
    return tuple(out)
