"""``sparkdl.report``: metrics from anywhere inside a task to the driver's progress display.

Inside a task's own process (a ``sparkdl.run`` function) the task registers itself as the
*current task* (:func:`current_task`, set and cleared by :mod:`sparkdl._task.entry`) and a
report goes through its channel client. In a child process of ``sparkdl.launch`` (a script or a
callable) a report is one JSON line on a pipe the child inherited (``SPARKDL_REPORT_FD``), which
the task reads and forwards (:mod:`sparkdl._task.script`). Either way it counts as progress
for the hang watchdog. Outside any sparkdl task (the same script under plain ``torchrun``) a
report is dropped, with one warning, so such scripts run unchanged there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from typing import Any, Callable, Dict, Iterator, Optional

__all__ = ["CurrentTask", "current_task", "report"]

#: The environment variable naming the inherited pipe a launched child reports on.
REPORT_FD = "SPARKDL_REPORT_FD"
#: A report line stays below PIPE_BUF, so concurrent writers (DataLoader workers) never interleave.
MAX_REPORT_BYTES = 4000


@dataclasses.dataclass(frozen=True)
class CurrentTask:
    """The task this process runs now: where reports go and how progress is counted.

    Attributes:
        rank: the task's rank.
        send: sends one channel message to the driver.
        advance: counts progress for the watchdog (and names the phase when given one).
        context: the :class:`~sparkdl.TrainContext` of a ``sparkdl.run`` function, else None.
    """

    rank: int
    send: Callable[[Dict[str, Any]], None]
    advance: Callable[[Optional[str]], None]
    context: Any = None


_current: Optional[CurrentTask] = None
_warned = False


@contextlib.contextmanager
def current_task(task: CurrentTask) -> Iterator[CurrentTask]:
    """Registers ``task`` as this process's current task while the user's code runs."""
    global _current
    previous, _current = _current, task
    try:
        yield task
    finally:
        _current = previous


def get_current_task() -> Optional[CurrentTask]:
    """The current task of this process, or None (outside a task, or in a launched child)."""
    return _current


def report(**metrics: Any) -> None:
    """Sends metrics (numbers and strings) to the driver's progress display.

    Works anywhere inside a sparkdl task: a ``sparkdl.run`` function, a ``sparkdl.launch``
    callable or script (DataLoader workers included). The driver prints
    ``[sparkdl rank R] name=value ...`` and passes ``{"rank": R, **metrics}`` to a
    ``progress=`` callable. Each report also counts as progress for ``watchdog_timeout_s``.
    Outside a sparkdl task it does nothing (one warning), so a script runs unchanged under
    plain ``torchrun``.

    Raises:
        TypeError: a value is not a number, a string, a bool, None or a one-element tensor.
    """
    message = {"kind": "metrics", "metrics": jsonable(metrics)}
    task = _current
    if task is not None:
        task.send(message)
        task.advance(None)
        return
    if not _send_to_parent(message):
        _warn_once()


def notify_progress(phase: str) -> None:
    """Counts progress for the watchdog from wherever the caller runs (no-op outside a task)."""
    task = _current
    if task is not None:
        task.advance(phase)
    else:
        _send_to_parent({"kind": "progress", "phase": phase})


def _send_to_parent(message: Dict[str, Any]) -> bool:
    fd = os.environ.get(REPORT_FD)
    if not fd:
        return False
    line = json.dumps(message, separators=(",", ":")).encode("utf-8") + b"\n"
    if len(line) > MAX_REPORT_BYTES:
        raise ValueError(f"sparkdl.report: {len(line)} bytes of metrics; keep a report under {MAX_REPORT_BYTES} bytes")
    try:
        os.write(int(fd), line)
    except OSError:  # the task stopped reading: it is ending, and this process with it
        pass
    return True


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("sparkdl.report() outside a sparkdl task: the metrics go nowhere", RuntimeWarning, stacklevel=3)


def jsonable(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """Metrics as JSON values: tensors and numpy scalars become numbers; anything else fails."""
    out: Dict[str, Any] = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and callable(value.item) and not isinstance(value, (int, float, str, bool)):
            value = value.item()  # a one-element tensor or a numpy scalar
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise TypeError(f"metric {key!r} has type {type(value).__name__}; report numbers or strings")
        out[str(key)] = value
    return out
