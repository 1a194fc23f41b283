"""Task side of ``sparkdl.launch``: run the target in a child process of the task and watch it.

The task has joined the launch's store and selected its device; it creates no process group.
It starts ``python -m sparkdl._task.runner DIR`` with the torchrun environment
(:mod:`~sparkdl._task.environment`), ``CUDA_VISIBLE_DEVICES`` = the task's GPUs and
``PYTHONPATH`` = the task's ``sys.path`` (so the child imports what the task imports, ``--py-files``
included). ``DIR`` is a private directory (0700) holding what the child needs as 0600 files:
the spec, the pickled callable, the data payload; the secret goes through an inherited pipe,
never a command line or a file. The child's stdout and stderr are read here, prefixed with the
rank, written to the executor's log and forwarded to the driver (``"output"`` messages); its
reports arrive on a second pipe. Output, reports and batches count as progress for the watchdog.

Hygiene: the child runs in its own session (its process group is killed when it ends, fails or
the task fails), and it dies with the task's process (``PR_SET_PDEATHSIG``, set by the runner).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from sparkdl.errors import ConfigError

#: Lines of each rank's output kept for its error and for rank 0's ScriptResult.
LAST_LINES = 20
#: The longest line forwarded to the driver (longer ones are cut).
MAX_LINE_CHARS = 8000
#: One "output" message stays well below the channel's 1 MiB frame limit.
_MAX_BATCH_CHARS = 256 * 1024


@dataclasses.dataclass(frozen=True)
class ScriptResult:
    """What ``sparkdl.launch("script.py", ...)`` returns: rank 0's exit status (0: a rank that
    exits non-zero fails the launch) and its last lines of output: stdout and stderr in the order
    they were read (two pipes, so lines written to both at nearly the same time may swap)."""

    exit_code: int
    last_lines: Tuple[str, ...]

    @property
    def output(self) -> str:
        """The last lines as one text."""
        return "\n".join(self.last_lines)


@dataclasses.dataclass(frozen=True)
class LaunchTarget:
    """What every task of a launch runs in its child: a script or a pickled callable.

    Attributes:
        kind: ``"script"`` or ``"callable"``.
        name: how messages name it (the script path, or ``module.qualname``).
        script: the script path as given; ``script_abspath`` the driver's absolute path for it
            when the driver has the file (local clusters, shared filesystems).
        args: the script's arguments (strings).
        pickled: ``cloudpickle`` bytes of ``(callable, args)``; unpickled only in the child.
        run_id: ``TORCHELASTIC_RUN_ID``. max_restarts: ``TORCHELASTIC_MAX_RESTARTS`` (max_failures).
    """

    kind: str
    name: str
    run_id: str
    script: Optional[str] = None
    script_abspath: Optional[str] = None
    args: Tuple[str, ...] = ()
    pickled: Optional[bytes] = None
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("script", "callable"):
            raise ConfigError(f"launch target kind={self.kind!r} must be 'script' or 'callable'")


class ChildFailure(Exception):
    """The child failed; the rank reports ``exc_type``, the message and the child's traceback."""

    def __init__(self, exc_type: str, message: str, child_traceback: str = "") -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.child_traceback = child_traceback


def resolve_script(target: LaunchTarget, rank: int, host: str) -> str:
    """The script's path on this executor: as given, the driver's absolute path, or a file
    Spark shipped (``--files`` / ``sc.addFile``). Fails naming rank, host, path and the fix."""
    path = target.script or ""
    candidates = [path] if os.path.isabs(path) else [path, target.script_abspath]
    if not os.path.isabs(path):
        with contextlib.suppress(Exception):
            from pyspark import SparkFiles

            candidates.append(SparkFiles.get(os.path.basename(path)))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ConfigError(
        f"rank {rank} on host {host} cannot see the launch script {path!r} (looked in the working directory "
        f"{os.getcwd()!r}{', at ' + repr(target.script_abspath) if target.script_abspath else ''} and among the files Spark "
        f"shipped): every executor needs it. Ship it with spark-submit --files {os.path.basename(path)} or "
        f"sc.addFile({path!r}) and pass its file name, or put it on a filesystem every executor mounts"
    )


