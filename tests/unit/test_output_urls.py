"""Every output is a path or a URL (issue #42): what the commands and functions write goes through
sparkdl.filesystem, a scheme nothing here implements is one ConfigError before any Spark job, and
a usage error of the training job still leaves metrics.json. No Spark here: fsspec's in-process
``memory://``, ``file://`` URLs, real matplotlib images."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import pytest

import sparkdl
from sparkdl import filesystem
from sparkdl.cli import _common, _compare, _plan, _predict, _train, sparkdl_main
from sparkdl.comparison.result import Comparison, ComparisonRow
from sparkdl.errors import ConfigError
from sparkdl.planning.models import Measured, StrategyShape, sweep
from sparkdl.planning.report import Plan

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def memory_root():
    """A fresh ``memory://`` directory, removed afterwards (fsspec's memory store is process-wide)."""
    root = f"memory://sparkdl-tests/{uuid.uuid4().hex}"
    yield root
    memory = fsspec.filesystem("memory")
    if memory.exists(root):
        memory.rm(root, recursive=True)


def _read(url: str) -> bytes:
    return filesystem.read_file(url, "test file")


@pytest.mark.parametrize(
    "url, names",
    [
        ("nosuchfs://bucket/run", ["'nosuchfs'", "fsspec implementation of nosuchfs://"]),
        ("oci://bucket@namespace/run", ["'oci'", "ocifs"]),  # fsspec knows it; its package is not installed
    ],
)
def test_an_output_whose_scheme_nothing_implements_is_one_config_error_naming_what_to_install(url, names):
    with pytest.raises(ConfigError) as raised:
        filesystem.check_output(url, "--output")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("--output: no filesystem for URL scheme")
    assert all(name in message for name in names), message


def _no_spark(*args, **kwargs):
    raise AssertionError("a Spark session was started for an output nothing can write")


TRAIN = ["--data", "/data/x", "--model", "tests.models:digits_mlp", "--features", "f", "--label", "l"]


