"""The manager's rounds, each declared once with what every rank sends and what rank 0 decides, and their
typed messages (:class:`~shardsafe.coord.messages.Message`: every field checked when read).

Resume (operation ``manager.resume``, :mod:`shardsafe.manager.resume`): ``plan`` (nothing ->
:class:`ResumePlan`), then per candidate ``verify.<n>`` and ``load.<n>`` (:class:`Attempt` ->
:class:`Attempts`). Local tier (:mod:`shardsafe.manager.local`): ``tier.save`` is ``arrive``
(:class:`Peer` -> :class:`Table`) then ``done`` (:class:`Attempt` -> :class:`Attempts`); ``tier.resume``
is ``arrive``, ``scan`` (:class:`Holdings` -> :class:`TierPlan`), then per candidate ``fetch.<n>`` and
``load.<n>``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shardsafe.coord.messages import Empty, Message, dict_of, list_of
from shardsafe.coord.rounds import Round
from shardsafe.manager.tiers import peers

# ---------------------------------------------------------------------------------- attempts


@dataclass(frozen=True)
class Attempt(Message):
    """(every rank) How one step went on this rank: ``ok``, else whether the checkpoint is ``damaged``
    (then an older one is tried) and the ``error``."""

    ok: bool
    damaged: bool
    error: str
    TYPES: ClassVar[dict[str, Any]] = {"ok": bool, "damaged": bool, "error": str}


@dataclass(frozen=True)
class Attempts(Message):
    """(rank 0 decides) Every rank's :class:`Attempt`, in rank order."""

    attempts: list[Attempt]
    TYPES: ClassVar[dict[str, Any]] = {"attempts": list_of(Attempt)}


def collect(attempts: dict[int, Attempt]) -> Attempts:
    """(rank 0) The decision of a round of attempts: every rank's, in rank order."""
    return Attempts([attempts[r] for r in sorted(attempts)])


# ---------------------------------------------------------------------------------- resume


@dataclass(frozen=True)
class Candidate(Message):
    """A committed checkpoint a resume may load: its ``name``, ``path``, ``step``, and whether the
    manager's name template made the name (``own``)."""

    name: str
    path: str
    step: int
    own: bool
    TYPES: ClassVar[dict[str, Any]] = {"name": str, "path": str, "step": int, "own": bool}


@dataclass(frozen=True)
class Skipped(Message):
    """An entry a resume skips, with why (``step``: ``None`` when it tells none)."""

    name: str
    path: str
    step: int | None
    reason: str
    TYPES: ClassVar[dict[str, Any]] = {"name": str, "path": str, "step": (int, type(None)), "reason": str}


@dataclass(frozen=True)
class ResumePlan(Message):
    """(rank 0 lists the root) The committed checkpoints, newest first, and the entries skipped."""

    candidates: list[Candidate]
    skipped: list[Skipped]
    TYPES: ClassVar[dict[str, Any]] = {"candidates": list_of(Candidate), "skipped": list_of(Skipped)}


RESUME_PLAN = Round("plan", Empty, ResumePlan)
"""(every rank) Rank 0 lists the root; a listing that fails is decided for every rank."""
RESUME_VERIFY = Round("verify", Attempt, Attempts)
"""(every rank, per candidate, ``verify.<n>``) Every rank checked its share of the files."""
RESUME_LOAD = Round("load", Attempt, Attempts)
"""(every rank, per candidate, ``load.<n>``) Every rank loaded the candidate, or found it damaged."""

# ---------------------------------------------------------------------------------- local tier


@dataclass(frozen=True)
class Peer(Message):
    """(every rank) Its node, and its replica server's address and token."""

    node: str
    address: str
    token: str
    TYPES: ClassVar[dict[str, Any]] = {"node": str, "address": str, "token": str}


@dataclass(frozen=True)
class Table(Message):
    """(rank 0 decides) Every rank's node, replica-server address and that server's token, in rank order."""

    nodes: list[str]
    addresses: list[str]
    tokens: list[str]
    TYPES: ClassVar[dict[str, Any]] = {"nodes": list, "addresses": list, "tokens": list}

    def peers(self, rank: int, replicas: int) -> list[int]:
        return peers(self.nodes, rank, replicas)

    def senders(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose replicas ``rank`` receives."""
        return [r for r in range(len(self.nodes)) if rank in self.peers(r, replicas)]


def peer_table(arrivals: dict[int, Peer]) -> Table:
    """(rank 0) The decision of a tier operation's ``arrive``: every rank's peer record, in rank order."""
    ranks = sorted(arrivals)
    return Table(
        [arrivals[r].node for r in ranks], [arrivals[r].address for r in ranks], [arrivals[r].token for r in ranks]
    )


@dataclass(frozen=True)
class Held(Message):
    """What one rank holds of one local step, verified: its ``own`` share, and the ``replicas`` of the
    ranks whose replicas it receives."""

    own: bool
    replicas: list[int]
    TYPES: ClassVar[dict[str, Any]] = {"own": bool, "replicas": list}


@dataclass(frozen=True)
class Holdings(Message):
    """(every rank, ``scan``) Its verified local entries, by step (a decimal string)."""

    steps: dict[str, Held]
    TYPES: ClassVar[dict[str, Any]] = {"steps": dict_of(Held)}


@dataclass(frozen=True)
class TierCandidate(Message):
    """A local step every rank can resume from, with the rank that provides each rank's share."""

    step: int
    sources: list[int]
    TYPES: ClassVar[dict[str, Any]] = {"step": int, "sources": list}


@dataclass(frozen=True)
class TierPlan(Message):
    """(rank 0 decides) The local steps to try, newest first."""

    candidates: list[TierCandidate]
    TYPES: ClassVar[dict[str, Any]] = {"candidates": list_of(TierCandidate)}


TIER_ARRIVE = Round("arrive", Peer, Table)
"""(every rank) Its node and replica server; rank 0 returns the table."""
TIER_DONE = Round("done", Attempt, Attempts)
"""(every rank, ``tier.save``) Its share saved and replicated, or its failure."""
TIER_SCAN = Round("scan", Holdings, TierPlan)
"""(every rank, ``tier.resume``) The entries that verify; rank 0 plans the candidates."""
TIER_FETCH = Round("fetch", Attempt, Attempts)
"""(every rank, per candidate, ``fetch.<n>``) Its share fetched from a peer where needed."""
TIER_LOAD = Round("load", Attempt, Attempts)
"""(every rank, per candidate, ``load.<n>``) Its share loaded."""
