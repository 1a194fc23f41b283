"""How long a rank may stand still before the driver calls it hung: the watchdog's policies.

A policy is pure: given what the driver knows of every rank's progress (:class:`RankProgress`,
from the heartbeats), it says how long one rank may go without progress (:class:`Allowance`)
and why. :class:`sparkdl._driver.monitor.JobMonitor` applies it; the policies are unit-tested on
their own (``tests/unit/test_watchdog_policy.py``).

* :class:`FixedWatchdog` — ``watchdog_timeout_s=<seconds>``: the same bound in every phase.
* :class:`AutoWatchdog` — ``watchdog_timeout_s="auto"``: once the ranks have run enough steps to
  know their pace, a rank inside a step may stand still for ``factor`` × the slowest step seen
  on any rank (with a floor, and a cap); anything else (start-up, checkpoints, validation, epoch
  ends, a custom loop's own phases) keeps ``phase_s``. A hang in a 10 ms-step run is named in
  seconds, and a slow but steady run is judged by its own pace.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Union

from sparkdl._runtime.liveness import LOAD
from sparkdl._task.config import AUTO_WATCHDOG, check_watchdog_timeout


@dataclasses.dataclass(frozen=True)
class RankProgress:
    """What the driver knows of one rank's progress, from its latest heartbeat.

    Attributes:
        idle_s: seconds since its progress counter last moved, on the driver's clock.
        phase: what the rank said it is doing.
        step_part: ``sparkdl._runtime.liveness.LOAD`` or ``COMPUTE`` while the rank is inside a training step, else
            None (start-up, checkpoints, validation, epoch ends, a custom loop's phases).
        steps: training steps the rank has begun in this attempt.
        slowest_load_s, slowest_compute_s: the longest each part of one of its steps took so far.
    """

    idle_s: float
    phase: str = ""
    step_part: Optional[str] = None
    steps: int = 0
    slowest_load_s: float = 0.0
    slowest_compute_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Allowance:
    """How long a rank may stand still, and the figure it came from (said in the failure)."""

    seconds: float
    why: str


@dataclasses.dataclass(frozen=True)
class FixedWatchdog:
    """``watchdog_timeout_s=<seconds>``: one bound for every rank in every phase."""

    timeout_s: float

    @property
    def check_every_s(self) -> float:
        return min(1.0, self.timeout_s / 10)

    def allowance(self, rank: int, ranks: Mapping[int, RankProgress]) -> Allowance:
        return Allowance(self.timeout_s, f"watchdog_timeout_s={self.timeout_s:g}")


@dataclasses.dataclass(frozen=True)
class AutoWatchdog:
    """``watchdog_timeout_s="auto"``: a bound that follows the run's own pace.

    A rank inside a training step (waiting for its batch, or computing it) may stand still for
    ``factor`` × the slowest such part of a step that any rank has taken so far, at least
    ``compute_floor_s`` (``load_floor_s`` while it waits for data: object storage has slow
    moments that a few steps do not show) and at most ``phase_s``. That needs the pace to be
    known: until every rank has begun ``warmup_steps`` steps, and while any rank is outside a
    step (its peers may be waiting for it in a collective, legitimately), every rank may stand
    still for ``phase_s`` — the same bound as a fixed ``watchdog_timeout_s=600``.

    ``warmup_steps`` covers at least one of the strategy's synchronization cycles (a model
    average every ``sync_every`` steps is the slow step that must be seen before it is judged).
    """

    warmup_steps: int = 10
    factor: float = 10.0
    compute_floor_s: float = 6.0
    load_floor_s: float = 60.0
    phase_s: float = 600.0
    check_every_s: float = 0.5

    def allowance(self, rank: int, ranks: Mapping[int, RankProgress]) -> Allowance:
        mine = ranks[rank]
        outside = sorted(r for r, p in ranks.items() if p.step_part is None)
        warming = [r for r, p in ranks.items() if p.steps < self.warmup_steps]
        if outside or warming:
            reason = (
                f"rank {outside[0]} is outside a training step"
                if outside
                else f"the first {self.warmup_steps} steps set the pace"
            )
            return Allowance(self.phase_s, f"watchdog_timeout_s='auto': {self.phase_s:g}s while {reason}")
        if mine.step_part == LOAD:
            slowest, floor, part = max(p.slowest_load_s for p in ranks.values()), self.load_floor_s, "wait for a batch"
        else:
            slowest, floor, part = (
                max(p.slowest_compute_s for p in ranks.values()),
                self.compute_floor_s,
                "step's compute (forward, backward, sync, optimizer)",
            )
        seconds = min(self.phase_s, max(floor, self.factor * slowest))
        return Allowance(
            seconds,
            f"watchdog_timeout_s='auto': {self.factor:g} x the slowest {part} seen on any rank, {slowest:.3g}s, "
            f"at least {floor:g}s and at most {self.phase_s:g}s",
        )


Watchdog = Union[FixedWatchdog, AutoWatchdog]


def watchdog_policy(value: Union[float, str, None], steps_per_sync_cycle: int = 1) -> Optional[Watchdog]:
    """The policy a ``watchdog_timeout_s`` setting selects (None: no watchdog).

    ``steps_per_sync_cycle``: the optimizer steps over which the strategy's step times repeat
    (``Strategy.steps_per_sync_cycle``); "auto" learns the pace over two such cycles at least
    (a rank's steps count batches, and gradient accumulation on fewer workers puts more than
    one batch in an optimizer step).
    """
    check_watchdog_timeout(value)
    if value is None:
        return None
    if value == AUTO_WATCHDOG:
        return AutoWatchdog(warmup_steps=max(AutoWatchdog.warmup_steps, 2 * steps_per_sync_cycle + 1))
    return FixedWatchdog(float(value))
