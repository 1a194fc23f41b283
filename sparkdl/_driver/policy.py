"""The driver's decisions about attempts, as policy objects: whether a failed attempt is
relaunched (:class:`FailurePolicy`) and on how many workers an attempt runs (:class:`ScalingPolicy`).

Pure functions of what happened, no Spark: :mod:`sparkdl._driver.stage` asks Spark for the facts
(the error, the free task slots) and does what these return.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Tuple

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
