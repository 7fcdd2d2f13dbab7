"""Decide, act, confirm (a :class:`~shardsafe.coord.rounds.Commitment` run on every rank): the one place
where a round's outcome is settled by a decision key before anyone acts on it.

Every rank sends its message (or its failure). The outcome is settled by the first ``compare_set`` on
the round's decision key: "go" (rank 0, once every message is in and its decision is made: a save's
manifest durable in the pending directory) or an abort (any rank that failed, gave up at its deadline,
or found a rank dead). Nobody acts on an outcome before it is decided and nobody undoes it after:
rank 0 acts (publishes) only after it won "go", and a rank abandons what it prepared only where an
abort won.

- (rank 0) wait for every message (watching the others' heartbeats), decide, take the key with "go";
  if it won, act, then propose the confirmation as the round's outcome. An act that fails is proposed
  as the outcome instead (every rank raises it).
- (other ranks) wait for the outcome (watching rank 0's heartbeat). A rank that gives up, or finds rank
  0 dead, proposes an abort; if "go" had won already it asks the caller's probe instead (a save asks
  the storage: a manifest carrying its save id means committed), and so does a rank that loses the
  store after the decision.

No interleaving of timeouts, failures and a slow act leaves an act done that any rank took for aborted,
and every rank sees one outcome."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from shardsafe.coord.ending import settle
from shardsafe.coord.messages import Envelope, Message, Outcome
from shardsafe.coord.rounds import Commitment
from shardsafe.coord.session import Session
from shardsafe.coord.wire import GO, Wire
from shardsafe.deadline import Deadline
from shardsafe.errors import CheckpointError, InternalError, RankDeadError

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
C = TypeVar("C", bound=Message)


class Step:
    """(every rank) One commitment of ``s``; :func:`commit` runs it. The callables are the caller's:

    - ``decide(messages)`` (rank 0, every message in): what to act on; raising a
      :class:`CheckpointError` makes that error the outcome for everyone (decided);
    - ``act(decided)`` (rank 0, "go" won): do it; returns the confirmation every rank reads. What it
      raises is proposed as the outcome (decided) and raised on every rank;
    - ``acted_failed(err)`` (rank 0, after such a failure was proposed): its clean-up; returns the error
      to raise instead of ``err`` (or ``None``);
    - ``abandon()`` (every rank where an abort is the outcome, before raising it): undo what it prepared;
    - ``probe(why, cause)`` (a rank other than 0 that lost rank 0 or the store after "go"): whether the act
      happened: the confirmation, else raise;
    - ``on_phase(name)``: this rank enters phase ``name`` (the commitment's declared phases)."""

    def __init__(
        self,
        s: Session,
        step: Commitment[Any, Any],
        *,
        decide: Callable[[dict[int, Any]], Any],
        act: Callable[[Any], Any],
        acted_failed: Callable[[BaseException], BaseException | None],
        abandon: Callable[[], None],
        probe: Callable[[str, BaseException | None], Any],
        on_phase: Callable[[str], None],
        acknowledge: Callable[[], object],
    ) -> None:
        self.s = s
        self.step = step
        self.decide = decide
        self.act = act
        self.acted_failed = acted_failed
        self.abandon = abandon
        self.probe = probe
        self.on_phase = on_phase
        self.acknowledge = acknowledge
        self.wire: Wire | None = None if s.single else Wire(s, step.phase, decision=True)

    # ------------------------------------------------------------------------------ decision

    def _abort(self, outcome: Outcome, deadline: Deadline) -> Outcome | None:
        """(any rank) Propose ``outcome`` (a failure or a timeout) as the decision; the settled abort
        (maybe another rank's), or ``None`` when "go" won first."""
        w = self.wire
        if w is None:
            return outcome
        bound = deadline.or_grace()
        settled = w.decide(outcome.to_text(), bound)
        if settled == GO:
            return None
        return w.propose(outcome if settled == outcome.to_text() else Outcome.from_text(settled), bound)

    def _raise(self, outcome: Outcome, own: BaseException | None) -> NoReturn:
        """(every rank) An abort is the outcome: abandon, acknowledge, raise what it says."""
        self.abandon()
        self.acknowledge()
        settle(self.s, outcome, own)
        raise InternalError(f"{self.s.op} of {self.s.target!r}: an abort outcome that says no failure")

    # ------------------------------------------------------------------------------ the round

    def run(self, mine: Message | None, error: BaseException | None, failed_in: str) -> Any:
        s = self.s
        deadline = s.clock.end
        failure = s.failure_of(error, failed_in) if error is not None else None
        if s.single:
            if failure is not None:
                self._raise(Outcome(failure=failure), error)
            assert mine is not None
            return self._lead({0: mine})
        w = self.wire
        assert w is not None
        s.status(self.step.phase)
        w.send(Envelope(s.rank, None if mine is None else mine.to_json(), failure), deadline.or_grace())
        if failure is not None:
            settled = self._abort(Outcome(failure=failure), deadline)
            if settled is None:  # "go" won without this rank's message: impossible
                raise InternalError(f"{s.op} of {s.target!r}: this rank failed after the decision to go")
            self._raise(settled, error)
        if s.rank == 0:
            return self._collect(w, deadline)
        return self._follow(w, deadline)

    def _collect(self, w: Wire, deadline: Deadline) -> Any:
        """(rank 0) Wait for every message, then lead."""
        s = self.s

        def dead(ranks: list[int], silent: float) -> None:
            self._abort(Outcome(failure=s.dead_failure(ranks[0], self.step.phase, silent)), deadline)

        got = w.wait(
            w.ready, deadline, w.watch_others(dead), w.stalled(f"every rank to reach {self.step.phase!r}", deadline)
        )
        if got is None:
            settled = self._abort(w.timeout(deadline), deadline)
            assert settled is not None
            self._raise(settled, None)
        envelopes = w.messages(deadline.or_grace())
        failed = [e.failure for _, e in sorted(envelopes.items()) if e.failure is not None]
        if failed or len(envelopes) < s.world_size:
            if failed:
                settled = self._abort(Outcome(failure=failed[0]), deadline)
            else:  # woken by an outcome proposed early (a dead rank): read it
                settled = Outcome.from_text(w.read_decision(deadline.or_grace()))
            assert settled is not None
            self._raise(settled, None)
        messages = {r: self.step.message.from_json(e.body or {}) for r, e in sorted(envelopes.items())}
        return self._lead(messages)

    def _lead(self, messages: dict[int, Any]) -> Any:
        """(rank 0, every message in) Decide, take the key, act, confirm."""
        s, step = self.s, self.step
        deadline = s.clock.end
        self.on_phase(step.deciding)
        try:
            decided = self.decide(messages)
        except BaseException as err:
            own_decision = isinstance(err, CheckpointError)
            failure = s.failure_of(err, step.deciding, decided=own_decision)
            if isinstance(err, CheckpointError):
                s.own_decided = err
            settled = self._abort(Outcome(failure=failure), deadline)
            assert settled is not None
            self._raise(settled, err)
        self.on_phase(step.settling)
        if self.wire is not None:
            won = self.wire.decide(GO, deadline.or_grace())
            if won != GO:
                self._raise(Outcome.from_text(won), None)
        self.on_phase(step.acting)
        try:
            confirmed = self.act(decided)
        except BaseException as err:
            if self.wire is not None:
                try:
                    self.wire.propose(
                        Outcome(failure=s.failure_of(err, step.acting, decided=True)), deadline.or_grace()
                    )
                except RankDeadError as lost:
                    logger.error(
                        "shardsafe: could not tell the ranks that the %s of %s failed: %s", step.act, s.target, lost
                    )
            worse = self.acted_failed(err)
            self.acknowledge()
            if worse is not None:
                raise worse from err.__cause__
            raise
        if self.wire is not None:
            self.wire.propose(Outcome(body=confirmed.to_json()), deadline.or_grace())
        return confirmed

    def _follow(self, w: Wire, deadline: Deadline) -> Any:
        """(ranks other than 0, message sent) Learn the outcome; see the module docstring."""
        s, step = self.s, self.step
        self.on_phase(step.following)
        lost_leader = threading.Event()

        def dead(_ranks: list[int], silent: float) -> None:
            if self._abort(Outcome(failure=s.dead_failure(0, step.phase, silent)), deadline) is None:
                lost_leader.set()  # "go" won: rank 0 was acting; only the probe can tell

        def interrupt() -> None:
            if lost_leader.is_set():
                raise RankDeadError(f"rank 0 stopped responding after the decision to {step.act}")

        watch = w.watch_leader(dead)
        assert s.client is not None and s.dog is not None
        s.dog.watch(watch)
        try:
            raw = s.client.wait_value(w.outcome, deadline, tally=s.tally, interrupt=interrupt, wake=watch.wake)
            if raw is None:
                settled = self._abort(w.timeout(deadline), deadline)
                if settled is not None:
                    self._raise(settled, None)
                # "go" won: rank 0 is acting; give it until the grace after the end
                raw = s.client.wait_value(w.outcome, deadline.or_grace(), tally=s.tally, interrupt=interrupt)
        except RankDeadError as err:
            if lost_leader.is_set():
                return self.probe(str(err), None)
            if err.store_lost:
                return self.probe(str(err), err)
            raise
        finally:
            s.dog.unwatch(watch)
        if raw is None:
            return self.probe(
                f"rank 0 decided to {step.act} but did not confirm it within the end deadline "
                f"({deadline.seconds:.0f}s)",
                None,
            )
        outcome = Outcome.from_text(raw)
        if outcome.body is None:
            self._raise(outcome, None)
        return step.confirmation.from_json(outcome.body)
