"""What a launch is configured with: :class:`LaunchConfig`, which travels to the tasks in their
payload, and the lost-host timeout every rank's heartbeat is measured against.

Plain data, no Spark: the task side imports it, so it lives here and the driver imports it upward.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Union

from sparkdl._runtime.precision import Precision
from sparkdl._runtime.resize import NO_CHANGE, ResizePlan, check_on_resize
from sparkdl.errors import ConfigError
from sparkdl.resources import Resources, check_resources


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How the barrier stage runs.

    Args:
        num_workers: number of barrier tasks (ranks); each needs one task slot.
        timeout_s: bound on rendezvous and on every collective; a rank stuck longer fails the run.
        slot_wait_s: how long to wait for task slots before failing: for executors to register
            (classic sessions), or for all the barrier stage's tasks to start (Spark Connect,
            where the driver cannot ask the scheduler).
        use_gpu: True to require GPUs, False for CPU, None to use GPUs when Spark gives tasks some
            (see :mod:`sparkdl._runtime.device`).
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (see :mod:`sparkdl._runtime.precision`).
        progress: print (or display in a notebook) per-epoch progress on the driver.
        max_failures: relaunch the stage up to this many times after a failure, resuming from
            the newest checkpoint when there is a checkpoint directory.
        watchdog_timeout_s: fail the run when a rank makes no progress (no batch, no phase
            change) for this long; ``"auto"``: a bound that follows the run's step times
            (:mod:`sparkdl._driver.watchdog`); None disables the watchdog.
        min_workers: a launch (the first one too) that finds fewer free task slots than
            ``num_workers`` within ``slot_wait_s`` runs on as many as are free, down to this many
            (a relaunch resumes the checkpoint on the new number of workers); None means
            ``num_workers``: no shrinking.
        on_resize: what a run on fewer workers than ``num_workers`` does to the optimization:
            ``"keep_global_batch"``, ``"scale_lr"`` or ``"none"`` (:mod:`sparkdl._runtime.resize`);
            None here until :meth:`RunSettings.from_arguments` sets the strategy's default.
        planned_workers: ``num_workers`` as asked (set from it; an attempt on fewer keeps it).
        resources: the training stage's own task resources (a Spark resource profile for the
            barrier stage only, see :class:`sparkdl.Resources`); None runs it with the
            application's ``spark.task.*`` defaults.
    """

    num_workers: int
    timeout_s: float = 600.0
    slot_wait_s: float = 30.0
    use_gpu: Optional[bool] = None
    progress: bool = True
    precision: str = "32"
    max_failures: int = 0
    watchdog_timeout_s: Union[float, str, None] = 600.0
    min_workers: Optional[int] = None
    on_resize: Optional[str] = None
    planned_workers: Optional[int] = None
    resources: Optional[Resources] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "resources", check_resources(self.resources))
        if not isinstance(self.num_workers, int) or isinstance(self.num_workers, bool) or self.num_workers < 1:
            raise ConfigError(f"num_workers={self.num_workers!r} must be a positive integer")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be > 0 seconds")
        if self.use_gpu is not None and not isinstance(self.use_gpu, bool):
            raise ConfigError(
                f"use_gpu={self.use_gpu!r} must be True, False or None (use GPUs when Spark assigns them)"
            )
        object.__setattr__(self, "precision", Precision(self.precision).value)  # normalized: 32 -> "32"
        if not isinstance(self.slot_wait_s, (int, float)) or isinstance(self.slot_wait_s, bool) or self.slot_wait_s < 0:
            raise ConfigError(f"slot_wait_s={self.slot_wait_s!r} must be >= 0 seconds")
        if not isinstance(self.max_failures, int) or isinstance(self.max_failures, bool) or self.max_failures < 0:
            raise ConfigError(f"max_failures={self.max_failures!r} must be an integer >= 0")
        check_watchdog_timeout(self.watchdog_timeout_s)
        if self.min_workers is not None and (
            not isinstance(self.min_workers, int)
            or isinstance(self.min_workers, bool)
            or not 1 <= self.min_workers <= self.num_workers
        ):
            raise ConfigError(
                f"min_workers={self.min_workers!r} must be an integer with 1 <= min_workers <= num_workers={self.num_workers}, "
                f"or None (= num_workers: never train on fewer)"
            )
        check_on_resize(self.on_resize)
        if self.planned_workers is None:  # dataclasses.replace(config, num_workers=M) keeps it
            object.__setattr__(self, "planned_workers", self.num_workers)

    def resize_plan(self, batch_size: Optional[int]) -> ResizePlan:
        """This attempt's accumulation and learning-rate arithmetic (its ``num_workers`` against
        the planned ones)."""
        return ResizePlan(self.on_resize or NO_CHANGE, self.planned_workers, self.num_workers, batch_size)

    @property
    def task_cpus(self) -> Optional[float]:
        """The training stage's CPUs per task when ``resources`` sets them, else None
        (``spark.task.cpus``)."""
        return None if self.resources is None else self.resources.cpus

    @property
    def heartbeat_interval_s(self) -> float:
        """Often enough that the watchdog sees a stall within a fifth of its timeout; every
        second under "auto", whose bound for a fast run's steps is a few seconds."""
        if self.watchdog_timeout_s == AUTO_WATCHDOG:
            return 1.0
        return min(2.0, self.watchdog_timeout_s / 5) if self.watchdog_timeout_s else 2.0


