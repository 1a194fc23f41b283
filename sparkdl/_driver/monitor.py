"""The driver-side state of a running job: failures, phases, progress, and when to cancel.

:class:`JobMonitor` holds no Spark object: it is fed the channel's messages and disconnects, and
calls the ``cancel`` it was given, so it is unit-tested on its own.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from sparkdl._driver.policy import RankWhereabouts
from sparkdl._driver.progress import ProgressDisplay
from sparkdl._driver.watchdog import Allowance, FixedWatchdog, RankProgress, Watchdog
from sparkdl._runtime.liveness import COMPUTE, LOAD
from sparkdl.errors import InsufficientSlotsError, RankFailure, is_peer_loss

logger = logging.getLogger("sparkdl")

#: Whether a rank's error reads like the consequence of another rank's death (sparkdl.errors).
_is_peer_loss = is_peer_loss


class JobMonitor:
    """Driver-side state of one run, updated from the channel's threads.

    ``on_message`` and ``on_disconnect`` are the channel server's callbacks; ``watch`` (the
    watchdog) and ``watch_start`` (the slot watch) run on threads of their own. The first failure
    calls ``cancel`` once, ``settle_s`` later, with the failures sorted root cause first.
    """

    def __init__(self, num_workers: int, cancel: Callable[[], None], display: ProgressDisplay) -> None:
        self.num_workers = num_workers
        self._cancel = cancel
        self.display = display
        self.failures: List[RankFailure] = []
        self.phases: Dict[int, str] = {}
        self.connected: set = set()
        self.finished: set = set()
        self._progress: Dict[int, Tuple[int, float]] = {}  # rank -> (progress counter, when it last moved)
        self._cond = threading.Condition()
        self._cancelled = False
        #: rank -> when the driver last heard from it (any message), and where it runs.
        self._heard: Dict[int, float] = {}
        self.hosts: Dict[int, str] = {}
        self.addresses: Dict[int, str] = {}  # the executor's address as Spark knows it
        #: rank -> its step timings from its latest heartbeat (RankProgress's fields but idle_s).
        self._pace: Dict[int, Dict[str, Any]] = {}
        #: Where the ranks ran and how long each had been silent when the first failure came.
        self.whereabouts: List[RankWhereabouts] = []
        #: Executor addresses Spark decommissioned (host_watch), and those dropped as silent.
        self.decommissioned: Set[str] = set()
        self.dropped: Set[str] = set()

    def on_message(self, rank: int, message: Dict[str, Any]) -> None:
        kind = message.get("kind")
        with self._cond:
            self._heard[rank] = time.monotonic()
        if kind == "started":
            self.hosts[rank] = str(message.get("host") or "")
            self.addresses[rank] = str(message.get("address") or "")
            self.on_connect(rank)
        elif kind == "epoch":
            self.display.epoch(message.get("record", {}))
        elif kind == "metrics":
            self.display.metrics(rank, message.get("metrics", {}))
        elif (
            kind == "output"
        ):  # what the rank's code printed (a run() function or a launched child), batched by the task
            lines = message.get("lines")
            if isinstance(lines, list):
                self.display.output(
                    rank, [(str(item[0]), str(item[1])) for item in lines if isinstance(item, list) and len(item) == 2]
                )
        elif kind == "heartbeat":
            progress = int(message.get("progress", 0))
            with self._cond:
                self.phases[rank] = str(message.get("phase", ""))
                self._pace[rank] = _pace(message)
                if self._progress.get(rank, (None, 0.0))[0] != progress:
                    self._progress[rank] = (progress, time.monotonic())
        elif kind == "log":
            level = int(message.get("level", logging.INFO))
            logging.getLogger(f"sparkdl.rank{rank}").log(level, "[rank %d] %s", rank, message.get("message", ""))
        elif kind == "error":
            self._fail(RankFailure.from_json({**message.get("failure", {}), "rank": rank}))
        elif kind == "done":
            with self._cond:
                self.finished.add(rank)
                self._cond.notify_all()

    #: Set when the barrier stage's tasks did not all start within the slot wait.
    slots_missing: Optional[InsufficientSlotsError] = None
    #: Where the tasks report to (the progress channel's host), for the slot watch's message.
    channel_host: str = ""

    def watch_start(self, wait_s: float, stop: threading.Event, label: str = "") -> None:
        """Cancels the stage when not every rank has started within ``wait_s``: the cluster has
        fewer free task slots than ranks (a barrier stage starts all its tasks or none)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while len(self._progress) < self.num_workers and not stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.5))
            started = len(self._progress)
            if started >= self.num_workers or stop.is_set() or self._cancelled:
                return
            self._cancelled = True
            # No task at all reached the driver: they may have started and failed to connect.
            unreachable = (
                f". If the executors cannot reach the driver's progress channel at {self.channel_host} (spark.sparkdl.clientHost, "
                f"else spark.driver.host), no task can report that it started either: set spark.sparkdl.clientHost to an "
                f"address they can reach"
                if started == 0 and self.channel_host
                else ""
            )
            self.slots_missing = InsufficientSlotsError(
                f"num_workers={self.num_workers} needs {self.num_workers} concurrent task slots, but {started} of the barrier "
                f"stage's tasks started within {label or f'slot_wait_s={wait_s:g}s'}: the cluster has fewer free slots than that (slots = executor "
                f"cores / spark.task.cpus). Lower num_workers, add executors or cores, or raise slot_wait_s when the "
                f"cluster's executors start slowly or other jobs hold its slots for a while{unreachable}"
            )
        logger.error("%s; cancelling the Spark job", self.slots_missing)
        self._cancel()

    def on_connect(self, rank: int) -> None:
        with self._cond:
            self.connected.add(rank)
            now = time.monotonic()
            first_time = rank not in self._progress
            self._progress[rank] = (-1, now)
            if first_time and len(self._progress) == self.num_workers:
                # The last rank started: the watchdog's clock starts now for every rank. Until
                # then the early ranks wait for it at the rendezvous, which is no hang of theirs
                # (a slow Python worker start of one executor must not name another rank).
                self._progress = {r: (progress, now) for r, (progress, _) in self._progress.items()}
            self._cond.notify_all()

    def watch(self, watchdog: Union[float, Watchdog], stop: threading.Event) -> None:
        """Fails the run when a rank's progress stands still for longer than the watchdog's
        policy allows it (``seconds``: a fixed bound; see :mod:`sparkdl._driver.watchdog`),
        counted from when every rank has started (a task that never starts is the slot watch's,
        or the rendezvous timeout's: ``LaunchConfig.timeout_s``)."""
        policy = FixedWatchdog(float(watchdog)) if isinstance(watchdog, (int, float)) else watchdog
        while not stop.wait(policy.check_every_s):
            with self._cond:
                if self._cancelled or len(self._progress) < self.num_workers:
                    continue
                stalled = self._stalled(policy, time.monotonic())
                if stalled is None:
                    continue
                rank, idle_s, allowance = stalled
                phase, host = self.phases.get(rank, ""), self.hosts.get(rank, "")
            stuck = f"rank {rank} made no progress for {idle_s:.0f}s ({allowance.why})"
            # Said now: the error itself comes once the Spark job is cancelled and the tasks end.
            logger.warning("watchdog: %s while %s; cancelling the run", stuck, phase or "starting")
            self._fail(
                RankFailure(
                    rank=rank,
                    exc_type="WatchdogTimeout",
                    message=(
                        f"{stuck}; it is stuck or much slower than expected. If this phase legitimately takes "
                        f"longer, raise watchdog_timeout_s"
                    ),
                    traceback="",
                    phase=phase,
                    host=host,
                )
            )
            return

    def _stalled(self, policy: Watchdog, now: float) -> Optional[Tuple[int, float, Allowance]]:
        """The rank that has stood still longest past its allowance, if any (under ``_cond``)."""
        watched = {
            rank: RankProgress(idle_s=now - since, phase=self.phases.get(rank, ""), **self._pace.get(rank, {}))
            for rank, (_, since) in self._progress.items()
            if rank not in self.finished and rank in self.connected
        }
        stalled = []
        for rank, progress in watched.items():
            allowance = policy.allowance(rank, watched)
            if progress.idle_s > allowance.seconds:
                stalled.append((-progress.idle_s, rank, allowance))
        if not stalled:
            return None
        idle, rank, allowance = min(stalled)
        return rank, -idle, allowance

    def watch_hosts(self, timeout_s: float, stop: threading.Event, on_lost: Callable[[str], None]) -> None:
        """Fails the run when a connected rank has not been heard from for ``timeout_s``: its
        heartbeats (every couple of seconds, whatever the rank is doing) stopped arriving, so its
        host, its executor or the network to it is gone. ``on_lost(host)`` runs first, so Spark
        stops counting that host's slots before the relaunch asks for them (``host`` = the
        executor's address as Spark knows it)."""
        while not stop.wait(min(1.0, timeout_s / 10)):
            now = time.monotonic()
            with self._cond:
                if self._cancelled:
                    return
                silent = [
                    (heard, rank)
                    for rank, heard in self._heard.items()
                    if rank in self.connected and rank not in self.finished and now - heard > timeout_s
                ]
                if not silent:
                    continue
                heard, rank = min(silent)
                host, address = self.hosts.get(rank, ""), self.addresses.get(rank, "")
                phase = self.phases.get(rank, "")
                # Its connection will not close before the network heals: nobody waits for it
                # to hang up (wait_disconnected), the surviving ranks are released now.
                self.connected.discard(rank)
                self._cond.notify_all()
            where = f"host {host}" if host else "its host"
            logger.error("rank %d on %s: no word for %.0fs; treating the host as lost", rank, where, now - heard)
            if address:
                self.dropped.add(address)
                try:
                    on_lost(address)
                except Exception:  # noqa: BLE001 - the failure below must be reported regardless
                    logger.exception("could not stop Spark from scheduling on %s", host)
            self._fail(
                RankFailure(
                    rank=rank,
                    exc_type="HostLost",
                    message=(
                        f"no word from rank {rank} on {where} for {now - heard:.0f}s (spark.sparkdl.hostTimeout={timeout_s:g}s): "
                        f"the host, its executor or the network to it is gone. Its executors are no longer counted as slots; "
                        f"with max_failures and min_workers the run relaunches on the hosts that are left. If the network is "
                        f"only slow or briefly partitioned, raise spark.sparkdl.hostTimeout"
                    ),
                    traceback="",
                    phase=phase,
                    host=host,
                )
            )
            return

    def on_disconnect(self, rank: int, clean: bool) -> None:
        with self._cond:
            self.connected.discard(rank)
            self._cond.notify_all()
            reported = any(f.rank == rank for f in self.failures)
            # Once a rank has failed on its own, Spark kills the others: their dropped connections
            # are consequences. Only while every report so far is a peer complaining that it lost
            # someone is a silent disconnect the likelier cause.
            lost = (
                not clean
                and rank not in self.finished
                and not reported
                and not self._cancelled
                and all(_is_peer_loss(f) for f in self.failures)
            )
            phase = self.phases.get(rank, "")
        if lost:
            self._fail(
                RankFailure(
                    rank=rank,
                    exc_type="WorkerLost",
                    message=(
                        "the task's Python process exited without reporting an error (killed by the OS "
                        "or the cluster manager, e.g. out of memory, or it called os._exit); see the "
                        "executor's logs for this rank"
                    ),
                    traceback="",
                    phase=phase,
                )
            )

    #: How long the first failure waits for related ones before the job is cancelled. When a
    #: process dies, its peers often report "connection lost" before the driver sees the dead
    #: one's socket close; waiting a moment lets the dead rank be named as the root cause.
    settle_s = 1.0

    def _fail(self, failure: RankFailure) -> None:
        with self._cond:
            if self._cancelled:
                self.failures.append(failure)
                return
            self.failures.append(failure)
            first = len(self.failures) == 1
            if first:
                self.whereabouts = self._whereabouts(time.monotonic())
            self._cond.notify_all()
        if first:
            threading.Timer(self.settle_s, self.cancel_now).start()

    def cancel_now(self) -> None:
        with self._cond:
            if self._cancelled:
                return
            self._cancelled = True
            self.failures.sort(key=_root_cause_first)
            root = self.failures[0] if self.failures else None  # none when the job died before any rank reported
            self._cond.notify_all()
        if root is not None:
            # Not a warning: the TrainingError raised right after says it all (once).
            logger.info("rank %d failed (%s); cancelling the Spark job", root.rank, root.exc_type)
        self._cancel()

    @property
    def started(self) -> int:
        """How many ranks have started."""
        with self._cond:
            return len(self._progress)

    def _whereabouts(self, now: float) -> List[RankWhereabouts]:
        """Every started, unfinished rank: its host and how long it has been silent (under ``_cond``)."""
        return [
            RankWhereabouts(rank, self.hosts.get(rank, ""), self.addresses.get(rank, ""), now - heard)
            for rank, heard in sorted(self._heard.items())
            if rank not in self.finished and rank in self._progress
        ]

    def forget_silent(self, silent_after_s: float) -> None:
        """Stops waiting for the ranks that had been silent longer than ``silent_after_s`` when
        the attempt failed: their host is gone, their connections will not close."""
        with self._cond:
            for where in self.whereabouts:
                if where.silent_s > silent_after_s:
                    self.connected.discard(where.rank)
            self._cond.notify_all()

    def wait_disconnected(self, timeout: float) -> None:
        """Waits (bounded) until every task has hung up, so late error reports are not lost."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.connected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)


_NONFINITE_AT = re.compile(r"at epoch (\d+), step (\d+)")


def _root_cause_first(failure: RankFailure) -> Tuple[bool, bool, Tuple[int, int]]:
    """Sort key: a rank that vanished without a word first (the likeliest cause of its peers'
    errors), then errors of their own before lost peers, and of NaN losses the earliest step:
    NaN gradients of one rank reach every rank through the sync, and the ranks notice at the
    same periodic check, so the first bad step is the rank that went wrong."""
    match = _NONFINITE_AT.search(failure.message) if failure.exc_type == "NonFiniteLossError" else None
    position = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    return (failure.exc_type not in ("WorkerLost", "HostLost"), _is_peer_loss(failure), position)


def _pace(message: Dict[str, Any]) -> Dict[str, Any]:
    """A heartbeat's step timings, as RankProgress's fields (anything malformed: none)."""
    try:
        part = message.get("step_part")
        return {
            "step_part": part if part in (LOAD, COMPUTE) else None,
            "steps": int(message.get("steps", 0)),
            "slowest_load_s": float(message.get("slowest_load_s", 0.0)),
            "slowest_compute_s": float(message.get("slowest_compute_s", 0.0)),
        }
    except (TypeError, ValueError):
        return {}