def run_child(
    target: LaunchTarget,
    *,
    rank: int,
    host: str,
    script_path: Optional[str],
    env: Dict[str, str],
    secret: bytes,
    spec: Dict[str, Any],
    data: Optional[Dict[str, Any]],
    send: Callable[[Dict[str, Any]], None],
    advance: Callable[[Optional[str]], None],
) -> Any:
    """Runs the target in a child process and returns its result (rank 0's matters).

    Raises:
        ChildFailure: the child exited non-zero (a callable's exception, with its type and
            traceback), or the callable could not be unpickled there.
    """
    child = _Child(send)
    try:
        child_spec = dict(spec, kind=target.kind, name=target.name, script=script_path, args=list(target.args))
        child_env = _write_inputs(child.workdir, target, child_spec, env, data)
        child.start(child_env, secret)
        child.pump(send, advance)
        code = child.process.wait()
    finally:
        result = child.close()
    return _outcome(target, rank, host, code, tuple(child.last), result)


class _Child:
    """One launch's child process and what this task holds of it: its private directory, the
    ends of its pipes still open here, the threads that read it. ``close`` releases all of it,
    also after a failure, and returns what the child left in its directory."""

    def __init__(self, send: Callable[[Dict[str, Any]], None]) -> None:
        self.workdir = tempfile.mkdtemp(prefix="sparkdl-launch-")  # 0700: this user only
        self.process: Optional[subprocess.Popen] = None
        self.last: Deque[str] = collections.deque(maxlen=LAST_LINES)
        self._open_fds: List[int] = []
        self._report_read = -1
        self._pumps: List[threading.Thread] = []
        self._forwarder = OutputForwarder(send)

    def _pipe(self) -> Tuple[int, int]:
        read, write = os.pipe()
        self._open_fds += [read, write]
        return read, write

    def _close(self, fd: int) -> None:
        os.close(fd)
        self._open_fds.remove(fd)

    def start(self, child_env: Dict[str, str], secret: bytes) -> None:
        """Starts the runner in its own session, the secret on one inherited pipe, its reports on another."""
        secret_read, secret_write = self._pipe()
        os.write(secret_write, secret)  # 32 bytes: far below a pipe's buffer, so this never blocks
        self._close(secret_write)
        self._report_read, report_write = self._pipe()
        child_env.update(
            SPARKDL_SECRET_FD=str(secret_read), SPARKDL_REPORT_FD=str(report_write), SPARKDL_PARENT_PID=str(os.getpid())
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sparkdl._task.runner", self.workdir],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env,
            pass_fds=(secret_read, report_write),
            start_new_session=True,
            close_fds=True,
        )
        self._close(secret_read)
        self._close(report_write)

    def pump(self, send: Callable[[Dict[str, Any]], None], advance: Callable[[Optional[str]], None]) -> None:
        """Threads that read the child's output and its reports until it closes them."""
        lock = threading.Lock()
        for stream, pipe, local in (
            ("stdout", self.process.stdout, sys.stdout),
            ("stderr", self.process.stderr, sys.stderr),
        ):
            self._pumps.append(_start(_pump_output, pipe, stream, local, self.last, lock, self._forwarder, advance))
        reports = os.fdopen(self._report_read, "rb")
        self._open_fds.remove(self._report_read)  # the file object owns it now
        self._pumps.append(_start(_pump_reports, reports, send, advance))

    def close(self) -> Dict[str, Any]:
        """Closes this side's pipes, kills the child's group, waits for the readers; the outcome."""
        for fd in self._open_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.process is not None:
            kill_group(self.process)  # what the child left behind (DataLoader workers...) ends with it
        for pump in self._pumps:
            pump.join(timeout=10)
        self._forwarder.close()
        result = _read_outcome(self.workdir)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return result


def _write_inputs(
    workdir: str, target: LaunchTarget, child_spec: Dict[str, Any], env: Dict[str, str], data: Optional[Dict[str, Any]]
) -> Dict[str, str]:
    """The child's files (0600, in its 0700 directory): the spec, the pickled callable, the data
    payload; the child's environment, which names the data file."""
    import cloudpickle

    _private_file(workdir, "spec.json", json.dumps(child_spec).encode("utf-8"))
    if target.kind == "callable":
        _private_file(workdir, "target.pkl", target.pickled or b"")
    child_env = dict(env)
    if data is not None:
        child_env["SPARKDL_SHARD_DATA"] = _private_file(workdir, "data.pkl", cloudpickle.dumps(data))
    return child_env


def _outcome(
    target: LaunchTarget, rank: int, host: str, code: int, lines: Tuple[str, ...], result: Dict[str, Any]
) -> Any:
    """The child's exit status and what it left, as run_child's value or its ChildFailure."""
    if code != 0:
        raise _failure(target, rank, host, code, lines, result)
    if target.kind == "callable":
        if rank != 0:  # only rank 0's value comes back, so only rank 0 writes one
            return None
        if "value" not in result:
            raise ChildFailure(
                "LaunchError", f"the launched function {target.name} on rank {rank} returned no result file"
            )
        return result["value"]
    return ScriptResult(0, lines)


