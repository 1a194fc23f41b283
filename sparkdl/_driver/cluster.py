"""What the driver asks Spark's scheduler (classic sessions; a Spark Connect client has no
SparkContext): the task slots free for a launch, how long to wait for them, and the scheduler's
own task-failure logging, kept quiet while sparkdl reports a failed stage itself."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Any, Callable, Iterator, List, Optional

from sparkdl._driver.resource_profile import StageProfile, executor_offers
from sparkdl.errors import InsufficientSlotsError

logger = logging.getLogger("sparkdl")

#: Seconds the slot count must stay short once every expected executor is listed before the
#: check fails: the scheduler counts an executor's cores a moment after it is listed.
SETTLE_S = 2.0


def check_slots(sc: Any, num_workers: int, wait_s: float, stage: Optional[StageProfile] = None) -> None:
    """Fails fast when the cluster cannot run ``num_workers`` tasks at once.

    Spark itself would retry the barrier stage for minutes before giving up
    (``spark.scheduler.barrier.maxConcurrentTasksCheck.*``). Executors register asynchronously
    after start-up, so while fewer have registered than were asked for this waits up to
    ``wait_s``; once they are all there, too few slots is an error at once. When the number
    to expect is unknown (a standalone or YARN cluster without ``spark.executor.instances``),
    it waits the whole ``wait_s`` before deciding. With ``stage``, the slots are those of the
    training stage's resource profile (executors with enough free cores and GPUs for it).
    """
    deadline = time.monotonic() + wait_s
    jsc = sc._jsc.sc()
    expected = _expected_executors(sc)
    all_listed_at: Optional[float] = None
    while True:
        slots = _slots(sc, stage)
        if slots >= num_workers:
            return
        executors = int(jsc.getExecutorIds().size())
        now = time.monotonic()
        if expected is not None and executors >= expected:
            # An executor can be listed before the scheduler counts its cores (a CI run saw 2
            # executors and 1 slot): decide once every executor has been listed for SETTLE_S.
            all_listed_at = now if all_listed_at is None else all_listed_at
            if now - all_listed_at >= SETTLE_S:
                break
        if now >= deadline:
            break
        time.sleep(0.25)  # polling the scheduler: executor registration has no Python-side event
    task_cpus = sc.getConf().get("spark.task.cpus", "1")
    # Waiting longer helps only when executors may still be registering (the deadline decided).
    still_starting = expected is None or executors < expected
    wait = f"; if executors are still starting, wait longer for them with slot_wait_s (now {wait_s:g} s)."
    if stage is not None and stage.java is not None:
        shortage = (
            f"num_workers={num_workers} needs {num_workers} concurrent task slots of {stage.describe()}, but the "
            f"cluster has {slots} for it ({executor_offers(sc)}). Lower num_workers to at most {slots}, ask for "
            f"fewer resources per task (resources=), or add executors with more cores or GPUs"
        )
    else:
        shortage = (
            f"num_workers={num_workers} needs {num_workers} concurrent task slots, but the cluster has {slots} "
            f"({executors} executor(s); slots = executor cores / spark.task.cpus={task_cpus}). "
            f"Lower num_workers to at most {slots}, or add executors or cores"
        )
    raise InsufficientSlotsError(shortage + (wait if still_starting else "."))


def _slots(sc: Any, stage: Optional[StageProfile]) -> int:
    """The tasks of the stage's profile (else the default one) the executors can run at once."""
    jsc = sc._jsc.sc()
    profile = stage.java if stage is not None and stage.java is not None else None
    if profile is None:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(profile))


def free_slots(sc: Any, stage: Optional[StageProfile] = None) -> int:
    """Task slots not held by a running or pending task of an active stage (other jobs')."""
    slots = _slots(sc, stage)
    tracker = sc.statusTracker()
    busy = 0
    for stage in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage)
        if info is not None:
            busy += max(0, info.numTasks - info.numCompletedTasks)
    return max(0, slots - busy)


