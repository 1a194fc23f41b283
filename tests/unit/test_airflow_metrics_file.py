"""sparkdl_airflow.metrics_file: the job's metrics.json as the Airflow worker reads it, from a local
path or from a URL through fsspec (its real local and in-memory filesystems)."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from sparkdl_airflow import metrics_file


@pytest.fixture
def memory_dir():
    """A fresh folder on fsspec's in-memory filesystem, removed afterwards."""
    url = f"memory://sparkdl-airflow-{uuid.uuid4().hex}"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_join_keeps_a_urls_slashes_and_joins_a_path_as_the_platform_does():
    assert metrics_file.join("s3://bucket/runs/1/", "metrics.json") == "s3://bucket/runs/1/metrics.json"
    assert metrics_file.join("file:///tmp/run", "model") == "file:///tmp/run/model"
    assert metrics_file.join("/shared/runs/1", "metrics.json") == "/shared/runs/1/metrics.json"


@pytest.mark.parametrize("where", ["path", "file_url", "memory"])
def test_reads_and_removes_a_metrics_file_wherever_output_dir_is(tmp_path, memory_dir, where):
    output_dir = {"path": str(tmp_path), "file_url": f"file://{tmp_path}", "memory": memory_dir}[where]
    target = metrics_file.join(output_dir, "metrics.json")
    metrics_file.check_readable(output_dir)
    assert metrics_file.read(target) is None  # none yet
    metrics_file.remove(target)  # nothing to remove is no error
    with fsspec.open(target if where != "path" else f"file://{target}", "w") as handle:
        json.dump({"status": "failed", "exit_code": 2, "error_kind": "usage", "error": "no --label"}, handle)
    assert metrics_file.read(target) == {
        "status": "failed",
        "exit_code": 2,
        "error_kind": "usage",
        "error": "no --label",
    }
    metrics_file.remove(target)
    assert metrics_file.read(target) is None


def test_a_partly_written_file_reads_as_none(tmp_path):
    (tmp_path / "metrics.json").write_text('{"status": "succ')
    assert metrics_file.read(str(tmp_path / "metrics.json")) is None


def test_a_scheme_the_worker_cannot_open_is_an_error_naming_it_and_what_to_do():
    with pytest.raises(ValueError) as refused:
        metrics_file.check_readable("nosuchfs://bucket/run")
    message = str(refused.value)
    assert message.startswith("output_dir 'nosuchfs://bucket/run': the Airflow worker reads the job's metrics.json")
    assert "fsspec cannot open nosuchfs:// URLs on this worker" in message
    assert "install the fsspec implementation of nosuchfs:// on the worker" in message
    metrics_file.check_readable("/a/local/path")  # a local path needs nothing
