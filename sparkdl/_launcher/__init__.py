"""Runs a training function on N Spark barrier tasks and brings back rank 0's result.

Layout, one concern per module:

* :mod:`~sparkdl._launcher.config` — :class:`LaunchConfig` (how the stage runs),
  :class:`FailurePolicy` and :class:`Decision` (whether a failed attempt is relaunched),
  :class:`LaunchOutcome` (what :func:`launch` returns). Plain data.
* :mod:`~sparkdl._launcher.cluster` — what the driver asks Spark's scheduler: free task slots
  (:func:`check_slots`, the relaunch's bounded wait for slots other jobs hold) and its
  task-failure logging, quiet while a stage runs.
* :mod:`~sparkdl._launcher.driver` — :func:`launch` and one attempt of it: check slots, open
  the progress channel, run the barrier stage, turn what went wrong
  into one :class:`~sparkdl.errors.TrainingError` (:func:`_failure_from_spark` when the job died
  before any rank reported).
* :mod:`~sparkdl._launcher.monitor` — :class:`~sparkdl._launcher.monitor.JobMonitor`, the
  driver-side state of a running job (the channel's messages and disconnects, the watchdog, the
  slot watch, when to cancel and which failure is the root cause). No Spark: unit-tested alone.
* :mod:`~sparkdl._launcher.task` — what each barrier task runs (``_task_main``): channel, rank
  prefixed output, threads, device, rendezvous, the user's function, the report. The stage's
  pickled closure refers to it, so the executors import it; it imports nothing of the driver
  side itself, and this ``__init__`` imports the rest only when asked for it.
* :mod:`~sparkdl._launcher.environment` — the variables ``torchrun`` sets, for a launched script.
* :mod:`~sparkdl._launcher.script` — a launch's child process, on the task's side (start, output,
  exit status, no orphan); :mod:`~sparkdl._launcher.runner` — the child's side (the ``env://``
  handler that joins sparkdl's store, then the user's script or function).

This package re-exports the names the rest of sparkdl and the tests use.
"""

from typing import TYPE_CHECKING

from sparkdl._lazy import lazy_attributes

# Imported on first use: a task imports ``task`` through this package and must not pay for the
# driver side (pyspark.sql, pandas); sparkdl._lazy says why.
_NAMES = {
    "Decision": "sparkdl._launcher.config",
    "FailurePolicy": "sparkdl._launcher.config",
    "LaunchConfig": "sparkdl._launcher.config",
    "LaunchOutcome": "sparkdl._launcher.config",
    "JobMonitor": "sparkdl._launcher.monitor",
    "_expected_executors": "sparkdl._launcher.cluster",
    "_failure_from_spark": "sparkdl._launcher.driver",
    "check_slots": "sparkdl._launcher.cluster",
    "launch": "sparkdl._launcher.driver",
}
__getattr__, __dir__ = lazy_attributes(__name__, _NAMES)
__all__ = sorted(_NAMES)

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl._launcher.config import Decision, FailurePolicy, LaunchConfig, LaunchOutcome
    from sparkdl._launcher.cluster import _expected_executors, check_slots
    from sparkdl._launcher.driver import _failure_from_spark, launch
    from sparkdl._launcher.monitor import JobMonitor
