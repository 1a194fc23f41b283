"""``resources=``: the training stage's own Spark resource profile, on the shared local-cluster
(two executors with one core each, ``spark.task.cpus=1``): the ETL around it keeps the default
profile, the training stage runs with its own, and what the executors cannot hold fails fast."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import sparkdl
from sparkdl._driver.resource_profile import stage_profile_ids
from sparkdl.errors import ConfigError, InsufficientSlotsError

pytestmark = pytest.mark.spark


def _task_facts(ctx):
    from pyspark import TaskContext

    task = TaskContext.get()
    exact = getattr(task, "cpuAmount", None)
    facts = {
        "rank": ctx.rank,
        "torch_threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "cpus": task.cpus(),
        "cpu_amount": None if exact is None else str(exact()),
    }
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, facts)
    return gathered


def _etl(spark, tag: str) -> int:
    """A small shuffle job tagged ``tag``: what a user's data preparation does."""
    sc = spark.sparkContext
    sc.addJobTag(tag)
    try:
        return len(spark.range(0, 1000, 1, 4).selectExpr("id % 3 AS k").groupBy("k").count().collect())
    finally:
        sc.removeJobTag(tag)


def _has_fractional_cpus() -> bool:
    from pyspark import TaskContext

    return hasattr(TaskContext, "cpuAmount")


def test_half_a_core_per_rank_runs_four_ranks_on_two_cores_and_etl_keeps_the_default_profile(spark):
    """Four ranks on two one-core executors: only with a profile of 0.5 CPUs per task (the
    default profile has 2 slots, and a barrier stage of 4 would be refused). Each rank runs one
    torch thread (the exact 0.5 rounded down, at least one; ``cpus()`` alone would say 1 too, so
    ``cpuAmount`` is what shows the profile reached the task). The ETL jobs before and after
    run with Spark's default profile (id 0), the training stage with its own."""
    sc = spark.sparkContext
    environment = sc.environment
    environment["SPARKDL_TEST_WORKERS"] = "half-core"  # Python workers of their own (threads set here)
    try:
        _etl(spark, "resources-etl-before")
        if not _has_fractional_cpus():
            # PySpark 4.0-4.2 (the petastorm stack): refused before launch, naming the version.
            with pytest.raises(ConfigError, match=r"fractional task CPUs need Spark 4\.3 or later"):
                sparkdl.run(_task_facts, num_workers=4, spark=spark, progress=False, resources={"cpus": 0.5})
            return
        sc.addJobTag("resources-train")
        try:
            facts = sparkdl.run(
                _task_facts, num_workers=4, spark=spark, progress=False, resources=sparkdl.Resources(cpus=0.5)
            )
        finally:
            sc.removeJobTag("resources-train")
        _etl(spark, "resources-etl-after")
    finally:
        del environment["SPARKDL_TEST_WORKERS"]
    assert [fact["rank"] for fact in facts] == [0, 1, 2, 3]
    for fact in facts:
        assert fact["cpu_amount"] == "0.5" and fact["torch_threads"] == 1 and fact["omp"] == "1", facts
    assert stage_profile_ids(sc, "resources-etl-before") == [0]
    assert stage_profile_ids(sc, "resources-etl-after") == [0]
    (training,) = stage_profile_ids(sc, "resources-train")
    assert training != 0


def test_the_fit_records_the_profile_spark_ran_its_stage_with(spark, digits_df):
    model = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Linear(64, 10),
        num_workers=2,
        epochs=1,
        batch_size=64,
        progress=False,
        resources=sparkdl.Resources(cpus=1),
    ).fit(digits_df)
    resources = model.run_info["resources"]
    assert resources["task_cpus"] == 1 and resources["task_gpus"] == 0, resources
    (profile_id,) = resources["stage_resource_profile_ids"]
    assert profile_id == resources["resource_profile_id"] and profile_id != 0, resources


def test_a_profile_the_executors_cannot_hold_fails_within_seconds_naming_it(spark):
    started = time.monotonic()
    with pytest.raises(InsufficientSlotsError) as caught:
        sparkdl.run(lambda ctx: None, num_workers=2, spark=spark, progress=False, resources=sparkdl.Resources(cpus=2))
    message = str(caught.value)
    assert time.monotonic() - started < 10, message  # every executor has registered: no waiting
    assert "the training stage's resource profile (id " in message and "2 CPUs per task)" in message, message
    assert "has 0 for it (2 executor(s) with 1 core(s), 0 GPU(s) each)" in message, message
    assert "resources=" in message, message


def test_more_executor_memory_than_the_application_has_is_refused_before_launch(spark):
    with pytest.raises(InsufficientSlotsError) as caught:
        sparkdl.run(lambda ctx: None, num_workers=2, spark=spark, progress=False, resources={"memory": "64g"})
    message = str(caught.value)
    assert "needs executors with at least 65536 MiB" in message and "spark.executor.memory=" in message, message


def test_gpus_executors_do_not_have_are_refused_naming_the_settings(spark):
    with pytest.raises(InsufficientSlotsError) as caught:
        sparkdl.run(lambda ctx: None, num_workers=1, spark=spark, progress=False, resources=sparkdl.Resources(gpus=1))
    message = str(caught.value)
    assert "asks for 1 GPU(s) per task, but this application's executors have none" in message, message
    assert "spark.executor.resource.gpu.amount" in message and "discoveryScript" in message, message
