"""Driver side of a launch: check slots, open the progress channel, run one barrier stage, watch it.

The first failure that reaches the driver (an error a rank reported, a rank whose process
vanished, or a rank the watchdog found stuck) cancels the Spark job at once — Spark would
otherwise wait for the remaining tasks — and is raised as one
:class:`~sparkdl.errors.TrainingError`, unless the :class:`~sparkdl._driver.policy.FailurePolicy`
relaunches the stage (which then resumes from the newest checkpoint).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import cloudpickle

from sparkdl._driver.cluster import check_slots, quiet_task_failure_logs, relaunch_workers, wait_for_free_slots
from sparkdl._driver.host_watch import stop_using_host, watch_decommissioning
from sparkdl._driver.monitor import JobMonitor
from sparkdl._driver.policy import Decision, FailurePolicy, ScalingPolicy, same_failure
from sparkdl._driver.progress import ProgressDisplay
from sparkdl._driver.resource_profile import StageProfile, stage_profile, stage_profile_ids
from sparkdl._driver.session_checks import check_dynamic_allocation
from sparkdl._driver.watchdog import watchdog_policy
from sparkdl._net.channel import ChannelServer, new_secret
from sparkdl._net.policy import security_policy
from sparkdl._net.rendezvous_store import StoreServer
from sparkdl._runtime.device import check_gpu_request
from sparkdl._spark import Session
from sparkdl._task.config import (
    FLUSH_DENORMALS_CONF,
    HOST_TIMEOUT_CONF,
    LaunchConfig,
    flush_denormals,
    host_timeout_s,
)
from sparkdl._task.entry import _task_main, _TaskPayload
from sparkdl.checkpoint import CheckpointConfig, FileCheckpointStore, open_store
from sparkdl.data.batching import DataSpec
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.readers.base import DataReader
from sparkdl.errors import ConfigError, RankFailure, TrainingError, raised_from
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

    A failed attempt is relaunched (up to ``config.max_failures`` times, see
    :class:`FailurePolicy`); with a checkpoint directory each attempt resumes from the newest
    checkpoint, and a directory that holds a finished run returns its stored result at once.
    With ``config.min_workers`` a relaunch that finds fewer free slots runs on fewer workers
    (``steps_for(workers)`` gives their steps per epoch) and resumes the checkpoint elastically.
    """
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise ConfigError("no active SparkSession: create one (SparkSession.builder...getOrCreate()) or pass spark=")
    session = Session(spark)
    # The entry points checked it before their data; sparkdl.run without data had none to check.
    check_dynamic_allocation(session.conf, lambda: session.master)
    stage = stage_profile(session, config.resources)  # refused now when the cluster cannot honour it
    check_gpu_request(
        session.conf, config.use_gpu, None if stage is None else stage.task_gpus
    )  # not after executors start
    security = security_policy(session.conf)  # refuses unencrypted collectives under Spark encryption
    lost_host_after_s = host_timeout_s(session.conf(HOST_TIMEOUT_CONF), config.heartbeat_interval_s)
    flush = flush_denormals(session.conf(FLUSH_DENORMALS_CONF))
    display = display or ProgressDisplay(enabled=config.progress)
    checkpoints = open_store(checkpoint) if checkpoint else None
    if isinstance(checkpoints, FileCheckpointStore):  # a registered checkpoints of its own scheme checks itself
        check_writable(checkpoints.url, "checkpoint_dir")  # before an epoch is spent, not at the first checkpoint
    if checkpoints is not None:
        if not checkpoint.resume:
            checkpoints.clear()
        else:
            finished, result = checkpoints.load_finished()
            if finished:
                logger.warning(
                    "%s holds a finished run: returning its result without training (resume=False trains again)",
                    checkpoints.url,
                )
                return LaunchOutcome(result, [], from_finished_checkpoint=True)
    if session.connect and config.min_workers is not None and config.min_workers < config.num_workers:
        logger.warning(
            "min_workers=%d has no effect over Spark Connect: the client cannot count free task slots, so every relaunch "
            "asks for num_workers=%d (docs/recovery.md)",
            config.min_workers,
            config.num_workers,
        )
    policy = FailurePolicy(config.max_failures)
    scaler = ScalingPolicy(config.num_workers, config.min_workers, config.slot_wait_s, config.on_resize)
    drains = 0  # attempts that ended in a drain: relaunched without counting as failures
    attempts: List[Dict[str, Any]] = []
    previous: Optional[TrainingError] = None
    workers: List[int] = []
    for attempt in itertools.count(1):
        attempt_config, steps = config, steps_per_epoch
        if not session.connect:
            if config.min_workers is None:
                check_slots(spark.sparkContext, config.num_workers, config.slot_wait_s, stage)
                if attempt > 1:  # another job may hold a slot the failed attempt freed: wait for it, bounded
                    wait_for_free_slots(
                        spark.sparkContext,
                        config.num_workers,
                        config.slot_wait_s,
                        lambda m: _say(config, m),
                        attempt,
                        stage,
                    )
            else:
                free = relaunch_workers(
                    spark.sparkContext, config.num_workers, config.min_workers, config.slot_wait_s, attempt, stage
                )
                scaling = scaler.decide(free, attempt, has_checkpoints=checkpoints is not None)
                if scaling.num_workers != config.num_workers:
                    attempt_config = dataclasses.replace(config, num_workers=scaling.num_workers)
                    steps = (
                        steps_for(scaling.num_workers)
                        if steps_for is not None and steps_per_epoch is not None
                        else steps_per_epoch
                    )
                if scaling.message:
                    _say(config, scaling.message)
        workers.append(attempt_config.num_workers)
        started = time.time()
        try:
            value, profile_ids = _launch_once(
                session,
                train_fn,
                attempt_config,
                strategy,
                display,
                stage,
                dataset=dataset,
                data_spec=data_spec,
                reader=reader,
                steps_per_epoch=steps,
                checkpoint_store=checkpoints,
                attempt=attempt,
                encrypt=security.encrypt,
                flush_denormals=flush,
                lost_host_after_s=lost_host_after_s,
            )
        except _AttemptFailed as failed:
            error = failed.error
            drained = bool(error.failures) and all(f.exc_type == "HostDrained" for f in error.failures)
            attempts.append(
                {
                    "attempt": attempt,
                    "seconds": time.time() - started,
                    "error": str(error).splitlines()[0],
                    **({"drained": True} if drained else {}),
                }
            )
            if drained and drains < _MAX_DRAINS:
                drains += 1
                _say(
                    config,
                    f"[sparkdl] attempt {attempt} drained: {error.failures[0].message}; relaunching from that checkpoint",
                )
                continue
            decision = policy.decide(error, attempt - drains, previous)
            if decision is Decision.RAISE:
                if attempt > 1:
                    repeated = ""
                    if previous is not None and same_failure(error.failures[0], previous.failures[0]):
                        repeated = f"; the same failure as attempt {attempt - 1}, so not retried again"
                    raise raised_from(
                        TrainingError(
                            error.failures, hint=f"(attempt {attempt}; max_failures={config.max_failures}{repeated})"
                        )
                    ) from None
                raise raised_from(error) from None
            previous = error
            where = "the newest checkpoint" if checkpoints is not None else "scratch (no checkpoint_dir)"
            message = f"[sparkdl] attempt {attempt} failed: {str(error).splitlines()[0]}; relaunching from {where} ({attempt}/{config.max_failures} retries)"
            _say(config, message)
            continue
        attempts.append({"attempt": attempt, "seconds": time.time() - started, "error": None})
        break
    if checkpoints is not None:
        checkpoints.save_finished(value)
    resources = {} if stage is None else {**stage.run_info(), "stage_resource_profile_ids": profile_ids}
    return LaunchOutcome(value, attempts, workers=workers, resources=resources)


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


