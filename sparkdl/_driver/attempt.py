"""One attempt of a launch: open the progress channel and the rendezvous store, run the barrier
stage while the watchers (hangs, decommissioning, silent hosts, tasks that do not start) watch
it, and turn how it ended into an :class:`~sparkdl._driver.controller.AttemptOutcome`.

The first failure that reaches the driver (an error a rank reported, a rank whose process
vanished, a rank the watchdog found stuck, a silent host) cancels the Spark job at once — Spark
would otherwise wait for the remaining tasks — and becomes the outcome's one
:class:`~sparkdl.errors.TrainingError`, with where each rank ran and how long it had been silent.
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
from typing import Any, Callable, List, Optional, Tuple

import cloudpickle

from sparkdl._driver.cluster import quiet_task_failure_logs
from sparkdl._driver.controller import AttemptOutcome
from sparkdl._driver.host_watch import stop_using_host, watch_decommissioning
from sparkdl._driver.monitor import JobMonitor
from sparkdl._driver.progress import ProgressDisplay
from sparkdl._driver.resource_profile import StageProfile, stage_profile_ids
from sparkdl._driver.watchdog import watchdog_policy
from sparkdl._net.channel import ChannelServer, new_secret
from sparkdl._net.rendezvous_store import StoreServer
from sparkdl._spark import Session
from sparkdl._task.config import LaunchConfig
from sparkdl._task.entry import _task_main, _TaskPayload
from sparkdl.errors import InsufficientSlotsError, RankFailure, TrainingError
from sparkdl.strategies.base import Strategy

logger = logging.getLogger("sparkdl")


def silent_after_s(config: LaunchConfig) -> float:
    """A rank silent this long when its attempt failed is on a lost host (three heartbeats,
    at least 5 s: one late heartbeat is no lost host)."""
    return max(3 * config.heartbeat_interval_s, 5.0)


def run_attempt(
    session: Session,
    train_fn: Callable[[Any], Any],
    config: LaunchConfig,
    strategy: Strategy,
    display: ProgressDisplay,
    stage: Optional[StageProfile] = None,
    lost_host_after_s: Optional[float] = None,
    **payload_fields: Any,
) -> AttemptOutcome:
    """One barrier stage: rank 0's value and the resource profile ids Spark recorded for the
    stage (none over Connect), or the run's ``TrainingError`` and what the driver knew of the
    ranks' hosts when it failed."""
    tag = f"sparkdl-{uuid.uuid4().hex[:12]}"
    monitor = JobMonitor(config.num_workers, lambda: session.cancel(tag), display)
    secret = new_secret()
    server, rendezvous_store = _open_servers(
        session, monitor, config, secret, bool(payload_fields.get("encrypt", False))
    )
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
    stop_watching = threading.Event()
    _start_watchers(session, monitor, config, strategy, rendezvous_store, stop_watching, lost_host_after_s)
    session.add_tag(tag)
    try:
        results = _run_barrier(session, tag, monitor, config, strategy, stage, payload)
    except _Ended as ended:
        return _failed_outcome(monitor, ended.error, ended.shortfall)
    finally:
        stop_watching.set()
        session.remove_tag(tag)
        server.close()
        rendezvous_store.close()
    if monitor.failures:  # a rank failed but the stage still returned (should not happen)
        return _failed_outcome(monitor, TrainingError(monitor.failures))
    # Our own tasks' results, through Spark's result path (as mapPartitions' pickles were).
    values = {rank: cloudpickle.loads(value) for rank, value in results}
    if 0 not in values:  # every rank said "done", yet rank 0's result is not among Spark's
        return _failed_outcome(monitor, TrainingError([_result_lost(sorted(values))]))
    return AttemptOutcome(value=values.get(0), profile_ids=_profile_ids(session, tag))


def _open_servers(
    session: Session, monitor: JobMonitor, config: LaunchConfig, secret: bytes, encrypt: bool
) -> Tuple[ChannelServer, StoreServer]:
    """The attempt's progress channel and rendezvous store, listening where the tasks reach the
    driver, both keyed with the attempt's secret."""
    host = session.channel_host()
    # The monitor judges a rank's lost connection; its error names the one that matters.
    server = ChannelServer(
        host, secret, monitor.on_message, monitor.on_disconnect, encrypt=encrypt, report_lost_ranks=False
    )
    monitor.channel_host = host
    try:
        # Every task knows the store's address from the payload, so the rendezvous needs no
        # Spark barrier round (a second each).
        return server, StoreServer(host, secret, config.timeout_s, encrypt=encrypt)
    except BaseException:
        server.close()
        raise


