"""The Spark session every benchmark measures on: local-cluster with 2 one-core executors, loopback."""

from __future__ import annotations

import os
import sys
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_cluster(app_name: str, executor_memory_mb: int = 1024, pythonpath: Sequence[str] = (ROOT,)):
    """``local-cluster[2,1,<memory>]`` whose executors run this interpreter and import from
    ``pythonpath``; all traffic stays on 127.0.0.1."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local-cluster[2,1,{executor_memory_mb}]")
        .appName(app_name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(pythonpath))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark
