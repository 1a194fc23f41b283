"""The Spark provider's ``SparkSubmitHook`` with spark-submit in a session of its own, its output
read off the main thread, and a kill that cannot deadlock in Airflow's SIGTERM handler.

Airflow kills a task (a timeout, "mark failed", a supervisor stopping it) by sending its process
SIGTERM; the task runner's handler calls the operator's ``on_kill``. Python runs a signal handler
on the main thread, between two bytecodes of whatever that thread was doing. For this hook that
is reading spark-submit's output and logging each line, and a log line is written inside
structlog's per-file lock, which is not reentrant: an ``on_kill`` that logged while the handler had
interrupted such a write waited for a lock its own thread held, forever. The task hung, Airflow's
supervisor SIGKILLed it in the end, and spark-submit (in a session of its own) trained on with
nobody to stop it. So ``on_kill`` sends its signals and waits without logging, and what it has to
say, with the provider's own cluster-side kill (which logs too), runs on a thread of its own.

Airflow 3's supervisor SIGKILLs the task's process 5 s after its SIGTERM, so the SIGKILL that ends
a spark-submit group still running after ``kill_grace_seconds`` is sent by a reaper process
(:mod:`sparkdl_airflow.reaper`), which outlives the task.

Airflow 3's handler only calls ``on_kill``: the task then goes on where the signal interrupted it.
A kill that lands before spark-submit has started (while the operator renders its arguments, in a
``pre_execute``) finds nothing to stop, and the task would then start spark-submit, in a session
that Airflow's SIGKILL of the task does not reach: a job trained on for a task already killed. So
the kill is recorded first (:attr:`SessionSparkSubmitHook.task_killed`, which the operator points
at its own record, set even before this hook exists); ``submit`` refuses to start spark-submit
after it, and a kill that lands while spark-submit is starting (after that check, before the hook
knows the process) stops its session as soon as the output loop begins.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.sdk.exceptions import AirflowException

from sparkdl_airflow.reaper import KILLED

#: How often the main thread comes back from waiting for spark-submit's next line, so that a
#: pending signal handler runs (Python runs it only when the main thread runs bytecode).
OUTPUT_POLL_SECONDS = 0.5
_END = object()  # spark-submit's output ended
#: What the reaper may take beyond its grace period: its start, a poll, the SIGKILL.
REAPER_MARGIN_SECONDS = 5.0


class NotSubmitted(AirflowException):
    """The task was killed before spark-submit started, so it was not started."""


class SessionSparkSubmitHook(SparkSubmitHook):
    """The provider's hook, but spark-submit starts a session of its own, so that a kill reaches
    the driver and every process under it (the hook's own kill signals spark-submit alone, and a
    Python driver outlives its JVM parent)."""

    kill_grace_seconds: float = 20.0
    #: Whether the task has been killed, by this hook's on_kill or before the hook existed (the
    #: operator sets it to its own record).
    task_killed: Callable[[], bool] = staticmethod(lambda: False)
    _killed = False
    _after_kill: Optional[threading.Thread] = None
    _stop_claim: Optional[threading.Lock] = None

    def submit(self, application: str = "", **kwargs: Any) -> Optional[str]:
        if self._kill_requested():
            raise NotSubmitted("sparkdl: the task was killed before spark-submit started; nothing was submitted")
        # Made before spark-submit exists, so a kill (which needs the process) always finds it.
        self._stop_claim = threading.Lock()
        kwargs.setdefault("start_new_session", True)
        return super().submit(application, **kwargs)

    def _kill_requested(self) -> bool:
        return self._killed or self.task_killed()

    def _process_spark_submit_log(self, itr: Iterator[Any]) -> None:
        # The provider reads spark-submit's output on the main thread, blocked in read() until the
        # next line: a SIGTERM landing on another thread of the task's process (it has several:
        # the supervisor's comms, an event loop) had its handler, and so on_kill, wait for a line
        # that a job printing nothing more never wrote. A thread reads the lines instead; the main
        # thread takes them from a queue, waking at least every OUTPUT_POLL_SECONDS.
        if self._kill_requested():  # a kill landed while spark-submit was starting: it found no process
            self._stop_once(self._submit_sp)
        lines: "queue.Queue[Any]" = queue.Queue()
        threading.Thread(target=_pump, args=(itr, lines), name="spark-submit-output", daemon=True).start()
        try:
            super()._process_spark_submit_log(_polled(lines))
        finally:
            if self._after_kill is not None:  # the kill's report and cluster-side kill come before the task's failure
                self._after_kill.join()

    def on_kill(self) -> None:
        # Called from Airflow's SIGTERM handler: no logging here (see the module's docstring).
        # Signals, waits and starting a process (no preexec_fn: no fork hooks, no import lock)
        # take no lock that the interrupted main thread may hold.
        self._killed = True  # first: submit() starts nothing after this
        process = getattr(self, "_submit_sp", None)
        if process is not None:  # else spark-submit has not started, or the output loop stops it
            self._stop_once(process)

    def _stop_once(self, process: subprocess.Popen) -> None:
        """Stops spark-submit's session and starts the report and the cluster-side kill, once: a
        second SIGTERM, or the handler running inside the output loop's own call, does nothing."""
        claim = self._stop_claim
        if claim is None or not claim.acquire(blocking=False):  # never blocks: safe in a signal handler
            return
        stopped = stop_session(process, self.kill_grace_seconds) if process.poll() is None else None
        # Not a daemon: the task's process does not exit before the report and the cluster side are done.
        self._after_kill = threading.Thread(
            target=self._report_and_kill_cluster_side, args=(process, stopped), name="sparkdl-after-kill"
        )
        self._after_kill.start()

    def _report_and_kill_cluster_side(self, process: subprocess.Popen, stopped: Optional[Stopped]) -> None:
        if stopped is not None:
            outcome = f"exited with {stopped.exit_code}" if stopped.exit_code is not None else "still running"
            self.log.info(
                "sparkdl: the task was killed; stopped spark-submit (pid %d) and the processes of its group: "
                "%s, %s after %.1f s (kill_grace_seconds=%g)",
                process.pid,
                stopped.signals,
                outcome,
                stopped.seconds,
                self.kill_grace_seconds,
            )
        super().on_kill()  # the cluster side: YARN application, Kubernetes pod, standalone driver


