"""spark-submit as a child of ``sparkdl submit``: its output streamed, its exit status returned,
and a signal to ``sparkdl submit`` passed on so that nothing it started is left running.

spark-submit runs in a session of its own, so that one signal reaches it and every process under
it: a Python driver outlives its JVM parent, and Spark's Python workers are its grandchildren.
SIGTERM first (spark-submit's shutdown hooks stop the SparkContext), SIGKILL after
:data:`KILL_GRACE_S` or at a second signal. In cluster deploy mode on a standalone master the
driver runs on a worker, not under spark-submit: it is killed through the master
(``org.apache.spark.deploy.Client kill``) before spark-submit is stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Iterator, List, Optional, Tuple

#: From SIGTERM to SIGKILL of spark-submit's process group.
KILL_GRACE_S = 15.0
#: How long a killed cluster driver may take to be reported gone: spark-submit's client asks the
#: master every 10 s (a constant of Spark's ClientEndpoint).
DRIVER_GONE_WAIT_S = 30.0
#: The master's answer to ``Client kill`` (a JVM start and one message).
KILL_COMMAND_TIMEOUT_S = 60.0
#: No event says that a process group has emptied: a short poll, bounded by the grace period.
POLL_S = 0.1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_SUBMITTED = re.compile(r"Driver successfully submitted as (\S+)")
_RUNNING_ON = re.compile(r"Driver running on (\S+) \((\S+)\)")
_FINAL = re.compile(r"State of driver (\S+) is (\w+), exiting spark-submit JVM")
_NOT_WAITING = "not configured to wait for completion"


@dataclasses.dataclass
class ClusterDriver:
    """The driver spark-submit hands to a standalone master in cluster deploy mode, as
    spark-submit's log (Spark's ``ClientEndpoint``) tells of it: its id, worker and final state."""

    master: str
    spark_class: str
    #: ``spark.standalone.submit.waitAppCompletion``: spark-submit waits for the driver to end.
    waits: bool = True
    #: Whether spark-submit's log shows ClientEndpoint's INFO lines (sparkdl submit set its log4j
    #: configuration); without them the driver's end is unknown here.
    reads_log: bool = True
    driver_id: Optional[str] = None
    address: Optional[str] = None
    worker: Optional[str] = None
    state: Optional[str] = None

    def read(self, line: str) -> None:
        """Takes what one line of spark-submit's output says about the driver."""
        if match := _SUBMITTED.search(line):
            self.driver_id = match.group(1)
        elif match := _RUNNING_ON.search(line):
            self.address, self.worker = match.groups()
        elif match := _FINAL.search(line):
            self.driver_id, self.state = match.groups()

    def outcome(self, returncode: int) -> Tuple[int, str]:
        """The exit status of ``sparkdl submit`` and the line that says why, once spark-submit
        ended with ``returncode`` (0 even when the driver failed: Spark's client reports only)."""
        where = f" on {self.address} ({self.worker})" if self.worker else ""
        if self.state is not None:
            status = 0 if self.state == "FINISHED" else 1
            return status, (
                f"sparkdl submit: driver {self.driver_id} ran{where} and ended {self.state}; its output is in "
                f"that worker's work directory ({self.driver_id}/stdout, stderr)"
            )
        if self.driver_id and not self.waits:
            return 0, (
                f"sparkdl submit: driver {self.driver_id} submitted{where}; spark-submit did not wait for it "
                "(spark.standalone.submit.waitAppCompletion=false); the staged files stay"
            )
        if returncode != 0:
            return (
                returncode,
                f"sparkdl submit: spark-submit exited {returncode} (driver {self.driver_id or 'not submitted'})",
            )
        if self.reads_log:
            return 1, "sparkdl submit: spark-submit ended without saying how the driver ended (see its output above)"
        return returncode, (
            "sparkdl submit: the exit status is spark-submit's, not the driver's: SPARK_SUBMIT_OPTS names a log4j "
            "configuration, which hides how the driver ended"
        )