def kill_group(process: subprocess.Popen) -> None:
    """Kills the child's process group (its session) and reaps the child."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.wait(timeout=30)


def _failure(
    target: LaunchTarget, rank: int, host: str, code: int, lines: Sequence[str], result: Dict[str, Any]
) -> ChildFailure:
    error = result.get("error")
    if error is not None:  # a callable raised (or could not be unpickled): its own type and traceback
        return ChildFailure(
            str(error.get("exc_type", "Exception")), str(error.get("message", "")), str(error.get("traceback", ""))
        )
    status = (
        f"was killed by signal {signal.Signals(-code).name}"
        if code < 0 and -code in signal.Signals._value2member_map_
        else f"exited with status {code}"
    )
    shown = "\n".join(f"  | {line}" for line in lines) if lines else "  (no output)"
    what = f"the launched script {target.name}" if target.kind == "script" else f"the launched function {target.name}"
    return ChildFailure(
        "ScriptExitError", f"{what} {status} on rank {rank} (host {host}); its last lines of output:\n{shown}"
    )


def _read_outcome(workdir: str) -> Dict[str, Any]:
    """What the runner left: ``error.json`` (a callable's exception) or ``result.pkl`` (its value)."""
    outcome: Dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(workdir, "error.json"), "rb") as handle:
            outcome["error"] = json.loads(handle.read().decode("utf-8"))
    path = os.path.join(workdir, "result.pkl")
    if os.path.exists(path):
        import cloudpickle

        # Written by this task's own child, in its 0700 directory: a local file, never the network.
        with open(path, "rb") as handle:
            outcome["value"] = cloudpickle.load(handle)
    return outcome


def _private_file(directory: str, name: str, content: bytes) -> str:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)
    return path


def _start(target: Callable[..., None], *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name="sparkdl-launch-pump", daemon=True)
    thread.start()
    return thread


def _pump_output(
    pipe: Any,
    stream: str,
    local: Any,
    last: Deque[str],
    lock: threading.Lock,
    forwarder: "OutputForwarder",
    advance: Callable[[Optional[str]], None],
) -> None:
    """The child's lines: to the task's own (rank-prefixed) stream, the ring of last lines and
    the driver."""
    with pipe:
        while True:
            raw = pipe.readline(1 << 16)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            with lock:
                last.append(line[:MAX_LINE_CHARS])
            with contextlib.suppress(Exception):
                local.write(line + "\n")
                local.flush()
            forwarder.add(stream, line[:MAX_LINE_CHARS])
            advance(None)


def _pump_reports(pipe: Any, send: Callable[[Dict[str, Any]], None], advance: Callable[[Optional[str]], None]) -> None:
    """The child's reports (JSON lines): metrics to the driver, progress to the watchdog."""
    with pipe:
        for raw in pipe:
            try:
                message = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue  # a torn line from a dying child: nothing to forward
            if not isinstance(message, dict):
                continue
            if message.get("kind") == "metrics" and isinstance(message.get("metrics"), dict):
                with contextlib.suppress(Exception):
                    send({"kind": "metrics", "metrics": message["metrics"]})
                advance(None)
            elif message.get("kind") == "progress":
                advance(str(message.get("phase", ""))[:200] or None)


class OutputForwarder:
    """Batches output lines into few channel messages (every 0.1 s, or 200 lines)."""

    def __init__(self, send: Callable[[Dict[str, Any]], None], interval_s: float = 0.1, max_lines: int = 200) -> None:
        self._send, self._interval_s, self._max_lines = send, interval_s, max_lines
        self._lines: List[List[str]] = []
        self._chars = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sparkdl-output", daemon=True)
        self._thread.start()

    def add(self, stream: str, line: str) -> None:
        with self._cond:
            self._lines.append([stream, line])
            self._chars += len(line)
            if len(self._lines) >= self._max_lines or self._chars >= _MAX_BATCH_CHARS:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed and len(self._lines) < self._max_lines and self._chars < _MAX_BATCH_CHARS:
                    self._cond.wait(self._interval_s)
                lines, self._lines, self._chars, closed = self._lines, [], 0, self._closed
            if lines:
                with contextlib.suppress(Exception):  # the driver's channel is gone: the task ends anyway
                    self._send({"kind": "output", "lines": lines})
            if closed:
                return

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)
