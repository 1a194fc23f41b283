"""Example Airflow 3 DAG: prepare digits (a training and a held-out split) -> train an MLP with
sparkdl on Spark -> evaluate it on the held-out rows.

Deploy (docs/deploy.md, "Airflow"): install ``sparkdl-torch[airflow]`` on the Airflow worker (or
``pip install --no-deps sparkdl-torch apache-airflow-providers-apache-spark``: the operators import
neither torch nor pyspark), configure Spark once as the ``spark_default`` connection, and copy
this file, alone, into the DAGs folder. The rest comes from environment variables (or the run's
``conf``), where a deployment differs:

    SPARKDL_AIRFLOW_ROOT   where data, runs and checkpoints go (default /tmp/sparkdl-airflow)
    SPARKDL_PYTHON         the interpreter with sparkdl, torch and scikit-learn that the Spark
                           driver and executors run (default python3)
    SPARKDL_EXAMPLES       a directory holding the example's digits.py (the model, shipped to
                           the executors with --py-files, and the data writer): examples/ of a
                           sparkdl checkout
    SPARKDL_SPARK_CONN     the Spark connection (default spark_default)

Training failures fail the ``train`` task with the job's own message (bad arguments fail it
without retries: a retry would fail the same way); Airflow's retry then resumes from the run's checkpoints (``checkpoint_dir`` is per DAG run), so only the steps
after the last checkpoint are redone. Runs are keyed on the run id, which every run has
(``airflow dags trigger`` runs have no logical date in Airflow 3).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

from sparkdl_airflow import SparkdlPredictOperator, SparkdlTrainOperator

# One per DAG run, the same for every retry of its tasks; ':' and '+' would read as a URL scheme
# and a space in Spark's paths.
RUN_KEY = "{{ run_id | replace(':', '-') | replace('+', '-') }}"
EXAMPLES = os.environ.get("SPARKDL_EXAMPLES", "examples")

with DAG(
    dag_id="sparkdl_digits",
    description="Prepare digits Parquet (train/held-out), train an MLP with sparkdl on Spark, evaluate it on the held-out rows",
    schedule=None,
    start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sparkdl"],
    params={
        "root": os.environ.get("SPARKDL_AIRFLOW_ROOT", "/tmp/sparkdl-airflow"),
        "python": os.environ.get("SPARKDL_PYTHON", "python3"),
        "examples": EXAMPLES,
        "model_file": os.path.join(EXAMPLES, "digits.py"),  # shipped to the executors with --py-files
        "model": "digits:make_model",
        "num_workers": 2,
        "epochs": 5,
        "batch_size": 32,
        "lr": 0.05,
        "max_failures": 0,  # relaunches inside one try; Airflow's retries come on top
        "holdout": 0.2,  # the share of rows prepare_data keeps back for evaluate
        "min_accuracy": 0.8,
    },
    default_args={"owner": "sparkdl", "retries": 0},
) as dag:
    spark = dict(
        conn_id=os.environ.get("SPARKDL_SPARK_CONN", "spark_default"),
        py_files="{{ params.model_file }}",
        conf={
            "spark.ui.showConsoleProgress": "false",
            "spark.sparkdl.cacheDir": "{{ params.root }}/cache",
        },
        env_vars={"PYSPARK_PYTHON": "{{ params.python }}", "PYSPARK_DRIVER_PYTHON": "{{ params.python }}"},
    )

    prepare = BashOperator(
        task_id="prepare_data",
        bash_command='"{{ params.python }}" "{{ params.examples }}/digits.py" "{{ params.root }}/data/digits" --holdout "{{ params.holdout }}"',
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
            "validation": 0.1,
            "metric": ["accuracy"],
            "checkpoint_dir": "{{ params.root }}/ckpt/" + RUN_KEY,
            "max_failures": "{{ params.max_failures }}",
        },
        retries=1,
        retry_delay=timedelta(seconds=float(os.environ.get("SPARKDL_AIRFLOW_RETRY_DELAY_S", "30"))),
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
