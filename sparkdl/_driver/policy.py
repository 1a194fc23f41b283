"""The driver's decisions about attempts, as policy objects: whether a failed attempt is
relaunched (:class:`FailurePolicy`), on how many workers an attempt runs (:class:`ScalingPolicy`,
and :class:`StartShortfallPolicy` when its tasks did not all start), which hosts are gone
(:class:`LostHostPolicy`) and whether a drain relaunches for free (:class:`DrainPolicy`).

Pure functions of what happened, no Spark: :mod:`sparkdl._driver.stage` asks Spark for the facts
(the error, the free task slots) and does what these return.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, List, Optional, Sequence, Set, Tuple

from sparkdl.errors import RankFailure, TrainingError, category


class Decision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """Whether a failed attempt is relaunched.

    Failures that would only repeat — bad settings or data (a ``ConfigError`` or ``DataError``
    of any subclass), a NaN loss, code the executors cannot import — are raised at once, and so is an attempt that failed the same way as the one
    before it (the same rank, error and phase, which names the step): it would fail again.
    Anything else (a lost executor, a killed process, a hang, a network error, an exception in
    user code) is retried up to ``max_failures`` times.
    """

    max_failures: int = 0
    deterministic: Tuple[str, ...] = ("ConfigError", "DataError", "NonFiniteLossError", "InsufficientSlotsError")

    def decide(self, error: TrainingError, failures_so_far: int, previous: Optional[TrainingError] = None) -> Decision:
        if failures_so_far > self.max_failures:
            return Decision.RAISE
        first = error.failures[0] if error.failures else None
        if first is not None and (
            first.exc_type in self.deterministic
            or category(first) in self.deterministic
            or "No module named" in first.message
        ):
            return Decision.RAISE
        if (
            first is not None
            and previous is not None
            and previous.failures
            and same_failure(first, previous.failures[0])
        ):
            return Decision.RAISE
        return Decision.RETRY


def same_failure(one: RankFailure, other: RankFailure) -> bool:
    """Two attempts failed the same way: the same rank, error and phase (which names the step)."""
    return (one.rank, one.exc_type, one.message, one.phase) == (other.rank, other.exc_type, other.message, other.phase)


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How many workers an attempt runs on, and the line that tells the user why (None: as asked)."""

    num_workers: int
    message: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ScalingPolicy:
    """On how many workers an attempt runs, from the task slots free when it starts.

    ``num_workers`` when they are free; with ``min_workers`` set, as many as are free down to
    ``min_workers`` (the first launch too: a cluster that lost a host before the fit started is
    the same cluster as one that lost it during the fit). The message says what happens to the
    global batch: ``batch_size`` stays per worker, so it shrinks unless ``on_resize`` is
    ``"keep_global_batch"`` (each worker then accumulates gradients, :mod:`sparkdl._runtime.resize`).
    """

    num_workers: int
    min_workers: Optional[int] = None
    slot_wait_s: float = 30.0
    on_resize: Optional[str] = None

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None

    def decide(self, free: int, attempt: int, has_checkpoints: bool) -> Scaling:
        if free >= self.num_workers or not self.elastic:
            return Scaling(self.num_workers)
        if self.on_resize == "keep_global_batch":
            batch = "on_resize=keep_global_batch: each worker accumulates gradients, the global batch stays as planned"
        elif self.on_resize == "scale_lr":
            batch = "batch_size is per worker: the global batch shrinks; on_resize=scale_lr scales the learning rate with it"
        else:
            batch = "batch_size is per worker: the global batch shrinks"
        if attempt == 1:
            how = f"starting there ({batch})"
        elif has_checkpoints:
            how = f"resuming the newest checkpoint on that many ({batch})"
        else:
            how = "from scratch (no checkpoint_dir)"
        return Scaling(
            free,
            (
                f"[sparkdl] attempt {attempt}: only {free} free task slot(s) for num_workers={self.num_workers} "
                f"within slot_wait_s={self.slot_wait_s:g}s (min_workers={self.min_workers}): continuing on {free} worker(s), {how}"
            ),
        )


@dataclasses.dataclass(frozen=True)
class RankWhereabouts:
    """Where a rank of a failed attempt ran, and how long the driver had not heard from it
    (any message: heartbeats come every couple of seconds whatever the rank does) when the
    attempt's first failure arrived."""

    rank: int
    host: str  # the host name the rank reported
    address: str  # its executor's address as Spark knows it
    silent_s: float


@dataclasses.dataclass(frozen=True)
class LostHost:
    """A host the driver stops using: its executors are dropped before the relaunch counts slots."""

    address: str
    host: str
    ranks: Tuple[int, ...]
    why: str


@dataclasses.dataclass(frozen=True)
class LostHostPolicy:
    """Which hosts of a failed attempt are gone, whatever ended the attempt (the watchdog, a
    collective's timeout, ``spark.sparkdl.hostTimeout``, a rank's error).

    A host is lost when every rank on it had been silent for more than ``silent_after_s`` when
    the attempt failed (three heartbeats: one late heartbeat is no lost host) while some rank
    elsewhere was heard within it, or when Spark no longer lists an executor there. When every
    rank was silent, the silence is the driver's own (its network, a pause): no host is blamed.
    A rank that is alive but hung keeps sending heartbeats: the watchdog names it, and its host
    stays.
    """

    silent_after_s: float

    def decide(self, ranks: Sequence[RankWhereabouts], spark_lists: Optional[Set[str]] = None) -> List[LostHost]:
        """``spark_lists``: the addresses where Spark still lists a live executor (None: unknown)."""
        by_address: Dict[str, List[RankWhereabouts]] = {}
        for where in ranks:
            if where.address:
                by_address.setdefault(where.address, []).append(where)
        heard = [w for w in ranks if w.silent_s <= self.silent_after_s]
        lost = []
        for address, there in sorted(by_address.items()):
            names = tuple(sorted(w.rank for w in there))
            host = there[0].host or address
            silent = min(w.silent_s for w in there)
            if spark_lists is not None and address not in spark_lists:
                lost.append(LostHost(address, host, names, "Spark lists no live executor there"))
            elif heard and silent > self.silent_after_s:
                lost.append(
                    LostHost(
                        address,
                        host,
                        names,
                        f"no word from rank(s) {list(names)} for {silent:.0f}s when the attempt failed",
                    )
                )
        return lost


@dataclasses.dataclass(frozen=True)
class StartShortfallPolicy:
    """On how many workers to relaunch when an attempt's barrier tasks did not all start within
    their bound (a slot Spark counted was gone): the tasks that did start, or one fewer than
    asked when none did, down to ``min_workers``; None when that is below ``min_workers`` (or
    without ``min_workers``): the shortfall is raised."""

    min_workers: Optional[int] = None

    def workers_after(self, asked: int, started: int) -> Optional[int]:
        if self.min_workers is None:
            return None
        workers = started if 0 < started < asked else asked - 1
        return workers if workers >= self.min_workers else None


@dataclasses.dataclass(frozen=True)
class DrainPolicy:
    """Drains (a host Spark decommissions) relaunch from their checkpoint without counting as
    failures, up to ``max_drains`` in a run (a cluster that keeps decommissioning the run's
    hosts); past that a drain counts as a failure."""

    max_drains: int = 10

    def relaunch_free(self, error: TrainingError, drains_so_far: int) -> bool:
        drained = bool(error.failures) and all(f.exc_type == "HostDrained" for f in error.failures)
        return drained and drains_so_far < self.max_drains
