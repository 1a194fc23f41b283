"""The driver's attempt loop (sparkdl._driver.controller) driven through every transition with a
fake stage — the controller's only contact with Spark is its AttemptStage — and the policies
it asks (sparkdl._driver.policy): which hosts are gone, how many workers after a start shortfall."""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Set

import pytest

from sparkdl._driver.controller import AttemptOutcome, Controller, State
from sparkdl._driver.policy import (
    DrainPolicy,
    FailurePolicy,
    LostHost,
    LostHostPolicy,
    RankWhereabouts,
    ScalingPolicy,
    StartShortfallPolicy,
)
from sparkdl.errors import InsufficientSlotsError, RankFailure, TrainingError

S, R, RS, D, F, X = (
    State.SCHEDULING,
    State.RUNNING,
    State.RESTARTING,
    State.DRAINING,
    State.FINISHED,
    State.FAILED,
)


def _error(exc_type: str, message: str = "boom", rank: int = 1, phase: str = "training step 3") -> TrainingError:
    return TrainingError([RankFailure(rank=rank, exc_type=exc_type, message=message, traceback="", phase=phase)])


def _where(rank: int, address: str, silent_s: float) -> RankWhereabouts:
    return RankWhereabouts(rank, f"name-of-{address}", address, silent_s)


class FakeStage:
    """Plays back scripted outcomes and records what the controller asked of it."""

    def __init__(
        self,
        outcomes: Sequence[AttemptOutcome],
        free: Optional[int] = None,
        listed: Optional[Set[str]] = None,
        refuse: bool = False,
    ) -> None:
        self.outcomes = list(outcomes)
        self.free, self.listed, self.refuse = free, listed, refuse
        self.asked: List[tuple] = []  # (attempt, wanted, enough)
        self.ran: List[tuple] = []  # (attempt, workers)
        self.dropped: List[str] = []

    def free_workers(self, attempt: int, wanted: int, enough: int) -> int:
        self.asked.append((attempt, wanted, enough))
        if self.refuse:
            raise InsufficientSlotsError("1 free task slot, fewer than min_workers=2")
        return wanted if self.free is None else min(wanted, self.free)

    def run(self, attempt: int, num_workers: int) -> AttemptOutcome:
        self.ran.append((attempt, num_workers))
        return self.outcomes.pop(0)

    def still_listed(self, addresses: Sequence[str]) -> Optional[Set[str]]:
        return self.listed

    def drop(self, hosts: Sequence[LostHost]) -> None:
        self.dropped += [host.address for host in hosts]


def _controller(stage: FakeStage, max_failures: int = 2, min_workers: Optional[int] = None, workers: int = 2):
    said: List[str] = []
    controller = Controller(
        stage=stage,
        num_workers=workers,
        failures=FailurePolicy(max_failures),
        scaling=ScalingPolicy(workers, min_workers, 30.0),
        shortfall=StartShortfallPolicy(min_workers),
        lost_hosts=LostHostPolicy(silent_after_s=6.0),
        drains=DrainPolicy(max_drains=1),
        say=said.append,
        has_checkpoints=True,
    )
    return controller, said


def test_every_transition_with_a_fake_stage_in_well_under_a_second():
    began = time.monotonic()
    lost_host = (_where(0, "10.0.0.1", 0.5), _where(1, "10.0.0.2", 31.0))
    stage = FakeStage(
        [
            AttemptOutcome(error=_error("HostDrained", "drained at step 8"), whereabouts=lost_host[:1]),
            AttemptOutcome(error=_error("WatchdogTimeout", "rank 1 made no progress"), whereabouts=lost_host),
            AttemptOutcome(shortfall=InsufficientSlotsError("0 of 2 tasks started"), started=0),
            AttemptOutcome(value="trained"),
        ],
        listed={"10.0.0.1", "10.0.0.2"},
    )
    controller, said = _controller(stage, min_workers=1)
    assert controller.run() == "trained"
    assert controller.transitions == [
        (S, R),
        (R, D),  # the drain: relaunched from its checkpoint, no failure counted
        (D, S),
        (S, R),
        (R, RS),  # the watchdog's failure: retried
        (RS, S),
        (S, R),
        (R, S),  # the tasks did not all start: fewer workers
        (S, R),
        (R, F),
    ]
    # The host silent for 31 s when the watchdog fired is dropped before the relaunch counts slots,
    # and the relaunch does not wait for its slot: one free slot is enough.
    assert stage.dropped == ["10.0.0.2"]
    assert stage.asked[2] == (3, 2, 1)
    assert [workers for _, workers in stage.ran] == [2, 2, 2, 1]
    assert controller.workers == [2, 2, 2, 1]
    assert [a["error"] is None for a in controller.attempts] == [False, False, False, True]
    assert controller.attempts[0]["drained"] is True
    assert any("host name-of-10.0.0.2 is gone (no word from rank(s) [1] for 31s" in line for line in said), said
    assert any("relaunching on 1 worker(s) (min_workers=1)" in line for line in said), said
    assert time.monotonic() - began < 0.5


