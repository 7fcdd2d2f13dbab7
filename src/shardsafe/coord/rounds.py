"""Declarations of rounds: every cross-rank exchange is declared once, where its caller lives, with the
type of what each rank sends, the type of what is decided, and who decides. The engine
(:class:`~shardsafe.coord.operation.Operation`) runs them; it knows no caller's rounds.

Three forms:

- :class:`Round` (an *agreement*): every rank sends a ``message``; rank 0 decides the ``decision`` from
  every rank's message; every rank gets the same decision, or raises the same failure
  (:meth:`Operation.agree <shardsafe.coord.operation.Operation.agree>`).
- :class:`Commitment` (*decide, act, confirm*): every rank sends a ``message``; rank 0 decides, wins the
  round's decision key with "go", acts (a save publishes its manifest) and confirms what it did with a
  ``confirmation`` every rank reads; a rank that fails, gives up or finds a rank dead first wins the
  key with an abort instead, and nobody acts. A rank that loses rank 0 after "go" asks a probe the
  caller gives (the storage) whether the act happened
  (:meth:`Operation.commit <shardsafe.coord.operation.Operation.commit>`).
- :class:`Broadcast`: rank 0 alone decides a value per step; the others read it, sending nothing
  (run by :class:`~shardsafe.coord.steps.StepBroadcast`).

Layer: coord; imports only :mod:`shardsafe.coord.messages`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from shardsafe.coord.messages import Message

M = TypeVar("M", bound=Message)
D = TypeVar("D", bound=Message)
C = TypeVar("C", bound=Message)


@dataclass(frozen=True)
class Round(Generic[M, D]):
    """An agreement: every rank sends a ``message``, rank 0 decides the ``decision`` from all of them."""

    phase: str
    """Its name in the store keys, the errors and the stall reports."""
    message: type[M]
    """What every rank sends."""
    decision: type[D]
    """What rank 0 decides (every rank gets the same)."""

    def nth(self, n: int) -> Round[M, D]:
        """The same round, the ``n``-th time in one operation (``verify.0``, ``verify.1``...)."""
        return replace(self, phase=f"{self.phase}.{n}")


@dataclass(frozen=True)
class Commitment(Generic[M, C]):
    """Decide, act, confirm: every rank sends a ``message``; rank 0 decides, wins the decision key with
    "go", acts and confirms with a ``confirmation``. The phases name where a rank is (errors, progress,
    stall reports): ``deciding`` (rank 0 building its decision), ``settling`` (rank 0 taking the key),
    ``acting`` (rank 0 acting), ``following`` (the other ranks waiting for the confirmation); ``act``
    says what the act is in messages ("publish")."""

    phase: str
    message: type[M]
    confirmation: type[C]
    deciding: str
    settling: str
    acting: str
    following: str
    act: str


@dataclass(frozen=True)
class Broadcast:
    """Rank 0 alone decides a value per step (a :class:`~shardsafe.coord.messages.Decision`); the others
    read it and send nothing. A rank that waits for it in vain raises a timeout that names the call
    (``what``, e.g. ``"CheckpointManager.should_save"``) and says what to do (``hint``)."""

    name: str
    what: str
    hint: str