def _start_watchers(
    session: Session,
    monitor: JobMonitor,
    config: LaunchConfig,
    strategy: Strategy,
    rendezvous_store: StoreServer,
    stop: threading.Event,
    lost_host_after_s: Optional[float],
) -> None:
    """The threads that watch the attempt until ``stop``: hangs (the watchdog), Spark's
    decommissioning, silent hosts, and tasks that do not all start."""

    def watch(target: Callable[..., None], name: str, *args: Any) -> None:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()

    watchdog = watchdog_policy(config.watchdog_timeout_s, strategy.steps_per_sync_cycle())
    if watchdog is not None:
        watch(monitor.watch, "sparkdl-watchdog", watchdog, stop)
    if not session.connect:
        # Spark's decommissioning is seen by the driver only: it passes the notice on (sparkdl._runtime.drain).
        watch(watch_decommissioning, "sparkdl-decommission-watch", session, monitor, rendezvous_store, stop)
    if lost_host_after_s is not None:
        # A host whose link died keeps its TCP connections open: only the silence shows it.
        on_lost = lambda address: stop_using_host(session, address)  # noqa: E731
        watch(monitor.watch_hosts, "sparkdl-host-watch", lost_host_after_s, stop, on_lost)
    # A Connect client cannot ask the scheduler for free slots: a barrier stage whose tasks do
    # not all start within slot_wait_s is one the cluster cannot run. A classic session counted
    # the slots before launching, but a slot it counted can still be gone (a host lost since,
    # which Spark has not noticed yet): a stage that waits for it must not wait for ever.
    bound_s = config.slot_wait_s if session.connect else config.slot_wait_s + _CLASSIC_START_GRACE_S
    label = (
        ""
        if session.connect
        else f"{bound_s:g}s (slot_wait_s={config.slot_wait_s:g}s + {_CLASSIC_START_GRACE_S:g}s to start)"
    )
    watch(monitor.watch_start, "sparkdl-slot-watch", bound_s, stop, label)


class _Ended(Exception):
    """The attempt's barrier stage failed: ``error`` says how (``shortfall``: its tasks did not all start)."""

    def __init__(self, error: Optional[TrainingError], shortfall: Optional[InsufficientSlotsError] = None) -> None:
        super().__init__(str(error or shortfall))
        self.error, self.shortfall = error, shortfall


def _run_barrier(
    session: Session,
    tag: str,
    monitor: JobMonitor,
    config: LaunchConfig,
    strategy: Strategy,
    stage: Optional[StageProfile],
    payload: _TaskPayload,
) -> List[Tuple[int, bytes]]:
    """Runs the barrier stage; raises :class:`_Ended` when it fails (KeyboardInterrupt when the
    user interrupted the driver, after stopping the tasks)."""

    def run_tasks() -> List[Tuple[int, bytes]]:
        return [(rank, cloudpickle.dumps(value)) for rank, value in _task_main(payload)]

    try:
        # A failed rank is reported once, by the TrainingError: Spark's own warnings for each
        # failed and killed task (its traceback and Java stack again) are off meanwhile.
        with quiet_task_failure_logs(None if session.connect else session.spark.sparkContext, tag):
            return session.run_barrier(
                config.num_workers,
                run_tasks,
                f"sparkdl: train on {config.num_workers} barrier tasks ({strategy.name})",
                profile=None if stage is None else stage.profile,
            )
    except KeyboardInterrupt:
        _stop_interrupted(session, monitor)
        raise
    except Exception as exc:
        if _raised_by_an_interrupt(exc):
            # py4j's clean-up of the connection Ctrl-C interrupted can itself fail ("Answer from
            # Java side is empty"); that error then stands in for the KeyboardInterrupt.
            _stop_interrupted(session, monitor)
            raise KeyboardInterrupt from exc
        # The job failed or was cancelled; give the ranks' own reports a moment to arrive
        # (not from ranks on a host that had gone silent when the attempt failed: they cannot).
        monitor.forget_silent(silent_after_s(config))
        monitor.wait_disconnected(timeout=15.0)
        monitor.cancel_now()  # settles the root-cause order now that every rank has hung up
        if monitor.slots_missing is not None:
            raise _Ended(None, monitor.slots_missing) from None
        if monitor.failures:
            raise _Ended(TrainingError(monitor.failures)) from None
        raise _Ended(TrainingError([_failure_from_spark(exc, finished=len(monitor.finished))])) from exc


