"""Runs a training function on N Spark barrier tasks and brings back rank 0's result.

Driver side: check slots, open the progress channel, run one barrier stage, watch the channel.
The first failure that reaches the driver (an error a rank reported, a rank whose process
vanished, or a rank the watchdog found stuck) cancels the Spark job at once — Spark would
otherwise wait for the remaining tasks — and is raised as one
:class:`~sparkdl.errors.TrainingError`, unless the :class:`FailurePolicy` relaunches the stage
(which then resumes from the newest checkpoint).

Task side (:func:`_task_main`): connect to the channel, prefix the task's output with its rank,
set threads to the task's cores, select the device Spark assigned (:mod:`sparkdl._device`),
rendezvous, run the function, report, clean up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import itertools
import logging
import os
import re
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import cloudpickle

from sparkdl._channel import ChannelClient, ChannelError, ChannelServer, new_secret
from sparkdl._device import check_gpu_request, task_device
from sparkdl._precision import Precision
from sparkdl._progress import ProgressDisplay
from sparkdl._session import Session
from sparkdl.checkpoint import CheckpointConfig, CheckpointStore
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.batching import DataSpec
from sparkdl.data.readers.base import DataReader
from sparkdl.errors import ConfigError, InsufficientSlotsError, RankFailure, TrainingError
from sparkdl.strategies.base import Strategy

logger = logging.getLogger("sparkdl")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How the barrier stage runs.

    Args:
        num_workers: number of barrier tasks (ranks); each needs one task slot.
        timeout_s: bound on rendezvous and on every collective; a rank stuck longer fails the run.
        slot_wait_s: how long to wait for executors to register before giving up on slots.
        use_gpu: True to require GPUs, False for CPU, None to use GPUs when Spark gives tasks some
            (see :mod:`sparkdl._device`).
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (see :mod:`sparkdl._precision`).
        progress: print (or display in a notebook) per-epoch progress on the driver.
        max_failures: relaunch the stage up to this many times after a failure, resuming from
            the newest checkpoint when there is a checkpoint directory.
        watchdog_timeout_s: fail the run when a rank makes no progress (no batch, no phase
            change) for this long; None disables the watchdog.
    """

    num_workers: int
    timeout_s: float = 600.0
    slot_wait_s: float = 30.0
    use_gpu: Optional[bool] = None
    progress: bool = True
    precision: str = "32"
    max_failures: int = 0
    watchdog_timeout_s: Optional[float] = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or isinstance(self.num_workers, bool) or self.num_workers < 1:
            raise ConfigError(f"num_workers={self.num_workers!r} must be a positive integer")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be > 0 seconds")
        if self.use_gpu is not None and not isinstance(self.use_gpu, bool):
            raise ConfigError(f"use_gpu={self.use_gpu!r} must be True, False or None (use GPUs when Spark assigns them)")
        object.__setattr__(self, "precision", Precision(self.precision).value)  # normalized: 32 -> "32"
        if self.slot_wait_s < 0:
            raise ConfigError(f"slot_wait_s={self.slot_wait_s!r} must be >= 0 seconds")
        if not isinstance(self.max_failures, int) or isinstance(self.max_failures, bool) or self.max_failures < 0:
            raise ConfigError(f"max_failures={self.max_failures!r} must be an integer >= 0")
        if self.watchdog_timeout_s is not None and not self.watchdog_timeout_s > 0:
            raise ConfigError(f"watchdog_timeout_s={self.watchdog_timeout_s!r} must be > 0 seconds, or None to disable it")

    @property
    def heartbeat_interval_s(self) -> float:
        """Often enough that the watchdog sees a stall within a fifth of its timeout."""
        return min(2.0, self.watchdog_timeout_s / 5) if self.watchdog_timeout_s else 2.0


class Decision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """Whether a failed attempt is relaunched.

    Failures that would only repeat — bad settings or data, a NaN loss, code the executors
    cannot import — are raised at once; anything else (a lost executor, a killed process, a
    hang, a network error, an exception in user code) is retried up to ``max_failures`` times.
    """

    max_failures: int = 0
    deterministic: Tuple[str, ...] = ("ConfigError", "DataError", "NonFiniteLossError", "InsufficientSlotsError")

    def decide(self, error: TrainingError, failures_so_far: int) -> Decision:
        if failures_so_far > self.max_failures:
            return Decision.RAISE
        first = error.failures[0] if error.failures else None
        if first is not None and (first.exc_type in self.deterministic or "No module named" in first.message):
            return Decision.RAISE
        return Decision.RETRY