class _AttemptFailed(Exception):
    def __init__(self, error: TrainingError) -> None:
        super().__init__(str(error))
        self.error = error


def _launch_once(
    session: Session,
    train_fn: Callable[[Any], Any],
    config: LaunchConfig,
    strategy: Strategy,
    display: ProgressDisplay,
    stage: Optional[StageProfile] = None,
    lost_host_after_s: Optional[float] = None,
    **payload_fields: Any,
) -> Tuple[Any, List[int]]:
    """One barrier stage; returns rank 0's value and the resource profile ids Spark recorded for
    the stage (none over Connect); raises :class:`_AttemptFailed` carrying the run's ``TrainingError``."""
    tag = f"sparkdl-{uuid.uuid4().hex[:12]}"
    monitor = JobMonitor(config.num_workers, lambda: session.cancel(tag), display)
    host = session.channel_host()
    secret = new_secret()
    encrypt = payload_fields.get("encrypt", False)
    # The monitor judges a rank's lost connection; its error names the one that matters.
    server = ChannelServer(
        host, secret, monitor.on_message, monitor.on_disconnect, encrypt=encrypt, report_lost_ranks=False
    )
    monitor.channel_host = host
    try:
        # The launch's rendezvous store, where the channel listens: every task knows its address
        # from the payload, so the rendezvous needs no Spark barrier round (a second each).
        rendezvous_store = StoreServer(host, secret, config.timeout_s, encrypt=encrypt)
    except BaseException:
        server.close()
        raise
    payload = _TaskPayload(
        train_fn=train_fn,
        strategy=strategy,
        config=config,
        channel_address=server.address,
        secret=secret,
        rendezvous_address=rendezvous_store.address,
        # local[N]: the executor's output is this console, where the display prints it already.
        quiet_console=config.progress and re.match(r"local(\[|$)", session.master or "") is not None,
        **payload_fields,
    )

    def run_tasks() -> List[Tuple[int, bytes]]:
        return [(rank, cloudpickle.dumps(value)) for rank, value in _task_main(payload)]

    stop_watchdog = threading.Event()
    watchdog = watchdog_policy(config.watchdog_timeout_s, strategy.steps_per_sync_cycle())
    if watchdog is not None:
        threading.Thread(
            target=monitor.watch, args=(watchdog, stop_watchdog), name="sparkdl-watchdog", daemon=True
        ).start()
    if not session.connect:
        # Spark's decommissioning is seen by the driver only: it passes the notice on (sparkdl._runtime.drain).
        threading.Thread(
            target=watch_decommissioning,
            args=(session, monitor, rendezvous_store, stop_watchdog),
            name="sparkdl-decommission-watch",
            daemon=True,
        ).start()
    if lost_host_after_s is not None:
        # A host whose link died keeps its TCP connections open: only the silence shows it.
        threading.Thread(
            target=monitor.watch_hosts,
            args=(lost_host_after_s, stop_watchdog, lambda address: stop_using_host(session, address)),
            name="sparkdl-host-watch",
            daemon=True,
        ).start()
    # A Connect client cannot ask the scheduler for free slots: a barrier stage whose tasks do
    # not all start within slot_wait_s is one the cluster cannot run. A classic session counted
    # the slots before launching, but a slot it counted can still be gone (a host lost since,
    # which Spark has not noticed yet): a stage that waits for it must not wait for ever.
    start_bound_s = config.slot_wait_s if session.connect else config.slot_wait_s + _CLASSIC_START_GRACE_S
    start_label = (
        ""
        if session.connect
        else f"{start_bound_s:g}s (slot_wait_s={config.slot_wait_s:g}s + {_CLASSIC_START_GRACE_S:g}s to start)"
    )
    threading.Thread(
        target=monitor.watch_start,
        args=(start_bound_s, stop_watchdog, start_label),
        name="sparkdl-slot-watch",
        daemon=True,
    ).start()

    def stop_interrupted() -> None:
        # A notebook user interrupted the kernel: stop the tasks too, not just the driver's wait.
        # Through the monitor, so the ranks' disconnects that follow are no failures of theirs.
        monitor.cancel_now()
        if not session.connect:
            # The channel stays open until Spark has killed them: closed first, each rank would end
            # its own process (its heartbeat's exit), which Spark counts as a failed task, not a
            # killed one. (Connect's interrupt does not kill a task in Python: there the ranks'
            # own exit on the closed channel is what stops them, so no wait.)
            monitor.wait_disconnected(timeout=15.0)

    session.add_tag(tag)
    try:
        # A failed rank is reported once, by the TrainingError: Spark's own warnings for each
        # failed and killed task (its traceback and Java stack again) are off meanwhile.
        with quiet_task_failure_logs(None if session.connect else session.spark.sparkContext, tag):
            results = session.run_barrier(
                config.num_workers,
                run_tasks,
                f"sparkdl: train on {config.num_workers} barrier tasks ({strategy.name})",
                profile=None if stage is None else stage.profile,
            )
    except KeyboardInterrupt:
        stop_interrupted()
        raise
    except Exception as exc:
        if _raised_by_an_interrupt(exc):
            # py4j's clean-up of the connection Ctrl-C interrupted can itself fail ("Answer from
            # Java side is empty"); that error then stands in for the KeyboardInterrupt.
            stop_interrupted()
            raise KeyboardInterrupt from exc
        # The job failed or was cancelled; give the ranks' own reports a moment to arrive.
        monitor.wait_disconnected(timeout=15.0)
        monitor.cancel_now()  # settles the root-cause order now that every rank has hung up
        if monitor.slots_missing is not None:
            raise monitor.slots_missing from None
        if monitor.failures:
            raise _AttemptFailed(TrainingError(monitor.failures)) from None
        raise _AttemptFailed(TrainingError([_failure_from_spark(exc)])) from exc
    finally:
        stop_watchdog.set()
        session.remove_tag(tag)
        server.close()
        rendezvous_store.close()
    if monitor.failures:  # a rank failed but the stage still returned (should not happen)
        raise _AttemptFailed(TrainingError(monitor.failures))
    # Our own tasks' results, through Spark's result path (as mapPartitions' pickles were).
    values = {rank: cloudpickle.loads(value) for rank, value in results}
    return values.get(0), _profile_ids(session, tag)


