"""Draining: a host that is about to go away gets a just-in-time checkpoint, not a lost epoch.

Spark's graceful decommissioning (``spark.decommission.enabled``; a standalone worker sent
SIGPWR or decommissioned through the master, a Kubernetes pod's pre-stop hook, a YARN node
being decommissioned) tells the driver an executor will go. The driver, which sees that
(``sparkdl._driver.stage``), publishes a notice in the launch's rendezvous store
(:data:`DRAIN_KEY`); each rank's heartbeat thread reads it within a heartbeat
(:class:`DrainNotice`). Ranks must stop at the same step to write one consistent checkpoint, so
they agree with a small allreduce (:class:`DrainAgreement`); then every rank saves the checkpoint
of that step, waits for it to be stored, and raises :class:`~sparkdl.errors.HostDrained`. The
launcher relaunches from that checkpoint without counting a failure (with ``min_workers``, on the
hosts that are left): no step is redone.

How often they agree is a matter of time, not steps: about every :data:`DRAIN_CHECK_SECONDS`.
An agreement every 8 steps stalled every eighth step for a network round trip and for the slowest
rank: 1-1.5 ms of a 2.4 ms step on loopback (a data-bound fit on two one-core ranks), about 6 %
of its steps' time, and more between hosts, where the averaging strategies and the parameter
server exist to avoid exactly such round trips. Steps of a second each, on the other hand, must
not wait many steps for a drain: a decommissioned host may be gone in 30 s.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

#: The rendezvous-store key the driver sets (its value: why, for the message) to drain the run.
DRAIN_KEY = "sparkdl/drain"

#: About how long between the ranks' agreements on draining (and so between the notice reaching
#: every rank and the checkpoint, plus a step).
DRAIN_CHECK_SECONDS = 0.5
#: Steps before the first agreement, before a step's time is known.
FIRST_CHECK_AFTER = 8
#: The most steps between two agreements, however short the steps.
MAX_STEPS_BETWEEN_CHECKS = 4096


class DrainNotice:
    """Whether this rank has heard that the run must drain, and why (set once, by any thread)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def requested(self) -> bool:
        return self._event.is_set()


class DrainAgreement:
    """Asked at every step, the same steps on every rank; agrees with the other ranks about every
    :data:`DRAIN_CHECK_SECONDS`.

    An agreement is one allreduce (MAX) of this rank's notice and its seconds per step since the
    last one. Every rank receives the same values, so every rank computes the same number of steps
    to the next agreement (the slowest rank's steps in :data:`DRAIN_CHECK_SECONDS`, at least one,
    at most :data:`MAX_STEPS_BETWEEN_CHECKS`): they stay in step without a word more."""

    def __init__(self, notice: DrainNotice, device: torch.device) -> None:
        self._notice = notice
        self._device = device
        self._steps_left = FIRST_CHECK_AFTER
        self._steps_since = 0
        self._since = time.monotonic()
        #: Agreements made (for tests and benchmarks).
        self.agreements = 0

    def check(self) -> bool:
        """Whether every rank is to drain at this step. A collective on some calls."""
        self._steps_since += 1
        self._steps_left -= 1
        if self._steps_left > 0:
            return False
        seconds_per_step = (time.monotonic() - self._since) / self._steps_since
        values = torch.tensor(
            [1.0 if self._notice.requested() else 0.0, seconds_per_step], dtype=torch.float64, device=self._device
        )
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        drain, slowest = values.tolist()
        self.agreements += 1
        self._steps_left = steps_between_checks(slowest)
        self._steps_since = 0
        self._since = time.monotonic()
        return drain > 0


def steps_between_checks(seconds_per_step: float) -> int:
    """The steps in :data:`DRAIN_CHECK_SECONDS` at ``seconds_per_step``, within [1, MAX_STEPS_BETWEEN_CHECKS]."""
    if not seconds_per_step > 0:  # a clock that did not move, or NaN
        return MAX_STEPS_BETWEEN_CHECKS
    return max(1, min(MAX_STEPS_BETWEEN_CHECKS, int(DRAIN_CHECK_SECONDS / seconds_per_step)))


def drain_reason(notice: DrainNotice) -> str:
    """Why the run drains: the notice this rank read, else the driver's (a rank that learned it
    only from the agreement reads it from the rendezvous store now)."""
    if notice.reason:
        return notice.reason
    from sparkdl._runtime.rendezvous import active_store

    stores = active_store()
    client = stores[1] if stores is not None else None
    try:
        if client is not None and client.check([DRAIN_KEY]):
            return client.get(DRAIN_KEY).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - only the message's wording depends on it
        pass
    return "another rank's host is being decommissioned"
