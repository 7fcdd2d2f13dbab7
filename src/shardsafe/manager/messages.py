"""The manager's rounds, each declared once with what every rank sends and what rank 0 decides, and their
typed messages (:class:`~shardsafe.coord.messages.Message`: every field checked when read).

Resume (operation ``manager.resume``, :mod:`shardsafe.manager.resume`): ``plan`` (nothing ->
:class:`ResumePlan`), then per candidate ``verify.<n>`` and ``load.<n>`` (:class:`Attempt` ->
:class:`Attempts`). Local tier (:mod:`shardsafe.manager.local`): ``tier.save`` is ``arrive``
(:class:`Peer` -> :class:`TierStart`) then ``done`` (:class:`Attempt` -> :class:`Attempts`);
``tier.resume`` is ``arrive`` (:class:`Peer` -> :class:`TierTable`), ``scan`` (:class:`Copies` ->
:class:`TierPlan`), then per candidate ``fetch.<n>`` and ``load.<n>``; ``tier.begin`` is ``record``
(nothing -> :class:`Recorded`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shardsafe.coord.messages import Empty, Message, list_of
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

    def members(self, node: str) -> list[int]:
        """The ranks on node ``node`` now, in rank order."""
        return [r for r, n in enumerate(self.nodes) if n == node]


def peer_table(arrivals: dict[int, Peer]) -> Table:
    """(rank 0) The decision of a tier operation's ``arrive``: every rank's peer record, in rank order."""
    ranks = sorted(arrivals)
    return Table(
        [arrivals[r].node for r in ranks], [arrivals[r].address for r in ranks], [arrivals[r].token for r in ranks]
    )


@dataclass(frozen=True)
class TierStart(Message):
    """(rank 0 decides, ``tier.save``) The ``table``; the ``run`` (the recorded one, else a new one), this
    job's ``incarnation`` and a new ``save`` id; or, when the run record could not be read, why
    (``refused``: every rank's failure, the others ``None``)."""

    table: Table
    run: str | None
    incarnation: str | None
    save: str | None
    refused: str | None
    TYPES: ClassVar[dict[str, Any]] = {
        "table": Table,
        "run": (str, type(None)),
        "incarnation": (str, type(None)),
        "save": (str, type(None)),
        "refused": (str, type(None)),
    }


@dataclass(frozen=True)
class TierTable(Message):
    """(rank 0 decides, ``tier.resume``) The ``table`` and the ``run`` rank 0 read from the durable root
    (``None``: no usable record, no local copy is used)."""

    table: Table
    run: str | None
    TYPES: ClassVar[dict[str, Any]] = {"table": Table, "run": (str, type(None))}


@dataclass(frozen=True)
class Copies(Message):
    """(every rank, ``scan``) The local copies it handles that verify, each ``[step, save, incarnation,
    rank, name]`` (:func:`shardsafe.manager.local.report`)."""

    copies: list[list[Any]]
    TYPES: ClassVar[dict[str, Any]] = {"copies": list}


@dataclass(frozen=True)
class TierPlan(Message):
    """(rank 0 decides) The local saves to try, newest first, each ``[step, save, incarnation, sources]``
    with ``sources[r]`` = ``[holder rank, entry name]`` (:func:`shardsafe.manager.local.plan`)."""

    candidates: list[list[Any]]
    TYPES: ClassVar[dict[str, Any]] = {"candidates": list}


@dataclass(frozen=True)
class Recorded(Message):
    """(rank 0 decides, ``tier.begin``) Whether it recorded this job's incarnation in the run record."""

    recorded: bool
    TYPES: ClassVar[dict[str, Any]] = {"recorded": bool}


TIER_ARRIVE = Round("arrive", Peer, TierStart)
"""(every rank, ``tier.save``) Its node and replica server; rank 0 returns the table, run, incarnation, save."""
TIER_DONE = Round("done", Attempt, Attempts)
"""(every rank, ``tier.save``) Its share saved and replicated, or its failure; rank 0 records the
incarnation before deciding when every rank succeeded."""
TIER_RESUME_ARRIVE = Round("arrive", Peer, TierTable)
"""(every rank, ``tier.resume``) Its node and replica server; rank 0 returns the table and the run."""
TIER_SCAN = Round("scan", Copies, TierPlan)
"""(every rank, ``tier.resume``) The copies that verify; rank 0 plans the candidates."""
TIER_FETCH = Round("fetch", Attempt, Attempts)
"""(every rank, per candidate, ``fetch.<n>``) Its share fetched from a peer where needed."""
TIER_LOAD = Round("load", Attempt, Attempts)
"""(every rank, per candidate, ``load.<n>``) Its share loaded."""
TIER_RECORD = Round("record", Empty, Recorded)
"""(every rank, ``tier.begin``) Rank 0 records this job as a new incarnation of the run."""
