"""Draining: a host that is about to go away gets a just-in-time checkpoint, not a lost epoch.

Spark's graceful decommissioning (``spark.decommission.enabled``; a standalone worker sent
SIGPWR or decommissioned through the master, a Kubernetes pod's pre-stop hook, a YARN node
being decommissioned) tells the driver an executor will go. The driver, which sees that
(``sparkdl._driver.stage``), publishes a notice in the launch's rendezvous store
(:data:`DRAIN_KEY`); each rank's heartbeat thread reads it within a heartbeat
(:class:`DrainNotice`). Ranks must stop at the same step to write one consistent checkpoint, so
every :data:`DRAIN_CHECK_EVERY` steps a fit's ranks agree with one 4-byte allreduce
(:func:`agreed`); then every rank saves the checkpoint of that step, waits for it to be stored, and
raises :class:`~sparkdl.errors.HostDrained`. The launcher relaunches from that checkpoint without
counting a failure (with ``min_workers``, on the hosts that are left): no step is redone.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

#: The rendezvous-store key the driver sets (its value: why, for the message) to drain the run.
DRAIN_KEY = "sparkdl/drain"

#: Steps between the ranks' agreements on draining: one 4-byte allreduce each time, and at most
#: this many steps between the notice reaching every rank and the checkpoint.
DRAIN_CHECK_EVERY = 8


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


def agreed(notice: DrainNotice, device: torch.device) -> bool:
    """Whether any rank has the notice; a collective every rank calls at the same step."""
    flag = torch.tensor([1.0 if notice.requested() else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


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
