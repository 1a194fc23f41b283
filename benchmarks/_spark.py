"""The Spark session every benchmark measures on: local-cluster with 2 one-core executors, loopback
(or another shape, e.g. one 2-core executor whose task gets both cores)."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_cluster(
    app_name: str,
    executor_memory_mb: int = 1024,
    pythonpath: Sequence[str] = (ROOT,),
    workers: int = 2,
    cores_per_worker: int = 1,
    task_cpus: Optional[int] = None,
):
    """``local-cluster[<workers>,<cores_per_worker>,<memory>]`` (default ``[2,1,<memory>]``) whose
    executors run this interpreter and import from ``pythonpath``; all traffic stays on
    127.0.0.1. ``task_cpus`` sets ``spark.task.cpus`` (Spark's default, 1, when None)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(f"local-cluster[{workers},{cores_per_worker},{executor_memory_mb}]")
        .appName(app_name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(pythonpath))
    )
    if task_cpus is not None:
        builder = builder.config("spark.task.cpus", str(task_cpus))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