def relaunch_workers(
    sc: Any,
    num_workers: int,
    min_workers: int,
    wait_s: float,
    attempt: int = 2,
    stage: Optional[StageProfile] = None,
    enough: Optional[int] = None,
) -> int:
    """The workers an attempt runs on: ``num_workers`` when that many slots are free, else as
    many as are free once the executors expected have registered, ``enough`` slots are free
    (the driver knows the others are gone: a lost or decommissioned host's), or ``wait_s`` has
    passed, at least ``min_workers``.

    Raises:
        InsufficientSlotsError: fewer than ``min_workers`` slots are free.
    """
    deadline = time.monotonic() + wait_s
    expected = _expected_executors(sc)
    while True:
        free = free_slots(sc, stage)
        if free >= num_workers:
            return num_workers
        executors = int(sc._jsc.sc().getExecutorIds().size())
        if (expected is not None and executors >= expected) or time.monotonic() >= deadline:
            break
        if enough is not None and free >= enough:
            break
        time.sleep(0.25)  # polling the scheduler: executor registration has no Python-side event
    if free >= min_workers:
        return free
    raise InsufficientSlotsError(
        f"{'the first launch' if attempt == 1 else 'the relaunch after a failure'} found {free} free task slot(s), fewer than min_workers={min_workers} "
        f"(num_workers={num_workers}) within slot_wait_s={wait_s:g} s; lower min_workers to train on fewer workers, "
        f"free or add executors, or wait longer for replacement executors with slot_wait_s"
    )


def _expected_executors(sc: Any) -> Optional[int]:
    """How many executors this application will get, when that is known up front."""
    configured = sc.getConf().get("spark.executor.instances", None)
    if configured:
        return int(configured)
    match = re.match(r"local-cluster\[\s*(\d+)", sc.master)
    if match:
        return int(match.group(1))
    return 1 if sc.master.startswith("local") else None


def busy_stages(sc: Any) -> List[str]:
    """Other jobs' active stages that hold or wait for task slots, described for a message."""
    tracker = sc.statusTracker()
    found = []
    for stage in sorted(tracker.getActiveStageIds()):
        info = tracker.getStageInfo(stage)
        if info is not None and info.numTasks > info.numCompletedTasks:
            found.append(f"stage {stage} ({info.name}: {info.numTasks - info.numCompletedTasks} task(s) left)")
    return found


