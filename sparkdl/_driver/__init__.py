"""The driver side of a launch: runs a training function on N Spark barrier tasks and brings
back rank 0's result.

One concern per module:

* :mod:`.settings` — every setting of a run, validated once; :mod:`.prepare_data` — the data a
  run reads, checked and described before launch; :mod:`.preflight` — what would fail the same
  way on every rank, found on the driver; :mod:`.session_checks` — what the session's own
  settings rule out (dynamic allocation, encryption), refused before any data is touched.
* :mod:`.cluster` — what the driver asks Spark's scheduler: free task slots (:func:`check_slots`,
  the relaunch's bounded wait for slots other jobs hold) and its task-failure logging.
* :mod:`.resource_profile` — the training stage's own Spark resource profile from
  ``resources=`` (:class:`~sparkdl.resources.Resources`), refused before launch where the cluster
  cannot honour it; :mod:`.host_watch` — Spark's decommissioning passed on to the ranks, a silent
  host's executors dropped.
* :mod:`.controller` — the attempt loop as explicit states (scheduling, running, restarting,
  draining, finished, failed) over an :class:`~sparkdl._driver.controller.AttemptStage`; every
  transition is decided by :mod:`.policy`: whether a failed attempt is relaunched
  (:class:`FailurePolicy`), on how many workers an attempt runs
  (:class:`~sparkdl._driver.policy.ScalingPolicy`, and after tasks that did not all start),
  which hosts are gone, whether a drain is free — decisions, no Spark.
* :mod:`.stage` — :func:`launch`: the session's checks, the checkpoint directory, the controller
  over the cluster (:class:`LaunchOutcome` is what it returns); :mod:`.attempt` — one attempt:
  open the progress channel and the rendezvous store, run the barrier stage, turn what went
  wrong into one :class:`~sparkdl.errors.TrainingError` and where each rank was.
* :mod:`.monitor` — :class:`JobMonitor`, the state of a running job (the channel's messages and
  disconnects, the watchdog, the slot watch, when to cancel); :mod:`.watchdog` — how long a rank
  may stand still (a fixed bound, or ``"auto"``: the run's own pace). No Spark: unit-tested alone.
* :mod:`.progress` — the live progress line or notebook widget; :mod:`.warmup` — executors that
  import torch before the first launch needs them.

What a task runs is in :mod:`sparkdl._task`; the tasks never import this package.
"""

from typing import TYPE_CHECKING

from sparkdl._lazy import lazy_attributes

# Imported on first use: ``import sparkdl`` must stay cheap (pyspark.sql, pandas); sparkdl._lazy says why.
_NAMES = {
    "Decision": "sparkdl._driver.policy",
    "FailurePolicy": "sparkdl._driver.policy",
    "LaunchConfig": "sparkdl._task.config",
    "LaunchOutcome": "sparkdl._driver.stage",
    "JobMonitor": "sparkdl._driver.monitor",
    "_expected_executors": "sparkdl._driver.cluster",
    "_failure_from_spark": "sparkdl._driver.attempt",
    "check_slots": "sparkdl._driver.cluster",
    "launch": "sparkdl._driver.stage",
}
__getattr__, __dir__ = lazy_attributes(__name__, _NAMES)
__all__ = sorted(_NAMES)

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl._driver.attempt import _failure_from_spark
    from sparkdl._driver.cluster import _expected_executors, check_slots
    from sparkdl._driver.monitor import JobMonitor
    from sparkdl._driver.policy import Decision, FailurePolicy
    from sparkdl._driver.stage import LaunchOutcome, launch
    from sparkdl._task.config import LaunchConfig
