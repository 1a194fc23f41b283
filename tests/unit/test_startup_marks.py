"""Where a fit's start-up went: the task's marks and run_info["startup"]'s phases."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from sparkdl._task.fit_loop import startup_phases


def test_a_process_start_time_is_read_to_the_clock_tick():
    before = time.time()
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, time; from sparkdl._task.entry import _process_started; "
            "print(json.dumps([_process_started(), time.time()]))",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    after = time.time()
    started, child_now = json.loads(child.stdout)
    if not sys.platform.startswith("linux"):  # no /proc: run_info's worker_imports is None there
        assert started is None
        return
    tick = 0.011  # /proc counts in clock ticks (10 ms) and the two clocks are read apart
    assert before - tick <= started <= after
    assert started < child_now  # the imports ran after the process started


def test_a_new_worker_splits_the_launch_into_scheduling_and_its_imports():
    launched = 100.0
    marks = {
        "worker_started": 102.0,
        "task_entered": 105.5,
        "ready": 105.7,
        "start": 105.8,
        "first_batch": 107.0,
        "end": 110.0,
    }
    phases = startup_phases(1.25, launched, marks)
    assert phases == pytest.approx(
        {"prepare": 1.25, "schedule": 2.0, "worker_imports": 3.5, "rendezvous": 0.2, "first_step": 1.3}
    )
    assert sum(phases.values()) - 1.25 == pytest.approx(marks["first_batch"] - launched)


def test_a_reused_worker_has_no_imports_and_its_unpickling_counts_as_scheduling():
    phases = startup_phases(
        0.1, 100.0, {"worker_started": 40.0, "task_entered": 100.4, "ready": 100.45, "first_batch": 100.5}
    )
    assert phases["worker_imports"] is None
    assert phases["schedule"] == pytest.approx(0.4)
    assert phases["rendezvous"] == pytest.approx(0.05) and phases["first_step"] == pytest.approx(0.05)


def test_without_the_process_start_time_the_launch_is_all_scheduling():
    phases = startup_phases(
        0.1, 100.0, {"worker_started": None, "task_entered": 103.0, "ready": 103.1, "first_batch": 104.0}
    )
    assert phases["worker_imports"] is None and phases["schedule"] == pytest.approx(3.0)


def test_no_phases_when_rank_0_trained_no_batch():
    assert (
        startup_phases(0.1, 100.0, {"worker_started": 99.0, "task_entered": 100.5, "ready": 100.6, "first_batch": None})
        is None
    )