def test_failures_that_would_repeat_or_exceed_max_failures_end_in_failed():
    stage = FakeStage([AttemptOutcome(error=_error("ConfigError", "batch_size=0"))])
    controller, _ = _controller(stage)
    with pytest.raises(TrainingError, match="batch_size=0") as info:
        controller.run()
    assert controller.transitions == [(S, R), (R, X)] and "attempt" not in str(info.value)

    same = _error("RuntimeError", "the same")
    stage = FakeStage([AttemptOutcome(error=same), AttemptOutcome(error=same)])
    controller, _ = _controller(stage, max_failures=5)
    with pytest.raises(TrainingError, match="the same failure as attempt 1, so not retried again"):
        controller.run()
    assert controller.transitions[-1] == (R, X)

    stage = FakeStage([AttemptOutcome(error=_error("RuntimeError", f"boom {i}")) for i in range(3)])
    controller, _ = _controller(stage, max_failures=1)
    with pytest.raises(TrainingError, match=r"attempt 2; max_failures=1"):
        controller.run()


def test_scheduling_that_finds_too_few_slots_and_a_shortfall_below_min_workers_end_in_failed():
    controller, _ = _controller(FakeStage([], refuse=True), min_workers=2)
    with pytest.raises(InsufficientSlotsError, match="fewer than min_workers=2"):
        controller.run()
    assert controller.transitions == [(S, X)]

    stage = FakeStage([AttemptOutcome(shortfall=InsufficientSlotsError("1 of 2 tasks started"), started=1)])
    controller, _ = _controller(stage)  # no min_workers: the shortfall is raised
    with pytest.raises(InsufficientSlotsError, match="1 of 2 tasks started"):
        controller.run()
    assert controller.transitions == [(S, R), (R, X)]


def test_a_second_drain_past_max_drains_counts_as_a_failure():
    drained = AttemptOutcome(error=_error("HostDrained", "drained"))
    stage = FakeStage([drained, AttemptOutcome(error=_error("HostDrained", "drained again")), AttemptOutcome(value=1)])
    controller, _ = _controller(stage)
    assert controller.run() == 1
    assert [t for t in controller.transitions if t[0] is R] == [(R, D), (R, RS), (R, F)]


def test_lost_hosts_are_the_silent_ones_when_someone_else_was_heard():
    policy = LostHostPolicy(silent_after_s=6.0)
    ranks = [_where(0, "a", 1.0), _where(1, "b", 40.0), _where(2, "b", 39.0), _where(3, "c", 2.0)]
    (lost,) = policy.decide(ranks)
    assert (lost.address, lost.ranks) == ("b", (1, 2)) and "for 39s" in lost.why
    # A rank that spoke on the same host keeps it: that is its process, not the host.
    assert policy.decide([_where(0, "a", 1.0), _where(1, "b", 40.0), _where(2, "b", 1.0)]) == []
    # Everyone silent: the driver's own silence, nobody's host is blamed.
    assert policy.decide([_where(0, "a", 40.0), _where(1, "b", 40.0)]) == []
    # Spark no longer lists an executor there: gone, whatever the silence.
    (gone,) = policy.decide([_where(0, "a", 1.0), _where(1, "b", 2.0)], spark_lists={"a"})
    assert gone.address == "b" and gone.why == "Spark lists no live executor there"


def test_a_shortfall_relaunches_on_the_tasks_that_started_or_one_fewer_down_to_min_workers():
    policy = StartShortfallPolicy(min_workers=2)
    assert policy.workers_after(asked=4, started=3) == 3
    assert policy.workers_after(asked=4, started=0) == 3
    assert policy.workers_after(asked=2, started=0) is None
    assert StartShortfallPolicy(None).workers_after(asked=4, started=3) is None
