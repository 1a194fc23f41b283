"""The first launch of an application warms the executors' Python workers in the background."""

from __future__ import annotations

import pytest

import sparkdl
from sparkdl._driver import warmup as _warmup
from sparkdl._driver.cluster import check_slots

pytestmark = pytest.mark.spark


def test_warm_up_runs_one_job_per_application_and_leaves_workers_with_the_task_side_imported(spark, monkeypatch):
    monkeypatch.setattr(_warmup, "_warmed", set())  # as in a new application
    # Both executors registered (as a fit waits for them), so the warm-up covers every slot.
    check_slots(spark.sparkContext, 2, 60.0)
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup(_warmup.JOB_GROUP))
    sparkdl.warm_up(spark, wait=True)
    sparkdl.warm_up(spark, wait=True)  # the same application: nothing more
    # The job has ended; Spark's status store learns it from its listener bus, asynchronously.
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()
    jobs = set(tracker.getJobIdsForGroup(_warmup.JOB_GROUP)) - before
    assert len(jobs) == 1
    assert tracker.getJobInfo(jobs.pop()).status == "SUCCEEDED"

    def imported(batches):
        import sys

        import pyarrow as pa

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"warm": ["sparkdl._task.entry" in sys.modules and "torch" in sys.modules]})

    assert [row.warm for row in spark.range(0, 2, 1, 2).mapInArrow(imported, "warm boolean").collect()] == [True, True]
