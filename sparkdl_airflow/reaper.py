"""SIGKILL for a process group that outlives its grace period, sent from a process of its own.

    python -m sparkdl_airflow.reaper PGID GRACE_SECONDS

Waits until no live process is left in process group PGID, or GRACE_SECONDS have passed; then
sends the group SIGKILL. Exit status 0: the group ended in time; KILLED: it had to be killed.

Why a process of its own: the operator's ``on_kill`` sends spark-submit's group SIGTERM from the
Airflow task's process, and Airflow 3's supervisor SIGKILLs that process 5 s after its own SIGTERM
(its escalation delay, not configurable). A SIGKILL escalation left to the task's process would
die with it, and a driver slow to stop (or one that ignores SIGTERM) would run on. This process
runs in a session of its own, holds none of the task's pipes, and ends by itself.

Standard library only, so that it starts in tens of milliseconds; Linux (/proc), as Airflow workers are.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Dict, List, Optional, Tuple

KILLED = 9
#: No event says that a process group has emptied; a short poll also keeps short the time in which
#: the group's number, once free, could name a new group.
POLL_SECONDS = 0.1


def live_processes() -> Dict[int, Tuple[int, int]]:
    """pid -> (process group, session) of every process that is not a zombie (a zombie waits for
    its parent to reap it, which may be late or never in a container, and ignores every signal)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # after the command, which may hold anything
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] not in ("Z", "X"):  # fields: state, parent, process group, session, ...
            found[int(entry)] = (int(fields[2]), int(fields[3]))
    return found


def live_members(pgid: int) -> List[int]:
    """The processes of group ``pgid`` that are not zombies."""
    return sorted(pid for pid, (group, _) in live_processes().items() if group == pgid)


def reap(pgid: int, grace_seconds: float) -> int:
    """SIGKILL to group ``pgid`` once ``grace_seconds`` have passed with live members; 0 if none
    were left before that, else KILLED."""
    deadline = time.monotonic() + grace_seconds
    while live_members(pgid):
        left = deadline - time.monotonic()
        if left <= 0:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:  # emptied at the last moment
                return 0
            return KILLED
        time.sleep(min(POLL_SECONDS, left))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m sparkdl_airflow.reaper PGID GRACE_SECONDS", file=sys.stderr)
        return 2
    return reap(int(args[0]), float(args[1]))


if __name__ == "__main__":
    sys.exit(main())