class Stopped(NamedTuple):
    signals: str  # "SIGTERM", or "SIGTERM, then SIGKILL after 20 s"
    seconds: float
    exit_code: Optional[int]  # spark-submit's; None: still running when the wait ended


def stop_session(process: subprocess.Popen, grace_seconds: float) -> Stopped:
    """SIGTERM to the process group of ``process`` (a session leader), and SIGKILL to it if a
    process of it is still running ``grace_seconds`` later, sent by a reaper process
    (:mod:`sparkdl_airflow.reaper`) that outlives this one. Logs nothing and waits with bounded
    polls only, so that a signal handler may call it."""
    started = time.monotonic()
    reaper = _start_reaper(process.pid, grace_seconds)  # before SIGTERM: the group is surely still there
    _signal_group(process.pid, signal.SIGTERM)
    deadline = started + grace_seconds + REAPER_MARGIN_SECONDS
    code = _wait(process, deadline - time.monotonic())
    verdict = _wait(reaper, deadline - time.monotonic()) if reaper is not None else None
    if verdict not in (0, KILLED):  # no reaper, or it failed: escalate from here
        _signal_group(process.pid, signal.SIGKILL)
        code = _wait(process, REAPER_MARGIN_SECONDS) if code is None else code
        verdict = KILLED
    signals = "SIGTERM" if verdict == 0 else f"SIGTERM, then SIGKILL after {grace_seconds:g} s"
    return Stopped(signals, time.monotonic() - started, code)


def _start_reaper(pgid: int, grace_seconds: float) -> Optional[subprocess.Popen]:
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "sparkdl_airflow.reaper", str(pgid), repr(float(grace_seconds))],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # none of the task's pipes: its log ends when the task does
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the task's group, which Airflow's supervisor may kill
        )
    except OSError:
        return None


def _wait(process: subprocess.Popen, timeout: float) -> Optional[int]:
    try:
        return process.wait(timeout=max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        return None


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the whole group has exited already
        pass


def _pump(itr: Iterator[Any], lines: "queue.Queue[Any]") -> None:
    try:
        for line in itr:
            lines.put(line)
    finally:
        lines.put(_END)


def _polled(lines: "queue.Queue[Any]") -> Iterator[Any]:
    """The lines :func:`_pump` queued, in order, until the end; between them the main thread
    returns to Python every OUTPUT_POLL_SECONDS, so that a pending signal handler runs."""
    while True:
        try:
            line = lines.get(timeout=OUTPUT_POLL_SECONDS)
        except queue.Empty:
            continue
        if line is _END:
            return
        yield line