def wait_for_free_slots(
    sc: Any,
    num_workers: int,
    wait_s: float,
    say: Callable[[str], None],
    attempt: int = 2,
    stage: Optional[StageProfile] = None,
) -> None:
    """A relaunch without ``min_workers``: waits up to ``wait_s`` until ``num_workers`` task
    slots are free (other jobs' tasks may hold some: a barrier stage starts all its tasks or
    none, and would wait for them unbounded), saying once what it waits for.

    Raises:
        InsufficientSlotsError: fewer slots are free after ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    free = free_slots(sc, stage)
    if free >= num_workers:
        return
    said = time.monotonic()
    holders = busy_stages(sc)
    say(
        f"[sparkdl] attempt {attempt}: waiting up to slot_wait_s={wait_s:g}s for {num_workers} free task slots "
        f"({free} free now; held or awaited by {', '.join(holders[:3]) or 'tasks Spark has not released yet'})"
    )
    while time.monotonic() < deadline:
        time.sleep(0.25)  # polling the scheduler: a slot freeing has no Python-side event
        free = free_slots(sc, stage)
        if free >= num_workers:
            logger.info("attempt %d: %d task slots free after %.1fs", attempt, free, time.monotonic() - said)
            return
    holders = busy_stages(sc) or holders
    raise InsufficientSlotsError(
        f"the relaunch after a failure (attempt {attempt}) found {free} free task slot(s) of the num_workers={num_workers} it "
        f"needs within slot_wait_s={wait_s:g}s; other jobs hold the rest ({', '.join(holders[:3]) or 'unknown'}). Raise "
        f"slot_wait_s to wait longer for them, or set min_workers to continue on as many workers as are free"
    )


#: Spark's loggers that print a failed or killed task of the barrier stage, with the whole
#: Python traceback and Java stack, once per task: the executor (local mode runs it in the
#: driver's JVM), the task set and the scheduler.
TASK_FAILURE_LOGGERS = (
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSchedulerImpl",
)


@contextlib.contextmanager
def quiet_task_failure_logs(sc: Optional[Any], tag: str = "") -> Iterator[None]:
    """While the barrier stage runs, and until its killed tasks have ended (Spark reports each
    with its traceback when it ends, seconds after the stage failed), Spark's task-failure
    loggers (:data:`TASK_FAILURE_LOGGERS`) are off: a failed rank is reported once, by sparkdl.
    Their configuration is restored after, on a thread when tasks of the job tagged ``tag`` are
    still ending (:func:`settle` waits for it): a level set before is set again, a logger that had
    none is removed, so it follows its parent again. ``sc`` None (Spark Connect: no JVM handle
    here) changes nothing; so does a JVM without log4j 2."""
    global _quiet_stages, _restore
    if sc is None:
        yield
        return
    with _quiet_lock:  # stages of fits in several threads: the first quiets, the last restores
        _quiet_stages += 1
        if _quiet_stages == 1:
            try:
                _restore = _silence(sc._jvm, TASK_FAILURE_LOGGERS)
            except Exception:  # noqa: BLE001 - only logging: the stage runs regardless
                logger.debug("could not quiet Spark's task-failure logging", exc_info=True)
    try:
        yield
    finally:
        if tag and _active_tasks(sc, tag):
            thread = threading.Thread(
                target=_release_when_ended, args=(sc, tag), name="sparkdl-quiet-logs", daemon=True
            )
            _pending.append(thread)
            thread.start()
        else:
            _release()


def settle(timeout: float = 30.0) -> None:
    """Waits (bounded) until the killed tasks of the stages that failed have ended and Spark's
    loggers are restored: before ``spark.stop()``, which would fail a task still ending."""
    deadline = time.monotonic() + timeout
    while _pending:
        _pending[0].join(max(0.0, deadline - time.monotonic()))
        if _pending and _pending[0].is_alive():
            return
        with contextlib.suppress(IndexError):
            _pending.pop(0)


def _active_tasks(sc: Any, tag: str) -> int:
    try:
        tracker = sc._jsc.sc().statusTracker()
        active = 0
        for job in tracker.getJobIdsForTag(tag):
            info = tracker.getJobInfo(job)
            for stage in info.get().stageIds() if info.isDefined() else ():
                stage_info = tracker.getStageInfo(stage)
                active += stage_info.get().numActiveTasks() if stage_info.isDefined() else 0
        return active
    except Exception:  # noqa: BLE001 - a stopped context: nothing is running
        return 0


def _release_when_ended(sc: Any, tag: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while _active_tasks(sc, tag) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the status tracker: a task's end has no Python-side event
    _release()


def _release() -> None:
    global _quiet_stages, _restore
    with _quiet_lock:
        _quiet_stages -= 1
        if _quiet_stages == 0:
            for undo in reversed(_restore):
                try:
                    undo()
                except Exception:  # noqa: BLE001
                    logger.debug("could not restore a Spark logger's level", exc_info=True)
            _restore = []


_quiet_lock = threading.Lock()
_quiet_stages = 0
_restore: List[Callable[[], None]] = []
_pending: List[threading.Thread] = []


def _silence(jvm: Any, names: tuple) -> List[Callable[[], None]]:
    log4j = jvm.org.apache.logging.log4j
    configurator, off = log4j.core.config.Configurator, log4j.Level.OFF
    restore: List[Callable[[], None]] = []
    for name in names:
        context = log4j.LogManager.getContext(False)
        own = context.getConfiguration().getLoggers().get(name)  # None: it inherits its parent's level
        if own is not None:
            level = own.getLevel()
            restore.append(lambda name=name, level=level: configurator.setLevel(name, level))
        else:
            restore.append(lambda name=name: _remove_logger_config(log4j, name))
        configurator.setLevel(name, off)
    return restore


def _remove_logger_config(log4j: Any, name: str) -> None:
    context = log4j.LogManager.getContext(False)
    context.getConfiguration().removeLogger(name)
    context.updateLoggers()
