"""Example Airflow DAG: prepare data -> train with sparkdl on Spark -> evaluate on held-out rows.

Deploy: copy this file and ``jobs/sparkdl_airflow.py`` into the DAGs folder (or point
``AIRFLOW__CORE__DAGS_FOLDER`` at ``jobs/``). The Airflow worker needs only Airflow and a
``spark-submit`` that reaches the cluster; every setting below is a DAG param, so a run can
override it (``airflow dags trigger sparkdl_digits --conf '{"epochs": 10}'``), and the defaults
come from environment variables where a deployment differs:

    SPARKDL_AIRFLOW_ROOT   shared storage for data, runs, checkpoints (default /tmp/sparkdl-airflow)
    SPARKDL_PYTHON         the Python with sparkdl that prepares data and that executors run
    SPARKDL_SPARK_SUBMIT   spark-submit to use (default: spark-submit on PATH)
    SPARKDL_SPARK_MASTER   Spark master (default local[2]; e.g. spark://host:7077)
    SPARKDL_AIRFLOW_RETRY_DELAY_S   seconds before the train task is retried (default 60)

Training failures fail the ``train`` task (the job's message is the task's error); Airflow's
retry then resumes from the run's checkpoints (``checkpoint_dir`` is per DAG run), so only the
steps after the last checkpoint are redone. The ``train`` task's XCom is its metrics summary
(per-epoch history, per-rank throughput, resumed step). ``prepare_data`` writes a training split
and a held-out split (``jobs/prepare_digits.py``, ``holdout`` of the rows); ``train`` sees only the
first, and ``evaluate`` scores only the second, pushes its accuracy and fails under ``min_accuracy``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pendulum
from airflow import DAG
from airflow.operators.bash import BashOperator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sparkdl_airflow beside this file
from sparkdl_airflow import SparkdlPredictOperator, SparkdlTrainOperator  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_KEY = "{{ ts_nodash }}"  # one per DAG run, the same for every retry of its tasks

with DAG(
    dag_id="sparkdl_digits",
    description="Prepare digits Parquet (train/test), train an MLP with sparkdl on Spark, evaluate it on the held-out rows",
    schedule=None,
    start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sparkdl"],
    params={
        "root": os.environ.get("SPARKDL_AIRFLOW_ROOT", "/tmp/sparkdl-airflow"),
        "python": os.environ.get("SPARKDL_PYTHON", "python3"),
        "spark_submit": os.environ.get("SPARKDL_SPARK_SUBMIT", "spark-submit"),
        "master": os.environ.get("SPARKDL_SPARK_MASTER", "local[2]"),
        "driver_host": "127.0.0.1",
        "repo": REPO,
        "model_file": os.path.join(REPO, "examples", "digits.py"),  # shipped with --py-files
        "model": "digits:make_model",
        "num_workers": 2,
        "epochs": 5,
        "batch_size": 32,
        "lr": 0.05,
        "max_failures": 0,  # relaunches inside one try; Airflow's retries come on top
        "holdout": 0.2,  # fraction of the rows that prepare_data holds out for evaluate
        "min_accuracy": 0.8,
    },
    default_args={"owner": "sparkdl", "retries": 0},
) as dag:
    spark = dict(
        master="{{ params.master }}",
        spark_submit="{{ params.spark_submit }}",
        py_files=["{{ params.model_file }}"],
        conf={
            "spark.driver.host": "{{ params.driver_host }}",
            "spark.ui.showConsoleProgress": "false",
            "spark.sparkdl.cacheDir": "{{ params.root }}/cache",
            "spark.driver.extraJavaOptions": "-Dlog4j.configurationFile=file:{{ params.repo }}/jobs/log4j2.properties",
        },
        env={"PYSPARK_PYTHON": "{{ params.python }}", "PYSPARK_DRIVER_PYTHON": "{{ params.python }}"},
    )

    prepare = BashOperator(
        task_id="prepare_data",
        bash_command=(
            '"{{ params.python }}" "{{ params.repo }}/jobs/prepare_digits.py" "{{ params.root }}/data/digits"'
            ' --holdout "{{ params.holdout }}"'
        ),
    )

    train = SparkdlTrainOperator(
        task_id="train",
        output_dir="{{ params.root }}/runs/" + RUN_KEY,
        arguments={
            "data": "{{ params.root }}/data/digits/train",
            "model": "{{ params.model }}",
            "features": "features",
            "label": "label",
            "num_workers": "{{ params.num_workers }}",
            "epochs": "{{ params.epochs }}",
            "batch_size": "{{ params.batch_size }}",
            "optimizer": "sgd",
            "lr": "{{ params.lr }}",
            "checkpoint_dir": "{{ params.root }}/checkpoints/" + RUN_KEY,
            "max_failures": "{{ params.max_failures }}",
        },
        retries=2,
        retry_delay=timedelta(seconds=float(os.environ.get("SPARKDL_AIRFLOW_RETRY_DELAY_S", "60"))),
        **spark,
    )

    evaluate = SparkdlPredictOperator(
        task_id="evaluate",
        output_dir="{{ params.root }}/eval/" + RUN_KEY,
        arguments={
            "model": "{{ ti.xcom_pull(task_ids='train')['model'] }}",
            "data": "{{ params.root }}/data/digits/test",  # rows the model never saw
            "label": "label",
            "overwrite": True,
        },
        fail_below={"accuracy": "{{ params.min_accuracy }}"},
        **spark,
    )

    prepare >> train >> evaluate
