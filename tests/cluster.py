"""The local-cluster session every Spark test starts (the shared fixture and the subprocess
apps): two one-core executors, all traffic on loopback, no UI."""

from __future__ import annotations


def local_cluster_builder(app_name: str, shape: str = "2,1,1024"):
    """A ``SparkSession.builder`` for ``local-cluster[<shape>]`` on 127.0.0.1; callers add
    their own settings and call ``getOrCreate()``."""
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master(f"local-cluster[{shape}]")
        .appName(app_name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
