"""Airflow operators for sparkdl jobs, built on the Apache Spark provider's SparkSubmitOperator.

    pip install 'sparkdl-torch[airflow]'     # beside sparkdl
    pip install --no-deps sparkdl-torch apache-airflow-providers-apache-spark   # a slim Airflow worker

    from sparkdl_airflow import SparkdlTrainOperator, SparkdlPredictOperator

This package imports only Airflow, the Spark provider and the standard library: the Airflow worker
needs neither torch nor pyspark, only a ``spark-submit`` on its PATH that reaches the cluster (the
``spark_default`` connection says where). Airflow lists it as the provider ``sparkdl-torch``, the
distribution's name (``airflow providers list``). See jobs/airflow_dag.py for a whole DAG and docs/deploy.md.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["SparkdlPredictOperator", "SparkdlTrainOperator", "get_provider_info"]

#: The distribution that installs sparkdl and this package (pyproject.toml's [project].name).
DISTRIBUTION = "sparkdl-torch"


def __getattr__(name: str) -> Any:
    # Imported on first use: Airflow's providers manager imports this package (for
    # get_provider_info) while Airflow itself is still initializing, before operators can load.
    if name in ("SparkdlTrainOperator", "SparkdlPredictOperator"):
        from sparkdl_airflow import operators

        return getattr(operators, name)
    raise AttributeError(f"module 'sparkdl_airflow' has no attribute {name!r}")


def get_provider_info() -> Dict[str, Any]:
    """What Airflow's ``apache_airflow_provider`` entry point reads (the providers manager)."""
    from importlib.metadata import version

    # Airflow requires "package-name" to be the name of the distribution that declares the entry
    # point (pyproject.toml's [project].name), not the import package's.
    return {
        "package-name": DISTRIBUTION,
        "name": "sparkdl",
        "description": "Train and predict with PyTorch on Spark: sparkdl train / sparkdl predict through spark-submit.",
        "versions": [version(DISTRIBUTION)],
    }