def _profile_ids(session: Session, tag: str) -> List[int]:
    if session.connect:
        return []
    try:
        return stage_profile_ids(session.spark.sparkContext, tag)
    except Exception:  # noqa: BLE001 - a report only: the stage ran
        logger.debug("could not read the stage's resource profile from Spark's status store", exc_info=True)
        return []


#: On a classic session the slots were counted before the launch; the bound on the tasks'
#: start adds what a cold start takes (a new Python worker importing torch: seconds).
_CLASSIC_START_GRACE_S = 60.0


def _raised_by_an_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt was being handled."""
    seen = set()
    cause: Optional[BaseException] = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__
    return False


def _failure_from_spark(exc: BaseException) -> RankFailure:
    """A failure record for a Spark job that died before any rank reported (e.g. the task could
    not even unpickle its function because a module is missing on the executors)."""
    text = str(exc)
    match = re.search(
        r"(Traceback \(most recent call last\):.*?)(?:\n\s+at |\n\nDriver stacktrace|\nJVM stacktrace|\Z)", text, re.S
    )
    remote = match.group(1) if match else ""
    # SQL-side failures (the mapInArrow stage) end their Python traceback with an SQLSTATE line.
    lines = [line for line in remote.strip().splitlines() if line.strip() and not line.strip().startswith("SQLSTATE:")]
    last = lines[-1:] if remote else []
    message = last[0].strip() if last else text.strip().splitlines()[0][:500] if text.strip() else type(exc).__name__
    hint = ""
    if "ModuleNotFoundError" in message or "No module named" in message:
        hint = (
            " — the executors' Python cannot import it: install sparkdl and your model code there, ship "
            "them with --py-files / --archives (a packed virtualenv), or point PYSPARK_PYTHON at an "
            "interpreter that has them"
        )
    return RankFailure(rank=-1, exc_type="SparkJobFailed", message=message + hint, traceback=remote, phase="launching")
