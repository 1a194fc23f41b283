"""sparkdl_airflow.reaper: SIGKILL for a process group still running after its grace period, from
a process of its own (the Airflow task that sent SIGTERM may itself be SIGKILLed 5 s later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sparkdl_airflow.reaper import KILLED, live_members, reap
from tests.conftest import REPO_ROOT

# A group leader that says when its SIGTERM disposition is set, then waits to be stopped.
LEADER = """
import signal, sys, threading
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture
def leaders():
    started = []

    def start(disposition: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", LEADER, disposition], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        started.append(process)
        assert process.stdout.readline() == "ready\n"
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_group_that_stops_on_sigterm_is_left_alone(leaders):
    leader = leaders("default")
    os.killpg(leader.pid, signal.SIGTERM)
    started = time.monotonic()
    # Not reaped yet (nobody waited): a zombie is no live member.
    assert reap(leader.pid, grace_seconds=60) == 0
    assert time.monotonic() - started < 30  # long before the grace period ends
    assert leader.wait(timeout=10) == -signal.SIGTERM


def test_a_group_that_ignores_sigterm_is_killed_once_its_grace_period_is_over(leaders):
    leader = leaders("ignore")
    os.killpg(leader.pid, signal.SIGTERM)
    assert live_members(leader.pid) == [leader.pid]  # SIGTERM changed nothing
    started = time.monotonic()
    assert reap(leader.pid, grace_seconds=1.0) == KILLED
    assert time.monotonic() - started >= 1.0
    assert leader.wait(timeout=10) == -signal.SIGKILL


def test_the_reaper_runs_as_a_module_in_a_session_of_its_own_and_outlives_its_parent(leaders):
    """As the operator starts it: ``python -m sparkdl_airflow.reaper PGID GRACE`` in a new session,
    from a parent that is SIGKILLed right after (as Airflow's supervisor kills the task)."""
    leader = leaders("ignore")
    start_then_die = (
        "import os, signal, subprocess, sys\n"
        f"reaper = subprocess.Popen([sys.executable, '-m', 'sparkdl_airflow.reaper', '{leader.pid}', '1.0'],"
        " start_new_session=True)\n"
        "print(reaper.pid, os.getsid(reaper.pid), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    parent = subprocess.run(
        [sys.executable, "-c", start_then_die], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    reaper_pid, reaper_sid = map(int, parent.stdout.split())
    assert reaper_sid == reaper_pid  # a session of its own: a kill of the parent's group misses it
    assert leader.wait(timeout=60) == -signal.SIGKILL


def test_a_wrong_command_line_is_a_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "sparkdl_airflow.reaper", "123"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert done.returncode == 2 and "usage: python -m sparkdl_airflow.reaper PGID GRACE_SECONDS" in done.stderr
