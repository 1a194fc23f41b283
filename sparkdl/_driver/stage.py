"""Driver side of a launch: the session's checks, the checkpoint directory, and the
:class:`~sparkdl._driver.controller.Controller` that runs attempts over :class:`_SparkStage` —
the cluster's slots, one barrier stage per attempt (:mod:`sparkdl._driver.attempt`), Spark's
executors per host.

A failed attempt is raised as one :class:`~sparkdl.errors.TrainingError`, unless the
controller's policies relaunch it (from the newest checkpoint, on the hosts that are left).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from sparkdl._driver import attempt as attempt_module
from sparkdl._driver.cluster import check_slots, relaunch_workers, wait_for_free_slots
from sparkdl._driver.controller import AttemptOutcome, Controller
from sparkdl._driver.host_watch import hosts_with_executors, stop_using_host
from sparkdl._driver.policy import (
    DrainPolicy,
    FailurePolicy,
    LostHost,
    LostHostPolicy,
    ScalingPolicy,
    StartShortfallPolicy,
)
from sparkdl._driver.progress import ProgressDisplay
from sparkdl._driver.resource_profile import StageProfile, stage_profile
from sparkdl._driver.session_checks import check_dynamic_allocation
from sparkdl._net.policy import security_policy
from sparkdl._runtime.device import check_gpu_request
from sparkdl._spark import Session
from sparkdl._task.config import (
    FLUSH_DENORMALS_CONF,
    HOST_TIMEOUT_CONF,
    LaunchConfig,
    flush_denormals,
    host_timeout_s,
)
from sparkdl.checkpoint import CheckpointConfig, FileCheckpointStore, open_store
from sparkdl.data.batching import DataSpec
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.readers.base import DataReader
from sparkdl.errors import ConfigError, TrainingError, raised_from
from sparkdl.filesystem import check_writable
from sparkdl.strategies.base import Strategy

logger = logging.getLogger("sparkdl")


@dataclasses.dataclass
class LaunchOutcome:
    """Rank 0's return value plus how the run got there."""

    value: Any
    attempts: List[Dict[str, Any]]
    from_finished_checkpoint: bool = False
    #: The workers each attempt ran on (fewer than ``num_workers`` after a shrinking relaunch).
    workers: List[int] = dataclasses.field(default_factory=list)
    #: The training stage's resources (``resources=``) and the resource profile ids Spark's status
    #: store recorded for the stages of the last attempt; empty over Spark Connect.
    resources: Dict[str, Any] = dataclasses.field(default_factory=dict)


def launch(
    train_fn: Callable[[Any], Any],
    config: LaunchConfig,
    strategy: Strategy,
    spark: Any = None,
    dataset: Optional[DatasetInfo] = None,
    data_spec: Optional[DataSpec] = None,
    reader: Optional[DataReader] = None,
    steps_per_epoch: Optional[int] = None,
    display: Optional[ProgressDisplay] = None,
    checkpoint: Optional[CheckpointConfig] = None,
    steps_for: Optional[Callable[[int], int]] = None,
) -> LaunchOutcome:
    """Runs ``train_fn(ctx)`` on ``config.num_workers`` barrier tasks; returns rank 0's value.

    The session's settings are checked first; then :class:`~sparkdl._driver.controller.Controller`
    runs attempts (a failed one is relaunched up to ``config.max_failures`` times, see its
    policies); with a checkpoint directory each attempt resumes from the newest checkpoint, and a
    directory that holds a finished run returns its stored result at once. With
    ``config.min_workers`` an attempt that finds fewer free slots runs on fewer workers
    (``steps_for(workers)`` gives their steps per epoch) and resumes the checkpoint elastically.
    """
    session = _session(spark)
    profile, security = _checked_session(session, config)
    checkpoints = open_store(checkpoint) if checkpoint else None
    finished = _finished_run(checkpoints, checkpoint)
    if finished is not None:
        return finished
    attempt_stage = _SparkStage(
        session=session,
        train_fn=train_fn,
        config=config,
        strategy=strategy,
        display=display or ProgressDisplay(enabled=config.progress),
        profile=profile,
        steps_per_epoch=steps_per_epoch,
        steps_for=steps_for,
        lost_host_after_s=host_timeout_s(session.conf(HOST_TIMEOUT_CONF), config.heartbeat_interval_s),
        payload_fields=dict(
            dataset=dataset,
            data_spec=data_spec,
            reader=reader,
            checkpoint_store=checkpoints,
            encrypt=security.encrypt,
            flush_denormals=flush_denormals(session.conf(FLUSH_DENORMALS_CONF)),
        ),
    )
    controller = _controller(attempt_stage, config, session, has_checkpoints=checkpoints is not None)
    try:
        value = controller.run()
    except TrainingError as error:
        raise raised_from(error) from None
    if checkpoints is not None:
        checkpoints.save_finished(value)
    resources = {} if profile is None else {**profile.run_info(), "stage_resource_profile_ids": controller.profile_ids}
    return LaunchOutcome(value, controller.attempts, workers=controller.workers, resources=resources)


def _session(spark: Any) -> Session:
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise ConfigError("no active SparkSession: create one (SparkSession.builder...getOrCreate()) or pass spark=")
    return Session(spark)