def _stop_interrupted(session: Session, monitor: JobMonitor) -> None:
    """A notebook user interrupted the kernel: stops the tasks too, not just the driver's wait.
    Through the monitor, so the ranks' disconnects that follow are no failures of theirs."""
    monitor.cancel_now()
    if not session.connect:
        # The channel stays open until Spark has killed them: closed first, each rank would end
        # its own process (its heartbeat's exit), which Spark counts as a failed task, not a
        # killed one. (Connect's interrupt does not kill a task in Python: there the ranks'
        # own exit on the closed channel is what stops them, so no wait.)
        monitor.wait_disconnected(timeout=15.0)


def _failed_outcome(
    monitor: JobMonitor, error: Optional[TrainingError], shortfall: Optional[InsufficientSlotsError] = None
) -> AttemptOutcome:
    return AttemptOutcome(
        error=error,
        shortfall=shortfall,
        started=monitor.started,
        whereabouts=tuple(monitor.whereabouts),
        decommissioned=tuple(sorted(monitor.decommissioned)),
        dropped=tuple(sorted(monitor.dropped)),
    )


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


#: What to change when rank 0's result cannot reach the driver: it travels as a Spark task result.
_RESULT_ADVICE = (
    "rank 0's result (the trained model's state) travels to the driver as a Spark task result, through the "
    "executor's and the driver's JVM heaps: raise spark.executor.memory, spark.driver.memory and "
    "spark.driver.maxResultSize, or return less (a ShardedEmbedding table travels in it whole: docs/embeddings.md)"
)


def _result_lost(returned: list) -> RankFailure:
    """The failure of a stage whose ranks all finished but whose rank 0 result Spark did not return."""
    return RankFailure(
        rank=0,
        exc_type="ResultLost",
        message=f"every rank finished, but rank 0's result never reached the driver (Spark returned ranks "
        f"{returned}'s): {_RESULT_ADVICE}",
        traceback="",
        phase="returning its result",
        category="ConfigError",
    )


def _failure_from_spark(exc: BaseException, finished: int = 0) -> RankFailure:
    """A failure record for a Spark job that died before any rank reported (e.g. the task could
    not even unpickle its function because a module is missing on the executors), or after
    ``finished`` ranks had reported their training done (then in returning rank 0's result)."""
    text = str(exc)
    match = re.search(
        r"(Traceback \(most recent call last\):.*?)(?:\n\s+at |\n\nDriver stacktrace|\nJVM stacktrace|\Z)", text, re.S
    )
    remote = match.group(1) if match else ""
    # SQL-side failures (the mapInArrow stage) end their Python traceback with an SQLSTATE line.
    lines = [line for line in remote.strip().splitlines() if line.strip() and not line.strip().startswith("SQLSTATE:")]
    last = lines[-1:] if remote else []
    message = last[0].strip() if last else text.strip().splitlines()[0][:500] if text.strip() else type(exc).__name__
    jvm = re.search(r"java\.lang\.\w+(?:Error|Exception): [^\n]+", text)
    if not remote and jvm:  # no Python traceback: the JVM's own error says what went wrong
        message = f"{message} {jvm.group(0).strip()}"
    hint = ""
    if "ModuleNotFoundError" in message or "No module named" in message:
        hint = (
            " — the executors' Python cannot import it: install sparkdl and your model code there, ship "
            "them with --py-files / --archives (a packed virtualenv), or point PYSPARK_PYTHON at an "
            "interpreter that has them"
        )
    if finished:
        # The ranks had trained: what failed is moving the result (a JVM out of memory, usually).
        return RankFailure(
            rank=-1,
            exc_type="SparkJobFailed",
            message=f"{message} — after {finished} rank(s) had finished training; {_RESULT_ADVICE}",
            traceback=remote,
            phase="returning the result",
        )
    return RankFailure(rank=-1, exc_type="SparkJobFailed", message=message + hint, traceback=remote, phase="launching")
