"""The driver's attempt loop as a controller of explicit states.

::

    SCHEDULING --> RUNNING --> FINISHED
        ^             |
        |             +--> RESTARTING  (a failure the FailurePolicy retries; lost hosts dropped)
        |             +--> DRAINING    (a host Spark decommissions: relaunched from its checkpoint)
        |             +--> SCHEDULING  (the tasks did not all start: fewer workers, StartShortfallPolicy)
        |             +--> FAILED      (raised)
        +-- RESTARTING, DRAINING

Every transition is decided by a policy object (:mod:`sparkdl._driver.policy`: pure, unit-tested
on its own); everything that touches Spark is behind :class:`AttemptStage`, which
:mod:`sparkdl._driver.stage` implements over a real barrier stage and the tests replace with a
fake (``tests/unit/test_controller.py`` drives every transition in well under a second).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from sparkdl._driver.policy import (
    Decision,
    DrainPolicy,
    FailurePolicy,
    LostHost,
    LostHostPolicy,
    RankWhereabouts,
    ScalingPolicy,
    StartShortfallPolicy,
    same_failure,
)
from sparkdl.errors import InsufficientSlotsError, TrainingError


class State(enum.Enum):
    SCHEDULING = "scheduling"  # how many workers the attempt gets
    RUNNING = "running"  # the attempt's barrier stage runs
    RESTARTING = "restarting"  # a failed attempt is relaunched
    DRAINING = "draining"  # an attempt drained: relaunched from its checkpoint, no failure counted
    FINISHED = "finished"
    FAILED = "failed"


@dataclasses.dataclass
class AttemptOutcome:
    """How one attempt ended: rank 0's ``value``, or the run's ``error``; ``shortfall`` when its
    tasks did not all start within their bound (``started`` of them did)."""

    value: Any = None
    error: Optional[TrainingError] = None
    shortfall: Optional[InsufficientSlotsError] = None
    started: int = 0
    #: Where the ranks ran and how long each had been silent when the first failure came.
    whereabouts: Tuple[RankWhereabouts, ...] = ()
    #: Addresses of executors Spark decommissioned during the attempt (a drain).
    decommissioned: Tuple[str, ...] = ()
    #: Hosts the attempt already stopped using (``spark.sparkdl.hostTimeout`` fired).
    dropped: Tuple[str, ...] = ()
    profile_ids: List[int] = dataclasses.field(default_factory=list)


class AttemptStage(Protocol):
    """What the controller drives: the cluster's slots and one attempt's barrier stage."""

    def free_workers(self, attempt: int, wanted: int, enough: int) -> int:
        """The workers the attempt can have: ``wanted`` when free, else what is free once waiting
        longer would not help (``enough`` free already is such a point). Raises
        InsufficientSlotsError when the attempt cannot run."""

    def run(self, attempt: int, num_workers: int) -> AttemptOutcome:
        """Runs one attempt on ``num_workers`` tasks."""

    def still_listed(self, addresses: Sequence[str]) -> Optional[Set[str]]:
        """Those of ``addresses`` where Spark lists a live executor; None when it cannot be asked."""

    def drop(self, hosts: Sequence[LostHost]) -> None:
        """Stops Spark from scheduling on these hosts."""


@dataclasses.dataclass
class Controller:
    """Runs attempts until one finishes or a policy says to raise.

    Attributes (results): ``attempts`` (one record per attempt: its number, seconds, first error
    line, ``drained``), ``workers`` (each attempt's), ``transitions`` (every state change).
    """

    stage: AttemptStage
    num_workers: int
    failures: FailurePolicy
    scaling: ScalingPolicy
    shortfall: StartShortfallPolicy
    lost_hosts: LostHostPolicy
    drains: DrainPolicy
    say: Callable[[str], None]
    has_checkpoints: bool = False
    attempts: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    workers: List[int] = dataclasses.field(default_factory=list)
    transitions: List[Tuple[State, State]] = dataclasses.field(default_factory=list)
    profile_ids: List[int] = dataclasses.field(default_factory=list)

    def run(self) -> Any:
        """Rank 0's value of the attempt that finished; raises what ended the run."""
        self.state, self._attempt, self._drained = State.SCHEDULING, 1, 0
        self._cap, self._gone = self.num_workers, 0  # at most this many workers; slots known gone
        self._previous: Optional[TrainingError] = None
        steps = {
            State.SCHEDULING: self._schedule,
            State.RUNNING: self._run,
            State.RESTARTING: self._restart,
            State.DRAINING: self._drain,
        }
        while self.state not in (State.FINISHED, State.FAILED):
            self._go(steps[self.state]())
        if self.state is State.FAILED:
            raise self._raise
        return self._value

    def _go(self, state: State) -> None:
        self.transitions.append((self.state, state))
        self.state = state

    def _fail(self, error: BaseException) -> State:
        self._raise = error
        return State.FAILED

    # ---- the states ---------------------------------------------------------------------------

    def _schedule(self) -> State:
        enough = max(self.scaling.min_workers or self._cap, self._cap - self._gone)
        try:
            free = self.stage.free_workers(self._attempt, self._cap, min(enough, self._cap))
        except InsufficientSlotsError as exc:
            return self._fail(exc)
        scaling = self.scaling.decide(min(free, self._cap), self._attempt, self.has_checkpoints)
        self._workers = min(scaling.num_workers, self._cap)
        if scaling.message:
            self.say(scaling.message)
        return State.RUNNING

    def _run(self) -> State:
        self.workers.append(self._workers)
        started = time.time()
        outcome = self.stage.run(self._attempt, self._workers)
        self._outcome = outcome
        failure = outcome.shortfall or outcome.error
        record: Dict[str, Any] = {"attempt": self._attempt, "seconds": time.time() - started}
        record["error"] = str(failure).splitlines()[0] if failure is not None else None
        self.attempts.append(record)
        self.profile_ids = outcome.profile_ids
        if failure is None:
            self._value = outcome.value
            return State.FINISHED
        if outcome.shortfall is not None:
            return self._after_shortfall(outcome)
        assert outcome.error is not None
        if self.drains.relaunch_free(outcome.error, self._drained):
            record["drained"] = True
            return State.DRAINING
        decision = self.failures.decide(outcome.error, self._attempt - self._drained, self._previous)
        if decision is Decision.RAISE:
            return self._fail(self._final_error(outcome.error))
        return State.RESTARTING

    def _after_shortfall(self, outcome: AttemptOutcome) -> State:
        fewer = self.shortfall.workers_after(self._workers, outcome.started)
        if fewer is None:
            assert outcome.shortfall is not None
            return self._fail(outcome.shortfall)
        self.say(
            f"[sparkdl] attempt {self._attempt}: {outcome.started} of its {self._workers} tasks started within their bound "
            f"(a slot Spark counted is gone); relaunching on {fewer} worker(s) (min_workers={self.shortfall.min_workers})"
        )
        self._cap = fewer
        self._attempt += 1
        return State.SCHEDULING

    def _restart(self) -> State:
        outcome, error = self._outcome, self._outcome.error
        assert error is not None
        listed = self.stage.still_listed([w.address for w in outcome.whereabouts])
        lost = self.lost_hosts.decide(outcome.whereabouts, listed)
        to_drop = [host for host in lost if host.address not in outcome.dropped]
        if to_drop:
            for host in to_drop:
                self.say(f"[sparkdl] host {host.host} is gone ({host.why}): Spark stops scheduling there")
            self.stage.drop(to_drop)
        self._gone += sum(len(host.ranks) for host in lost)
        self._previous = error
        where = "the newest checkpoint" if self.has_checkpoints else "scratch (no checkpoint_dir)"
        self.say(
            f"[sparkdl] attempt {self._attempt} failed: {str(error).splitlines()[0]}; relaunching from {where} "
            f"({self._attempt - self._drained}/{self.failures.max_failures} retries)"
        )
        self._attempt += 1
        return State.SCHEDULING

    def _drain(self) -> State:
        error = self._outcome.error
        assert error is not None
        self._drained += 1
        self._gone += sum(1 for w in self._outcome.whereabouts if w.address in self._outcome.decommissioned)
        self.say(
            f"[sparkdl] attempt {self._attempt} drained: {error.failures[0].message}; relaunching from that checkpoint"
        )
        self._attempt += 1
        return State.SCHEDULING

    def _final_error(self, error: TrainingError) -> TrainingError:
        if self._attempt == 1:
            return error
        repeated = ""
        if self._previous is not None and same_failure(error.failures[0], self._previous.failures[0]):
            repeated = f"; the same failure as attempt {self._attempt - 1}, so not retried again"
        hint = f"(attempt {self._attempt}; max_failures={self.failures.max_failures}{repeated})"
        return TrainingError(error.failures, hint=hint)