@pytest.mark.parametrize(
    "command, module, extra",
    [
        ("train", _train, TRAIN),
        ("predict", _predict, ["--model", "/m", "--data", "/d"]),
        ("compare", _compare, None),  # with a real dataset: compare checks its data before Spark too
        ("plan", _plan, ["--data", "/data/x", "--model", "tests.models:digits_mlp", "--features", "f", "--label", "l"]),
    ],
)
def test_every_command_refuses_an_unimplemented_output_scheme_in_one_line_before_spark(
    command, module, extra, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(module, "spark_session", _no_spark)
    if extra is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"f": [[0.0] * 64] * 64, "l": [1] * 64}), str(tmp_path / "part-0.parquet"))
        extra = ["--data", str(tmp_path), "--model", "tests.models:digits_mlp", "--features", "f", "--label", "l"]
        extra += ["--num-workers", "1", "--no-plot"]
    code = sparkdl_main([command, *extra, "--output", "nosuchfs://bucket/run"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "no filesystem for URL scheme 'nosuchfs'" in err, err


def test_an_unwritable_output_is_refused_before_spark(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_train, "spark_session", _no_spark)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert sparkdl_main(["train", *TRAIN, "--output", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert "--output=" in err and "cannot be written" in err


def test_compare_refuses_an_unimplemented_output_dir_before_anything_trains(tmp_path):
    from tests.models import digits_mlp

    with pytest.raises(ConfigError, match="output_dir: no filesystem for URL scheme 'nosuchfs'"):
        sparkdl.compare(digits_mlp, str(tmp_path / "no-data"), feature_cols=["f"], output_dir="nosuchfs://b/run")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_usage_error_argparse_finds_leaves_metrics_json_saying_so(where, tmp_path, memory_root, capsys):
    """The training job exits 2 on a bad argument before it could train; a scheduler reading
    metrics.json fails the task without retrying and shows the reason."""
    output = str(tmp_path / "run") if where == "local" else memory_root + "/run"
    with pytest.raises(SystemExit) as exited:
        _train.main(["--data", "/d", "--model", "m:f", "--features", "f", "--epochs", "many", "--output", output])
    assert exited.value.code == 2
    assert "invalid int value: 'many'" in capsys.readouterr().err  # argparse's own message, as before
    document = json.loads(_read(filesystem.url_join(output, "metrics.json")))
    assert document["status"] == "failed" and document["exit_code"] == 2 and document["error_kind"] == "usage"
    assert document["error"] == "sparkdl train: argument --epochs: invalid int value: 'many'"


def test_predict_records_a_missing_option_and_an_abbreviated_output(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _predict.predict_main(["--data", "/d", "--out", str(tmp_path / "p")])  # --model missing
    document = json.loads((tmp_path / "p" / "metrics.json").read_text())
    assert (document["status"], document["exit_code"], document["error_kind"]) == ("failed", 2, "usage")
    assert document["error"] == "sparkdl predict: the following arguments are required: --model"


def test_a_usage_error_without_an_output_writes_nothing_and_help_is_no_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        _train.main(["--data", "/d", "--output"])  # --output has no value: nowhere to write
    assert exited.value.code == 2 and os.listdir(tmp_path) == []
    with pytest.raises(SystemExit) as exited:
        _train.main(["--help", "--output", str(tmp_path / "run")])
    assert exited.value.code == 0 and not (tmp_path / "run").exists()


def test_output_in_reads_only_output_and_its_unambiguous_abbreviations():
    parser = _train.build_parser()
    assert _common.output_in(parser, ["--output", "s3://b/run", "--epochs", "x"]) == "s3://b/run"
    assert _common.output_in(parser, ["--output=s3://b/r?x=1"]) == "s3://b/r?x=1"
    assert _common.output_in(parser, ["--outp", "o"]) == "o"
    assert _common.output_in(parser, ["--o", "adam"]) is None  # --optimizer, --on-resize: ambiguous
    assert _common.output_in(parser, ["--data", "d"]) is None


def test_metrics_json_goes_to_the_url_not_to_a_folder_named_like_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "x" / "run"
    _common._write_metrics(f"file://{target}", {"status": "succeeded"})
    assert json.loads((target / "metrics.json").read_text()) == {"status": "succeeded"}
    assert not (tmp_path / "file:").exists()


def test_a_run_dir_at_a_url_is_described_and_labelled_by_its_directory(memory_root, capsys):
    run = memory_root + "/runs/first"
    _common._write_metrics(run, {"status": "succeeded", "exit_code": 0, "history": [{"epoch": 1, "loss": 0.5}]})
    assert sparkdl_main(["inspect", run]) == 0
    assert f"run {run}/metrics.json: succeeded (exit 0)" in capsys.readouterr().out
    plot = memory_root + "/plots/loss.png"
    assert sparkdl_main(["inspect", run, run, "--plot", plot]) == 0
    out = capsys.readouterr().out
    assert "? (first)" in out and f"wrote {plot}" in out
    assert _read(plot).startswith(PNG_SIGNATURE)


def test_inspect_of_an_unimplemented_scheme_is_a_usage_error(capsys):
    assert sparkdl_main(["inspect", "nosuchfs://bucket/run"]) == 2
    assert "no filesystem for URL scheme 'nosuchfs'" in capsys.readouterr().err


def _comparison() -> Comparison:
    history = [
        {"epoch": e, "loss": loss, "samples": 64, "seconds": 0.5, "samples_per_sec": 128.0, "comm_bytes": 1000}
        for e, loss in [(1, 2.0), (2, 1.0)]
    ]
    row = ComparisonRow.from_history("AllReduce()", {"name": "allreduce"}, history, num_workers=2)
    settings = {"num_workers": 2, "batch_size": 32, "epochs": 2, "seed": 0, "target_loss": None, "slowed": None}
    return Comparison(rows=[row], settings=settings, versions={"sparkdl": sparkdl.__version__})


@pytest.mark.parametrize("where", ["memory", "file-url"])
def test_compare_and_plan_outputs_and_plots_are_written_through_the_url(where, memory_root, tmp_path):
    root = memory_root if where == "memory" else f"file://{tmp_path}/out"
    paths = _comparison().save(root + "/compare")
    assert paths == {"json": root + "/compare/compare.json", "png": root + "/compare/compare.png"}
    assert Comparison.from_json(json.loads(_read(paths["json"]))).rows[0].label == "AllReduce()"
    assert _read(paths["png"]).startswith(PNG_SIGNATURE)

    measured = Measured(
        batch_size=32,
        local_step_s=0.01,
        compute_step_s=0.009,
        data_rows_per_s=1e5,
        param_bytes=4e6,
        grad_bytes=4e6,
        optimizer_bytes=8e6,
        largest_unit_bytes=1e6,
        bandwidth=1.25e9,
        latency_s=5e-5,
    )
    plan = Plan(measured, sweep(measured, [StrategyShape("allreduce", "AllReduce")], [2, 4]), calibration={})
    written = plan.save(root + "/plan")
    assert written == [root + "/plan/plan.json", root + "/plan/plan.png"]
    assert json.loads(_read(written[0]))["summary"] == plan.summary()
    assert _read(written[1]).startswith(PNG_SIGNATURE)

    svg = root + "/history.svg"  # the format is the suffix's, as matplotlib's savefig(path) chose it
    sparkdl.plot_history([{"epoch": 1, "loss": 1.0}, {"epoch": 2, "loss": 0.5}], path=svg)
    assert b"<svg" in _read(svg)[:500]
    if where == "file-url":
        assert (tmp_path / "out" / "plan" / "plan.png").is_file()


def test_local_outputs_stay_paths_as_written():
    assert filesystem.url_join("runs/a", "model") == os.path.join("runs/a", "model")
    assert filesystem.url_join("s3://b/run?endpoint_override=h:9", "metrics.json") == (
        "s3://b/run/metrics.json?endpoint_override=h:9"
    )
    assert filesystem.basename("s3://b/runs/a/?x=1") == "a" and filesystem.basename("runs/a/") == "a"
    assert filesystem.parent("memory://b/run/metrics.json") == "memory://b/run"
    assert not filesystem.is_url("runs/a") and filesystem.is_url("file:/tmp/a") and filesystem.is_url("s3://b")
