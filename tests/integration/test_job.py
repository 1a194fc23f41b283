"""jobs/train.py end to end under the real spark-submit, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import sparkdl
from examples.digits import write_dataset, write_split
from tests.conftest import REPO_ROOT
from tests.models import accuracy, read_digits

pytestmark = pytest.mark.slow

SPARK_SUBMIT = os.path.join(os.path.dirname(sys.executable), "spark-submit")


def _submit(master, data, output, *extra, timeout=300):
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    command = [
        SPARK_SUBMIT,
        "--master",
        master,
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        f"spark.sparkdl.cacheDir={output}-cache",
        "--driver-java-options",
        f"-Dlog4j.configurationFile=file:{REPO_ROOT}/jobs/log4j2.properties",
        "--py-files",
        os.path.join(REPO_ROOT, "tests", "models.py"),
        os.path.join(REPO_ROOT, "jobs", "train.py"),
        "--data",
        data,
        "--model",
        "models:digits_mlp",
        "--features",
        "features",
        "--label",
        "label",
        "--strategy",
        "allreduce",
        "--num-workers",
        "2",
        "--epochs",
        "3",
        "--batch-size",
        "32",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--output",
        output,
        *extra,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def test_spark_submit_trains_and_writes_model_and_metrics(tmp_path):
    train, test = write_split(str(tmp_path / "digits"))  # 1,437 training rows, 360 held out
    output = str(tmp_path / "run")
    result = _submit("local-cluster[2,1,1024]", train, output)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[sparkdl] epoch 3/3" in result.stdout
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    assert metrics["status"] == "succeeded"
    assert [r["epoch"] for r in metrics["history"]] == [1, 2, 3]
    # Each epoch is one pass over the training split only: 1437 // (2 * 32) full steps of 2 x 32 rows.
    assert all(r["samples"] == (1437 // 64) * 64 for r in metrics["history"]), metrics["history"]
    import pyspark

    assert metrics["versions"]["pyspark"] == pyspark.__version__  # the stack's own PySpark ran the job
    assert metrics["run"]["num_workers"] == 2
    with pytest.raises(ImportError, match="pass the factory"):
        sparkdl.TorchModel.load(os.path.join(output, "model"))  # `models` was shipped with --py-files only
    from tests.models import digits_mlp

    model = sparkdl.TorchModel.load(os.path.join(output, "model"), model=digits_mlp)
    features, labels = read_digits(test)  # scored only on rows the job never read
    assert len(labels) == 360
    assert accuracy(model.module, features, labels) > 0.85


def test_spark_submit_failure_exits_nonzero_with_a_clear_message(tmp_path):
    data = write_dataset(str(tmp_path / "digits"))
    output = str(tmp_path / "bad")
    result = _submit("local[2]", data, output, "--label", "digit")
    assert result.returncode == 1
    # spark-submit merges the Python driver's stderr into its stdout.
    assert "label column 'digit' is not in dataset" in result.stdout + result.stderr
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    assert metrics["status"] == "failed" and "digit" in metrics["error"]


def test_bad_model_spec_is_a_usage_error(tmp_path):
    from sparkdl.cli import main

    assert (
        main(
            [
                "--data",
                str(tmp_path),
                "--model",
                "no_such_module:f",
                "--features",
                "x",
                "--label",
                "y",
                "--output",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    metrics = json.load(open(tmp_path / "o" / "metrics.json"))
    assert "cannot import 'no_such_module'" in metrics["error"]