class _Signals:
    """SIGINT, SIGTERM and SIGHUP while spark-submit runs, recorded for the main thread's wait
    loop (a handler that raised could land inside ``Popen`` and lose the child it started); a
    second one skips the grace period."""

    def __init__(self) -> None:
        self.received: List[int] = []

    def _handle(self, signum: int, _frame: object) -> None:
        self.received.append(signum)

    @contextlib.contextmanager
    def forwarding(self) -> Iterator["_Signals"]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers belong to the main thread; a caller elsewhere keeps its own
            return
        previous = {signum: signal.signal(signum, self._handle) for signum in FORWARDED}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def run_spark_submit(command: List[str], env: dict, driver: Optional[ClusterDriver] = None) -> int:
    """Runs ``command`` (spark-submit) to its end and returns ``sparkdl submit``'s exit status:
    spark-submit's own, the cluster driver's outcome, or 128 + a signal's number."""
    signals = _Signals()
    with signals.forwarding():
        piped = subprocess.PIPE if driver is not None else None
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=piped,
            stderr=piped,
            start_new_session=True,
            preexec_fn=_end_with_parent,
        )
        readers = []
        if driver is not None:
            readers = [_tee(process.stdout, sys.stdout, driver), _tee(process.stderr, sys.stderr, driver)]
        while not signals.received:
            try:
                returncode = process.wait(POLL_S)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            return _stop(process, driver, signals.received[0], signals, readers)
        for reader in readers:
            reader.join()
        _end_group(process, signals)  # a Python driver that outlived its JVM, say
    if driver is None:
        return returncode
    status, summary = driver.outcome(returncode)
    print(summary, file=sys.stderr, flush=True)
    return status


def _end_with_parent() -> None:
    """In spark-submit's process, before it runs: SIGTERM when ``sparkdl submit`` dies, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def _stop(process: subprocess.Popen, driver, signum: int, signals: _Signals, readers) -> int:
    if driver is not None and driver.driver_id and driver.state is None and len(signals.received) < 2:
        killed = _kill_cluster_driver(driver)
        # spark-submit's client sees the driver gone at its next poll and exits by itself.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(DRIVER_GONE_WAIT_S if killed else 0)
    _end_group(process, signals)
    process.wait()
    for reader in readers:
        reader.join(5.0)
    if driver is not None and driver.state is not None:
        print(driver.outcome(0)[1], file=sys.stderr, flush=True)
    name = signal.Signals(signum).name
    print(f"sparkdl submit: {name}: stopped spark-submit and every process it started", file=sys.stderr, flush=True)
    return 128 + signum


def _kill_cluster_driver(driver: ClusterDriver) -> bool:
    """Asks the master to kill the driver (Spark's ``org.apache.spark.deploy.Client kill``: no REST
    server needed); True once it answered. Its log is shown only when it failed."""
    command = [driver.spark_class, "org.apache.spark.deploy.Client", "kill", driver.master, driver.driver_id or ""]
    print(f"sparkdl submit: killing driver {driver.driver_id} on {driver.master}", file=sys.stderr, flush=True)
    killer = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = killer.communicate(timeout=KILL_COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_group(killer, _Signals())
        output, _ = killer.communicate()
    if killer.returncode == 0 and b"Kill request for" in output:
        return True
    tail = output.decode(errors="replace").strip().splitlines()[-10:]
    print(
        f"sparkdl submit: could not kill driver {driver.driver_id} (exit {killer.returncode}); kill it with "
        f"spark-submit --kill {driver.driver_id} --master {driver.master} (Spark's REST server) or from the master's "
        "web UI:\n" + "\n".join(tail),
        file=sys.stderr,
        flush=True,
    )
    return False


def _end_group(leader: subprocess.Popen, signals: _Signals) -> None:
    """SIGTERM to every live process of the group that ``leader`` leads, SIGKILL to those left
    after :data:`KILL_GRACE_S` (at once after a second signal)."""
    pgid = leader.pid
    if not group_members(pgid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline and len(signals.received) < 2:
        leader.poll()  # our own child: collected once it exited, so that it stops counting
        if not group_members(pgid):
            return
        time.sleep(POLL_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def group_members(pgid: int) -> List[int]:
    """The live (not zombie) processes of group ``pgid``: from /proc, else whether the group exists."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()  # after the command, which may hold anything
            except OSError:
                continue
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def _tee(stream: IO[bytes], target: IO[str], driver: Optional[ClusterDriver]) -> threading.Thread:
    """A thread that copies ``stream`` to ``target`` line by line as it comes, and shows each line
    to ``driver``."""

    def copy() -> None:
        out = getattr(target, "buffer", None)
        for raw in iter(stream.readline, b""):
            if out is not None:
                out.write(raw)
                out.flush()
            else:
                target.write(raw.decode(errors="replace"))
                target.flush()
            if driver is not None:
                driver.read(raw.decode(errors="replace"))
        stream.close()

    thread = threading.Thread(target=copy, name="spark-submit-output", daemon=True)
    thread.start()
    return thread
