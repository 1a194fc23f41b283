"""Peak resident memory of the executors' Python workers during one measured run, from /proc.

In ``local-cluster`` the executor JVMs are children of the driver's JVM, itself a child of this
process; each executor starts ``python -m pyspark.daemon``, which forks the Python workers that
run the tasks (and are reused by later tasks). So the workers this run started are the
descendants of this process whose parent is a ``pyspark.daemon``. Before a measured run their
peak (``VmHWM``) is reset to their current RSS (``echo 5 > /proc/PID/clear_refs``, Linux >= 4.0);
after it, the largest ``VmHWM`` of any worker is that run's peak. Pages shared with the daemon
(copy-on-write after the fork) count in each worker's RSS, as ``ps`` shows them.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional


def _parents() -> Dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return parents


def _is_daemon(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"pyspark.daemon" in f.read()
    except OSError:
        return False


def python_workers(root: Optional[int] = None) -> List[int]:
    """The pids of the Python workers among the descendants of ``root`` (this process)."""
    parents = _parents()
    root = os.getpid() if root is None else root
    descendants, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    return sorted(pid for pid in descendants if _is_daemon(parents[pid]) and _is_daemon(pid))


def reset_peaks(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # exited meanwhile


def peak_mib(pid: int) -> Optional[float]:
    """``VmHWM`` of ``pid`` in MiB (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class WorkerPeak:
    """``with WorkerPeak() as peak: ...`` then ``peak.mib``: the largest peak RSS of any executor
    Python worker during the block (None when no worker was found); ``peak.workers``: how many."""

    def __init__(self) -> None:
        self.mib: Optional[float] = None
        self.workers = 0
        self._before: List[int] = []

    def __enter__(self) -> "WorkerPeak":
        self._before = python_workers()
        reset_peaks(self._before)
        return self

    def __exit__(self, *exc_info) -> None:
        pids = set(self._before) | set(python_workers())
        peaks = [mib for mib in map(peak_mib, pids) if mib is not None]
        self.workers = len(peaks)
        self.mib = max(peaks) if peaks else None


class OwnPeak:
    """The same for this process (the plain loop runs in it)."""

    def __enter__(self) -> "OwnPeak":
        reset_peaks([os.getpid()])
        self.mib: Optional[float] = None
        return self

    def __exit__(self, *exc_info) -> None:
        self.mib = peak_mib(os.getpid())