def _checked_session(session: Session, config: LaunchConfig) -> Tuple[Optional[StageProfile], Any]:
    """What the session's settings rule out, refused before anything launches; the training
    stage's resource profile and the security policy (encryption) the run follows."""
    # The entry points checked it before their data; sparkdl.run without data had none to check.
    check_dynamic_allocation(session.conf, lambda: session.master)
    profile = stage_profile(session, config.resources)  # refused now when the cluster cannot honour it
    check_gpu_request(session.conf, config.use_gpu, None if profile is None else profile.task_gpus)
    if session.connect and config.min_workers is not None and config.min_workers < config.num_workers:
        logger.warning(
            "min_workers=%d has no effect over Spark Connect: the client cannot count free task slots, so every relaunch "
            "asks for num_workers=%d (docs/recovery.md)",
            config.min_workers,
            config.num_workers,
        )
    return profile, security_policy(session.conf)  # refuses unencrypted collectives under Spark encryption


def _finished_run(checkpoints: Any, checkpoint: Optional[CheckpointConfig]) -> Optional[LaunchOutcome]:
    """Prepares the checkpoint directory: checked writable, cleared for ``resume=False``; the
    stored result when it holds a finished run (nothing is launched then)."""
    if checkpoints is None or checkpoint is None:
        return None
    if isinstance(checkpoints, FileCheckpointStore):  # a registered checkpoints of its own scheme checks itself
        check_writable(checkpoints.url, "checkpoint_dir")  # before an epoch is spent, not at the first checkpoint
    if not checkpoint.resume:
        checkpoints.clear()
        return None
    finished, result = checkpoints.load_finished()
    if not finished:
        return None
    logger.warning(
        "%s holds a finished run: returning its result without training (resume=False trains again)", checkpoints.url
    )
    return LaunchOutcome(result, [], from_finished_checkpoint=True)


def _controller(
    attempt_stage: "_SparkStage", config: LaunchConfig, session: Session, has_checkpoints: bool
) -> Controller:
    """The attempt loop with the run's policies."""
    # Over Spark Connect the client cannot count slots: every attempt asks for num_workers.
    min_workers = None if session.connect else config.min_workers
    return Controller(
        stage=attempt_stage,
        num_workers=config.num_workers,
        failures=FailurePolicy(config.max_failures),
        scaling=ScalingPolicy(config.num_workers, config.min_workers, config.slot_wait_s, config.on_resize),
        shortfall=StartShortfallPolicy(min_workers),
        lost_hosts=LostHostPolicy(silent_after_s=attempt_module.silent_after_s(config)),
        drains=DrainPolicy(_MAX_DRAINS),
        say=lambda message: _say(config, message),
        has_checkpoints=has_checkpoints,
    )


@dataclasses.dataclass
class _SparkStage:
    """The controller's :class:`~sparkdl._driver.controller.AttemptStage` on a real cluster: the
    scheduler's free slots, one barrier stage per attempt, Spark's executors per host."""

    session: Session
    train_fn: Callable[[Any], Any]
    config: LaunchConfig
    strategy: Strategy
    display: ProgressDisplay
    profile: Optional[StageProfile]
    steps_per_epoch: Optional[int]
    steps_for: Optional[Callable[[int], int]]
    lost_host_after_s: Optional[float]
    payload_fields: Dict[str, Any]

    def free_workers(self, attempt: int, wanted: int, enough: int) -> int:
        if self.session.connect:
            return wanted
        sc, config = self.session.spark.sparkContext, self.config
        if config.min_workers is None:
            check_slots(sc, wanted, config.slot_wait_s, self.profile)
            if attempt > 1:  # another job may hold a slot the failed attempt freed: wait for it, bounded
                say = lambda m: _say(config, m)  # noqa: E731
                wait_for_free_slots(sc, wanted, config.slot_wait_s, say, attempt, self.profile)
            return wanted
        return relaunch_workers(sc, wanted, config.min_workers, config.slot_wait_s, attempt, self.profile, enough)

    def run(self, attempt: int, num_workers: int) -> AttemptOutcome:
        config, steps = self.config, self.steps_per_epoch
        if num_workers != config.num_workers:
            config = dataclasses.replace(config, num_workers=num_workers)
            if self.steps_for is not None and steps is not None:
                steps = self.steps_for(num_workers)
        return attempt_module.run_attempt(
            self.session,
            self.train_fn,
            config,
            self.strategy,
            self.display,
            self.profile,
            lost_host_after_s=self.lost_host_after_s,
            steps_per_epoch=steps,
            attempt=attempt,
            **self.payload_fields,
        )

    def still_listed(self, addresses: Sequence[str]) -> Optional[Set[str]]:
        return None if self.session.connect else hosts_with_executors(self.session, addresses)

    def drop(self, hosts: Sequence[LostHost]) -> None:
        for host in hosts:
            stop_using_host(self.session, host.address)


#: Drains relaunched in one run before a drain counts as a failure (a cluster that keeps
#: decommissioning the run's hosts).
_MAX_DRAINS = 10


def _say(config: LaunchConfig, message: str) -> None:
    # Once: on the progress display when there is one, else in the log (a logger with no
    # handler prints warnings to stderr too, which printed it twice).
    if config.progress:
        print(message, flush=True)
    else:
        logger.warning(message)