#: Whether a training task's CPU flushes subnormal floats to zero (below).
FLUSH_DENORMALS_CONF = "spark.sparkdl.flushDenormals"


def flush_denormals(value: Optional[str]) -> bool:
    """``spark.sparkdl.flushDenormals`` (default true): a task's CPU treats subnormal floats
    (below 1.2e-38 in float32) as zero, ``torch.set_flush_denormal(True)``. x86 CPUs compute on
    subnormals in microcode, tens of times slower: a model whose loss reaches 0 (its gradients,
    and Adam's squared averages of them, underflow to subnormals) trained 4.5x slower per step on
    the namespace cluster (DiLoCo on an easy dataset, docs/performance.md). GPUs are unaffected.
    ``false`` keeps IEEE subnormals, for code that needs them."""
    if value is None or str(value).strip() == "":
        return True
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f"{FLUSH_DENORMALS_CONF}={value!r} must be true (the default) or false")
    return text == "true"


#: The ``watchdog_timeout_s`` value whose bound follows the run's step times
#: (``sparkdl._driver.watchdog.AutoWatchdog``).
AUTO_WATCHDOG = "auto"


def check_watchdog_timeout(value: object) -> None:
    """Raises ConfigError unless ``value`` is seconds > 0, ``"auto"`` or None."""
    if value is None or value == AUTO_WATCHDOG:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"watchdog_timeout_s={value!r} must be > 0 seconds, 'auto' (a bound that follows the run's step "
            f"times) or None to disable it"
        )


#: How long a rank may go unheard (no heartbeat, no message) before its host counts as lost.
HOST_TIMEOUT_CONF = "spark.sparkdl.hostTimeout"
DEFAULT_HOST_TIMEOUT_S = 45.0


def host_timeout_s(value: Optional[str], heartbeat_interval_s: float) -> Optional[float]:
    """``spark.sparkdl.hostTimeout`` in seconds: ``45s``, ``45``, ``2min``; ``0`` or ``off``
    disables the check (a lost host then waits for the watchdog or Spark's own timeouts)."""
    if value is None or str(value).strip() == "":
        return DEFAULT_HOST_TIMEOUT_S
    text = str(value).strip().lower()
    if text in ("0", "off", "false", "none"):
        return None
    units = {"ms": 0.001, "s": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|min|m|h)?", text)
    seconds = float(match.group(1)) * units[match.group(2) or "s"] if match else None
    # Three heartbeats must fit in it: one late heartbeat is no lost host.
    if seconds is None or seconds < 3 * heartbeat_interval_s:
        raise ConfigError(
            f"{HOST_TIMEOUT_CONF}={value!r} must be a duration of at least {3 * heartbeat_interval_s:g}s (three heartbeats), "
            f"such as 45s or 2min, or 0 to turn the check off"
        )
    return seconds