@dataclasses.dataclass
class LaunchOutcome:
    """Rank 0's return value plus how the run got there."""

    value: Any
    attempts: List[Dict[str, Any]]
    from_finished_checkpoint: bool = False


@dataclasses.dataclass(frozen=True)
class _TaskPayload:
    """Everything a task needs; pickled once into the stage's closure."""

    train_fn: Callable[[Any], Any]
    strategy: Strategy
    config: LaunchConfig
    channel_address: tuple
    secret: bytes
    dataset: Optional[DatasetInfo]
    data_spec: Optional[DataSpec]
    reader: Optional[DataReader]
    steps_per_epoch: Optional[int]
    checkpoint: Optional[CheckpointConfig] = None
    attempt: int = 1


class _JobMonitor:
    """Driver-side state of one run, updated from the channel's threads."""

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

    def on_message(self, rank: int, message: Dict[str, Any]) -> None:
        kind = message.get("kind")
        if kind == "epoch":
            self.display.epoch(message.get("record", {}))
        elif kind == "metrics":
            self.display.metrics(rank, message.get("metrics", {}))
        elif kind == "heartbeat":
            progress = int(message.get("progress", 0))
            with self._cond:
                self.phases[rank] = str(message.get("phase", ""))
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

    #: Set when the barrier stage's tasks did not all start within the slot wait (Connect).
    slots_missing: Optional[InsufficientSlotsError] = None

    def watch_start(self, wait_s: float, stop: threading.Event) -> None:
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
            self.slots_missing = InsufficientSlotsError(
                f"num_workers={self.num_workers} needs {self.num_workers} concurrent task slots, but {started} of the barrier "
                f"stage's tasks started within {wait_s:g}s: the cluster has fewer free slots than that (slots = executor "
                f"cores / spark.task.cpus). Lower num_workers, or add executors or cores"
            )
        logger.error("%s; cancelling the Spark job", self.slots_missing)
        self._cancel()

    def on_connect(self, rank: int) -> None:
        with self._cond:
            self.connected.add(rank)
            self._progress[rank] = (-1, time.monotonic())
            self._cond.notify_all()

    def watch(self, timeout_s: float, stop: threading.Event) -> None:
        """Fails the run when a rank's progress stands still for ``timeout_s`` (a hang)."""
        while not stop.wait(min(1.0, timeout_s / 10)):
            now = time.monotonic()
            with self._cond:
                stalled = [
                    (since, rank) for rank, (_, since) in self._progress.items()
                    if now - since > timeout_s and rank not in self.finished and rank in self.connected
                ]
                if not stalled or self._cancelled:
                    continue
                since, rank = min(stalled)
                phase = self.phases.get(rank, "")
            self._fail(
                RankFailure(
                    rank=rank,
                    exc_type="WatchdogTimeout",
                    message=(
                        f"rank {rank} made no progress for {now - since:.0f}s (watchdog_timeout_s={timeout_s:g}); "
                        f"it is stuck or much slower than expected. If this phase legitimately takes longer, "
                        f"raise watchdog_timeout_s"
                    ),
                    traceback="",
                    phase=phase,
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
                not clean and rank not in self.finished and not reported and not self._cancelled
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
            self._cond.notify_all()
        if first:
            threading.Timer(self.settle_s, self._cancel_now).start()

    def _cancel_now(self) -> None:
        with self._cond:
            if self._cancelled:
                return
            self._cancelled = True
            # A rank that vanished without a word is the likeliest cause of its peers' errors.
            self.failures.sort(key=lambda f: f.exc_type != "WorkerLost")
            root = self.failures[0] if self.failures else None  # none when the job died before any rank reported
            self._cond.notify_all()
        if root is not None:
            logger.error("rank %d failed (%s: %s); cancelling the Spark job", root.rank, root.exc_type, root.message)
        self._cancel()

    def wait_disconnected(self, timeout: float) -> None:
        """Waits (bounded) until every task has hung up, so late error reports are not lost."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.connected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)


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
) -> LaunchOutcome:
    """Runs ``train_fn(ctx)`` on ``config.num_workers`` barrier tasks; returns rank 0's value.

    A failed attempt is relaunched (up to ``config.max_failures`` times, see
    :class:`FailurePolicy`); with a checkpoint directory each attempt resumes from the newest
    checkpoint, and a directory that holds a finished run returns its stored result at once.
    """
    from pyspark.sql import SparkSession

    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise ConfigError("no active SparkSession: create one (SparkSession.builder...getOrCreate()) or pass spark=")
    session = Session(spark)
    check_gpu_request(session.conf, config.use_gpu)  # fail now, not after executors start
    display = display or ProgressDisplay(enabled=config.progress)
    store = CheckpointStore(checkpoint.url, checkpoint.keep) if checkpoint else None
    if store is not None:
        if not checkpoint.resume:
            store.clear()
        else:
            finished, result = store.load_finished()
            if finished:
                logger.warning("%s holds a finished run: returning its result without training (resume=False trains again)", store.url)
                return LaunchOutcome(result, [], from_finished_checkpoint=True)
    policy = FailurePolicy(config.max_failures)
    attempts: List[Dict[str, Any]] = []
    for attempt in itertools.count(1):
        if not session.connect:
            check_slots(spark.sparkContext, config.num_workers, config.slot_wait_s)
        started = time.time()
        try:
            value = _launch_once(
                session, train_fn, config, strategy, display,
                dataset=dataset, data_spec=data_spec, reader=reader, steps_per_epoch=steps_per_epoch,
                checkpoint=checkpoint, attempt=attempt,
            )
        except _AttemptFailed as failed:
            error = failed.error
            attempts.append({"attempt": attempt, "seconds": time.time() - started, "error": str(error).splitlines()[0]})
            decision = policy.decide(error, attempt)
            if decision is Decision.RAISE:
                if attempt > 1:
                    raise TrainingError(error.failures, hint=f"(attempt {attempt}; max_failures={config.max_failures})") from None
                raise error from None
            where = "the newest checkpoint" if store is not None else "scratch (no checkpoint_dir)"
            message = f"[sparkdl] attempt {attempt} failed: {str(error).splitlines()[0]}; relaunching from {where} ({attempt}/{config.max_failures} retries)"
            logger.warning(message)
            if config.progress:
                print(message, flush=True)
            continue
        attempts.append({"attempt": attempt, "seconds": time.time() - started, "error": None})
        break
    if store is not None:
        store.save_finished(value)
    return LaunchOutcome(value, attempts)


_PEER_LOSS = re.compile(
    r"connection (closed|reset|refused|lost)|broken pipe|closed by peer|lost (rank|peer|worker)|peer rank|ParameterServerError", re.I
)


def _is_peer_loss(failure: RankFailure) -> bool:
    """Whether a rank's error reads like the consequence of another rank's death."""
    return bool(_PEER_LOSS.search(f"{failure.exc_type}: {failure.message}"))


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
    **payload_fields: Any,
) -> Any:
    """One barrier stage; raises :class:`_AttemptFailed` carrying the run's ``TrainingError``."""
    tag = f"sparkdl-{uuid.uuid4().hex[:12]}"
    monitor = _JobMonitor(config.num_workers, lambda: session.cancel(tag), display)
    host = session.channel_host()
    secret = new_secret()
    server = ChannelServer(host, secret, _with_connect(monitor), monitor.on_disconnect)
    payload = _TaskPayload(
        train_fn=train_fn,
        strategy=strategy,
        config=config,
        channel_address=server.address,
        secret=secret,
        **payload_fields,
    )

    def run_tasks() -> List[Tuple[int, bytes]]:
        return [(rank, cloudpickle.dumps(value)) for rank, value in _task_main(payload)]

    stop_watchdog = threading.Event()
    if config.watchdog_timeout_s:
        threading.Thread(
            target=monitor.watch, args=(config.watchdog_timeout_s, stop_watchdog), name="sparkdl-watchdog", daemon=True
        ).start()
    if session.connect:
        # A Connect client cannot ask the scheduler for free slots: a barrier stage whose tasks do
        # not all start within slot_wait_s is one the cluster cannot run.
        threading.Thread(
            target=monitor.watch_start, args=(config.slot_wait_s, stop_watchdog), name="sparkdl-slot-watch", daemon=True
        ).start()
    session.add_tag(tag)
    try:
        results = session.run_barrier(
            config.num_workers, run_tasks, tag, f"sparkdl: train on {config.num_workers} barrier tasks ({strategy.name})"
        )
    except KeyboardInterrupt:
        # A notebook user interrupted the kernel: stop the tasks too, not just the driver's wait.
        session.cancel(tag)
        raise
    except Exception as exc:
        # The job failed or was cancelled; give the ranks' own reports a moment to arrive.
        monitor.wait_disconnected(timeout=15.0)
        monitor._cancel_now()  # settles the root-cause order now that every rank has hung up
        if monitor.slots_missing is not None:
            raise monitor.slots_missing from None
        if monitor.failures:
            raise _AttemptFailed(TrainingError(monitor.failures)) from None
        raise _AttemptFailed(TrainingError([_failure_from_spark(exc)])) from exc
    finally:
        stop_watchdog.set()
        session.remove_tag(tag)
        server.close()
    if monitor.failures:  # a rank failed but the stage still returned (should not happen)
        raise _AttemptFailed(TrainingError(monitor.failures))
    # Our own tasks' results, through Spark's result path (as mapPartitions' pickles were).
    values = {rank: cloudpickle.loads(value) for rank, value in results}
    return values.get(0)


def _with_connect(monitor: _JobMonitor) -> Callable[[int, Dict[str, Any]], None]:
    def on_message(rank: int, message: Dict[str, Any]) -> None:
        if message.get("kind") == "started":
            monitor.on_connect(rank)
        monitor.on_message(rank, message)

    return on_message


def _failure_from_spark(exc: BaseException) -> RankFailure:
    """A failure record for a Spark job that died before any rank reported (e.g. the task could
    not even unpickle its function because a module is missing on the executors)."""
    text = str(exc)
    match = re.search(r"(Traceback \(most recent call last\):.*?)(?:\n\s+at |\n\nDriver stacktrace|\Z)", text, re.S)
    remote = match.group(1) if match else ""
    last = [line for line in remote.strip().splitlines() if line.strip()][-1:] if remote else []
    message = last[0].strip() if last else text.strip().splitlines()[0][:500] if text.strip() else type(exc).__name__
    hint = ""
    if "ModuleNotFoundError" in message or "No module named" in message:
        hint = (
            " — the executors' Python cannot import it: install sparkdl and your model code there, ship "
            "them with --py-files / --archives (a packed virtualenv), or point PYSPARK_PYTHON at an "
            "interpreter that has them"
        )
    return RankFailure(rank=-1, exc_type="SparkJobFailed", message=message + hint, traceback=remote, phase="launching")


def check_slots(sc: Any, num_workers: int, wait_s: float) -> None:
    """Fails fast when the cluster cannot run ``num_workers`` tasks at once.

    Spark itself would retry the barrier stage for minutes before giving up
    (``spark.scheduler.barrier.maxConcurrentTasksCheck.*``). Executors register asynchronously
    after start-up, so while fewer have registered than were asked for this waits up to
    ``wait_s``; once they are all there, too few slots is an error at once. When the number
    to expect is unknown (a standalone or YARN cluster without ``spark.executor.instances``),
    it waits the whole ``wait_s`` before deciding.
    """
    deadline = time.monotonic() + wait_s
    jsc = sc._jsc.sc()
    expected = _expected_executors(sc)
    while True:
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        slots = int(jsc.maxNumConcurrentTasks(profile))
        if slots >= num_workers:
            return
        executors = int(jsc.getExecutorIds().size())
        if (expected is not None and executors >= expected) or time.monotonic() >= deadline:
            break
        time.sleep(0.25)  # polling the scheduler: executor registration has no Python-side event
    task_cpus = sc.getConf().get("spark.task.cpus", "1")
    raise InsufficientSlotsError(
        f"num_workers={num_workers} needs {num_workers} concurrent task slots, but the cluster has {slots} "
        f"({executors} executor(s); slots = executor cores / spark.task.cpus={task_cpus}). "
        f"Lower num_workers to at most {slots}, or add executors or cores."
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


# --------------------------------------------------------------------------------------------
# Task side
# --------------------------------------------------------------------------------------------


def _task_main(payload: _TaskPayload) -> List[tuple]:
    from pyspark import BarrierTaskContext

    barrier = BarrierTaskContext.get()
    rank = barrier.partitionId()
    client = ChannelClient(tuple(payload.channel_address), payload.secret, rank, timeout=30.0)
    from sparkdl.context import Liveness

    liveness = Liveness()
    heartbeat = _Heartbeat(client, liveness, payload.config.heartbeat_interval_s)
    # ``scopes`` closes after the finally block below: the device stays selected until the
    # process group is torn down, and is restored before the worker runs its next task.
    with _rank_prefixed_output(rank), _forward_logs(client, rank), _task_threads(barrier.cpus()), contextlib.ExitStack() as scopes:
        context = None
        runtime = None
        try:
            from sparkdl._rendezvous import rendezvous
            from sparkdl.context import TrainContext

            client.send({"kind": "started", "attempt": payload.attempt})
            heartbeat.start()
            liveness.advance("selecting the device")
            assignment = scopes.enter_context(task_device(barrier, payload.config.use_gpu))
            device = assignment.device
            liveness.advance("rendezvous")
            addresses = [info.address for info in barrier.getTaskInfos()]
            env = rendezvous(rank, payload.config.num_workers, addresses, barrier.allGather, device, payload.config.timeout_s)
            runtime = payload.strategy.create_runtime(env)
            context = TrainContext(
                env,
                runtime,
                client.send,
                dataset=payload.dataset,
                data_spec=payload.data_spec,
                reader=payload.reader,
                steps_per_epoch=payload.steps_per_epoch,
                store=CheckpointStore(payload.checkpoint.url, payload.checkpoint.keep) if payload.checkpoint else None,
                liveness=liveness,
                assignment=assignment,
                precision=payload.config.precision,
            )
            context.set_phase("training")
            value = payload.train_fn(context)
            client.send({"kind": "done"})
            return [(rank, value if rank == 0 else None)]
        except BaseException as exc:
            failure = RankFailure.from_exception(rank, exc, phase=liveness.phase)
            with contextlib.suppress(Exception):
                client.send({"kind": "error", "failure": failure.to_json()})
            raise
        finally:
            heartbeat.stop()
            if context is not None:
                context.close()
            if runtime is not None:
                with contextlib.suppress(Exception):
                    runtime.close()
            from sparkdl._rendezvous import teardown

            teardown()
            client.close()


class _Heartbeat:
    """Sends the rank's progress counter and phase to the driver's watchdog at a fixed rate."""

    def __init__(self, client: ChannelClient, liveness: Any, interval_s: float) -> None:
        self._client = client
        self._liveness = liveness
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._client.send({"kind": "heartbeat", "progress": self._liveness.progress, "phase": self._liveness.phase})
            except ChannelError:
                return  # the driver is gone; the task will learn it from Spark
            if self._stop.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


@contextlib.contextmanager
def _task_threads(cores: int):
    """Torch and OpenMP threads = the task's cores: two ranks on a 2-core box each get one."""
    import torch

    cores = max(1, int(cores or 1))
    saved_env = os.environ.get("OMP_NUM_THREADS")
    saved_threads = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(cores)
    torch.set_num_threads(cores)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


class _PrefixedWriter(io.TextIOBase):
    """Prefixes every line with the rank, so interleaved executor logs stay readable."""

    def __init__(self, target: Any, prefix: str) -> None:
        self._target = target
        self._prefix = prefix
        self._at_line_start = True
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            out = []
            for piece in text.splitlines(keepends=True):
                if self._at_line_start:
                    out.append(self._prefix)
                out.append(piece)
                self._at_line_start = piece.endswith("\n")
            self._target.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._target.flush()


@contextlib.contextmanager
def _rank_prefixed_output(rank: int):
    saved = sys.stdout, sys.stderr
    sys.stdout = _PrefixedWriter(saved[0], f"[sparkdl rank {rank}] ")
    sys.stderr = _PrefixedWriter(saved[1], f"[sparkdl rank {rank}] ")
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved


class _ChannelLogHandler(logging.Handler):
    def __init__(self, client: ChannelClient) -> None:
        super().__init__(level=logging.INFO)
        self._client = client

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._client.send({"kind": "log", "level": record.levelno, "message": self.format(record)[:8000]})
        except Exception:  # noqa: BLE001 - logging must never fail the task
            pass


@contextlib.contextmanager
def _forward_logs(client: ChannelClient, rank: int):
    """Records of the ``sparkdl`` loggers go to the task's stderr and to the driver."""
    root = logging.getLogger("sparkdl")
    to_driver = _ChannelLogHandler(client)
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved_level, saved_propagate = root.level, root.propagate
    root.addHandler(to_driver)
    root.addHandler(to_stderr)
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(to_driver)
        root.removeHandler(to_stderr)
        root.setLevel(saved_level)
        root.propagate = saved_propagate
