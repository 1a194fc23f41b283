"""CPU seconds of a benchmark side: user + system time of this process and all its descendants,
sampled from /proc while the side runs.

Every ``interval`` (0.2 s) the sampler walks the tree from this process and keeps, for each
process it has seen (pid and start time), its latest ``utime + stime``; a process that ended keeps
its last sampled figure. The reaped-children fields (``cutime``) are not used: PySpark's daemon
ignores SIGCHLD (its Python workers' times are discarded by the kernel) and a killed raylet's
workers are reaped elsewhere, so they would lose CPU. What this misses: a process that lives less
than one interval, and each process's last interval. This process becomes a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so that a descendant whose parent ended first (Ray's workers after
``ray.shutdown``) stays in the tree. The sampler thread's own CPU is subtracted.

``exclude_java`` leaves out the subtree of every ``java`` process (the Spark application's driver
JVM, which runs the local-cluster's master and workers and starts the executor JVMs and their
Python workers): the sides that do not use Spark are not charged for its idle JVMs.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

_TICK = os.sysconf("SC_CLK_TCK")
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Makes orphaned descendants this process's children (Linux), so their CPU stays counted."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _processes() -> Dict[int, Tuple[str, int, int, int]]:
    """Every process: pid -> (command name, parent pid, start time, its own CPU ticks)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                text = stat.read()
        except OSError:  # ended meanwhile
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        # fields[0] is field 3 (state) of proc(5): ppid 4, utime 14, stime 15, starttime 22.
        table[int(name)] = (comm, int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12]))
    return table


#: The parts of a side's CPU, by process: this one (the driver), JVMs, the rest (ranks, workers).
PARTS = ("driver", "jvm", "other")


def process_tree(root: int, exclude_java: bool) -> Dict[Tuple[int, int, str], int]:
    """``root`` and its descendants: (pid, start time, part) -> own CPU ticks (user + system)."""
    table = _processes()
    children: Dict[int, List[int]] = {}
    for pid, (_, parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    tree, pending = {}, [root]
    while pending:
        pid = pending.pop()
        if pid not in table or (exclude_java and table[pid][0] == "java"):
            continue
        part = "driver" if pid == root else "jvm" if table[pid][0] == "java" else "other"
        tree[(pid, table[pid][2], part)] = table[pid][3]
        pending.extend(children.get(pid, ()))
    return tree


class CpuMeter:
    """Samples the CPU seconds of this process and its descendants every ``interval`` seconds between
    ``start()`` and ``stop()``, so that the CPU of a time window inside the call can be read."""

    def __init__(self, exclude_java: bool, interval: float = 0.2) -> None:
        self.exclude_java = exclude_java
        self.interval = interval
        self.samples: List[Tuple[float, ...]] = []  # (time.time(), CPU seconds of each of PARTS)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "CpuMeter":
        self._thread = threading.Thread(target=self._run, name="parity-cpu-meter", daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def _run(self) -> None:
        own = time.thread_time()  # the sampler's CPU is not the side's
        seen: Dict[Tuple[int, int, str], int] = {}  # every process seen in the tree -> its latest ticks
        while True:
            stopping = self._stop.is_set()
            seen.update(process_tree(os.getpid(), self.exclude_java))
            parts = {part: 0 for part in PARTS}
            for (_, _, part), ticks in seen.items():
                parts[part] += ticks
            parts["driver"] -= (time.thread_time() - own) * _TICK
            self.samples.append((time.time(), *(parts[part] / _TICK for part in PARTS)))
            self._started.set()
            if stopping:
                return
            self._stop.wait(self.interval)

    def stop(self) -> "CpuMeter":
        self._stop.set()
        self._thread.join()
        return self

    def whole(self) -> float:
        """CPU seconds from ``start()`` to ``stop()``."""
        return sum(self.samples[-1][1:]) - sum(self.samples[0][1:])

    def between(self, begin: float, end: float) -> Dict[str, float]:
        """CPU seconds of each of PARTS between two ``time.time()`` instants (linear between samples)."""
        columns = np.array(self.samples).T
        return {
            part: float(np.interp(end, columns[0], cpus) - np.interp(begin, columns[0], cpus))
            for part, cpus in zip(PARTS, columns[1:])
        }
