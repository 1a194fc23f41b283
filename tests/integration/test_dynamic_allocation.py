"""Under ``spark.dynamicAllocation.enabled=true`` (EMR's and Dataproc's default), for real: every
entry point that launches ranks refuses in under a second, before any Spark job, naming the
setting and the per-application fix, instead of Spark's own refusal after the data was
materialized (11 s and a ``SparkJobFailed`` before this check existed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.spark

APP = os.path.join(REPO_ROOT, "tests", "integration", "dynamic_allocation_app.py")
ENTRY_POINTS = ["fit_dataframe", "fit_url", "run", "launch", "compare", "plan"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("dynamic-allocation")
    output = scratch / "results.json"
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    done = subprocess.run(
        [sys.executable, APP, str(output), str(scratch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    return json.loads(output.read_text())


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_each_entry_point_refuses_in_under_a_second_before_any_spark_job(results, entry_point):
    outcome = results[entry_point]
    assert outcome["error"] is not None, f"{entry_point} was not refused"
    assert "spark.dynamicAllocation.enabled=true" in outcome["error"]
    assert "--conf spark.dynamicAllocation.enabled=false" in outcome["error"]  # the per-application fix
    assert "barrier" in outcome["error"]  # the reason
    assert outcome["seconds"] < 1.0, outcome
    assert outcome["jobs_started"] == 0, outcome


def test_the_spark_submit_job_fails_with_the_reason_in_metrics_json_before_any_spark_job(results):
    # The job runs fit (timed above) and then stops its session, which is most of its own time.
    job = results["job"]
    assert job["exit_code"] != 0
    assert "spark.dynamicAllocation.enabled=true" in job["error"]
    assert "--conf spark.dynamicAllocation.enabled=false" in job["error"]
    assert job["jobs_started"] == 0, job
