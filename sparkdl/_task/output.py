"""A rank's output in its task: stdout and stderr prefixed with the rank, its log records and
printed lines forwarded to the driver over the channel (without sending a record twice)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from typing import Any, Callable, Optional

from sparkdl._net.channel import ChannelClient
from sparkdl._task.script import OutputForwarder

#: Set while a sparkdl log record is written to stderr: the record reaches the driver as a
#: "log" message already, so its line is not forwarded as output too.
_writing_log = threading.local()


class _PrefixedWriter(io.TextIOBase):
    """Prefixes every line with the rank, so interleaved executor logs stay readable; while
    ``forward`` is set (the user's function runs) complete lines also go to it."""

    def __init__(self, target: Any, prefix: str, stream: str) -> None:
        self._target = target
        self._prefix = prefix
        self._stream = stream
        self._at_line_start = True
        self._lock = threading.Lock()
        self.forward: Optional[Callable[[str, str], None]] = None
        self._partial = ""

    def write(self, text: str) -> int:
        with self._lock:
            out = []
            for piece in text.splitlines(keepends=True):
                if self._at_line_start:
                    out.append(self._prefix)
                out.append(piece)
                self._at_line_start = piece.endswith("\n")
            self._target.write("".join(out))
            if self.forward is not None and not getattr(_writing_log, "active", False):
                *lines, self._partial = (self._partial + text).split("\n")
                for line in lines:
                    self.forward(self._stream, line)
        return len(text)

    def end_forwarding(self) -> None:
        """Forwards a last line without its newline, then stops forwarding."""
        with self._lock:
            if self.forward is not None and self._partial:
                self.forward(self._stream, self._partial)
            self.forward, self._partial = None, ""

    def flush(self) -> None:
        self._target.flush()


@contextlib.contextmanager
def rank_prefixed_output(rank: int, quiet: bool = False):
    saved = sys.stdout, sys.stderr
    sink = open(os.devnull, "w") if quiet else None  # noqa: SIM115 - closed below
    sys.stdout = _PrefixedWriter(sink or saved[0], f"[sparkdl rank {rank}] ", "stdout")
    sys.stderr = _PrefixedWriter(sink or saved[1], f"[sparkdl rank {rank}] ", "stderr")
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
        if sink is not None:
            sink.close()


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
def output_to_driver(client: ChannelClient):
    """What the user's function prints reaches the driver too (batched "output" messages, shown
    prefixed with the rank), as a launched script's output does."""
    writers = [w for w in (sys.stdout, sys.stderr) if isinstance(w, _PrefixedWriter)]
    forwarder = OutputForwarder(client.send)
    for writer in writers:
        writer.forward = forwarder.add
    try:
        yield
    finally:
        for writer in writers:
            writer.end_forwarding()
        forwarder.close()


class _LogToStderr(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        _writing_log.active = True
        try:
            super().emit(record)
        finally:
            _writing_log.active = False


@contextlib.contextmanager
def forward_logs(client: ChannelClient, rank: int):
    """Records of the ``sparkdl`` loggers go to the task's stderr and to the driver."""
    root = logging.getLogger("sparkdl")
    to_driver = _ChannelLogHandler(client)
    to_stderr = _LogToStderr(sys.stderr)
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
