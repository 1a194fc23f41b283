"""``sparkdl train``, ``predict`` and ``inspect`` with outputs and inputs at URLs (issue #42), run
in this process on the shared local-cluster session: fsspec's ``memory://`` (the driver's own
memory: the model and metrics.json are written on the driver), ``file://`` URLs, and ``s3://`` on
a real S3-compatible server on loopback (moto's server mode, tests/s3_server.py) through
pyarrow's S3 and through s3fs (``s3a://``). Tiny data, one epoch."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl import filesystem
from sparkdl.cli import sparkdl_main
from tests.s3_server import running_s3_server

pytestmark = pytest.mark.spark

ROWS = 256
BUCKET = "sparkdl-runs"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, digits):
    """256 rows of digits as Parquet (features array<double>, label long): 2 ranks x 4 steps of 32."""
    features, labels = digits
    path = tmp_path_factory.mktemp("digits") / "train"
    path.mkdir()
    table = pa.table({"features": [row.astype(float).tolist() for row in features[:ROWS]], "label": labels[:ROWS]})
    pq.write_table(table, str(path / "part-0.parquet"))
    return str(path)


def _train(dataset, output, *extra):
    return sparkdl_main(
        [
            "train",
            "--data",
            dataset,
            "--model",
            "tests.models:digits_mlp",
            "--features",
            "features",
            "--label",
            "label",
            "--num-workers",
            "2",
            "--epochs",
            "1",
            "--batch-size",
            "32",
            "--lr",
            "0.01",
            "--quiet",
            "--output",
            output,
            *extra,
        ]
    )


def _metrics(run_url):
    return json.loads(filesystem.read_file(filesystem.url_join(run_url, "metrics.json"), "metrics.json"))


def test_a_run_written_to_memory_round_trips_through_inspect(spark, dataset, capsys):
    run = f"memory://sparkdl-tests/{uuid.uuid4().hex}/run"
    try:
        assert _train(dataset, run) == 0
        out = capsys.readouterr().out
        assert f"model in {run}/model, metrics in {run}/metrics.json" in out
        assert sparkdl_main(["inspect", run, "--json"]) == 0
        described = json.loads(capsys.readouterr().out)
        assert described["kind"] == "metrics" and described["status"] == "succeeded" and described["exit_code"] == 0
        assert described["path"] == f"{run}/metrics.json" and described["run"]["num_workers"] == 2
        assert sparkdl_main(["inspect", f"{run}/model"]) == 0
        assert f"model {run}/model: sparkdl" in capsys.readouterr().out
        assert spark.sparkContext._jsc is not None  # the command used the running session and left it running
    finally:
        memory = fsspec.filesystem("memory")
        memory.rm(run.rsplit("/", 1)[0], recursive=True)


def test_a_file_url_output_is_the_directory_it_names(spark, dataset, tmp_path, monkeypatch, capsys):
    """The issue's case: ``--output file:///tmp/x/run`` wrote metrics.json into ./file:/tmp/x/run."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "x" / "run"
    assert _train(dataset, f"file://{run}") == 0
    assert json.loads((run / "metrics.json").read_text())["status"] == "succeeded"
    assert (run / "model" / "metadata.json").is_file()
    assert sorted(os.listdir(tmp_path)) == ["x"]  # no folder named "file:"
    capsys.readouterr()
    assert sparkdl_main(["inspect", f"file://{run}"]) == 0
    assert f"run file://{run}/metrics.json: succeeded" in capsys.readouterr().out


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with running_s3_server(str(tmp_path_factory.mktemp("s3-server"))) as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


@pytest.fixture
def s3_environment(s3, monkeypatch):
    """The driver's clients (pyarrow's S3, s3fs) pointed at the loopback server by environment."""
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3.environment().items():
        monkeypatch.setenv(name, value)
    fsspec.filesystem("s3").clear_instance_cache()  # s3fs keeps instances: none from another endpoint
    yield s3
    fsspec.filesystem("s3").clear_instance_cache()


def test_train_writes_model_and_metrics_to_s3_and_predict_reads_the_model_and_writes_there(
    spark, dataset, s3_environment, capsys
):
    s3 = s3_environment
    assert _train(dataset, f"s3://{BUCKET}/runs/a") == 0
    keys = s3.keys(BUCKET, "runs/a/")
    assert {"runs/a/metrics.json", "runs/a/model/metadata.json", "runs/a/model/model_fn.pkl"} <= set(keys), keys
    stored = json.loads(s3.client().get_object(Bucket=BUCKET, Key="runs/a/metrics.json")["Body"].read())
    assert stored["status"] == "succeeded" and len(stored["history"]) == 1

    capsys.readouterr()
    for reader in ("s3", "s3a"):  # pyarrow's S3, then s3fs: the same objects
        assert sparkdl_main(["inspect", f"{reader}://{BUCKET}/runs/a", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["history"] == stored["history"]

    # Executors write the predictions: the URL carries the endpoint (their environment predates the server).
    output = s3.url_with_endpoint(BUCKET, "predictions/a")
    code = sparkdl_main(
        [
            "predict",
            "--model",
            f"s3a://{BUCKET}/runs/a/model",
            "--data",
            dataset,
            "--output",
            output,
            "--label",
            "label",
            "--keep-columns",
            "label",
        ]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    document = _metrics(output)
    assert document["status"] == "succeeded" and document["rows"] == ROWS
    assert 0.0 <= document["evaluation"]["accuracy"] <= 1.0
    parts = [key for key in s3.keys(BUCKET, "predictions/a/predictions/") if key.endswith(".parquet")]
    assert parts and "predictions/a/predictions/_SUCCESS" in s3.keys(BUCKET, "predictions/a/predictions/")
    assert not s3.keys(BUCKET, "predictions/a/predictions/_temporary")
    _, fs, path = filesystem.open_url(filesystem.url_join(output, "predictions"), "predictions")
    table = pq.read_table(path, filesystem=fs)
    assert table.num_rows == ROWS and table.column_names == ["label", "prediction"]  # no features: not kept
    predicted = np.array(table.column("prediction").to_pylist()).argmax(1)
    accuracy = float((predicted == np.array(table.column("label").to_pylist())).mean())
    assert accuracy == pytest.approx(document["evaluation"]["accuracy"])

    # Written again without --overwrite: refused, and said so in metrics.json.
    again = ["--data", dataset, "--output", output, "--keep-columns", "label"]
    code = sparkdl_main(["predict", "--model", f"s3://{BUCKET}/runs/a/model", *again])
    assert code == 2
    refused = _metrics(output)
    assert refused["error_kind"] == "usage" and "already exists: pass --overwrite" in refused["error"]
