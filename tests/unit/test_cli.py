"""The command line without Spark: `sparkdl` dispatch, train's options and metrics.json, inspect,
package. (Spark runs of the same commands: tests/integration/test_job.py, test_standalone.py,
test_packaging.py, test_airflow.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import zipfile

import pytest
import torch

import sparkdl
from sparkdl import cli
from sparkdl.cli import _train
from tests.conftest import REPO_ROOT


def test_umbrella_command_dispatches_and_rejects_unknown_commands(capsys):
    assert cli.sparkdl_main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert cli.sparkdl_main([]) == 2
    assert cli.sparkdl_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli.sparkdl_main(["predict"]) == 2  # argparse: required options missing
    assert cli.sparkdl_main(["inspect", "--help"]) == 0


def test_console_scripts_are_registered():
    pyproject = open(os.path.join(REPO_ROOT, "pyproject.toml")).read()
    assert 'sparkdl = "sparkdl.cli:sparkdl_main"' in pyproject and 'sparkdl-train = "sparkdl.cli:main"' in pyproject
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "sparkdl"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "predict" in result.stdout


def test_cli_package_keeps_the_one_module_names():
    """sparkdl/cli/ is one module per command; sparkdl.cli.NAME and ``python -m`` stay as they were."""
    import pickle

    for name in (
        "main",
        "sparkdl_main",
        "train",
        "predict",
        "predict_main",
        "describe",
        "format_description",
        "inspect_main",
        "package",
        "package_main",
        "throughput",
        "rank_rates",
        "load_factory",
        "parse_inputs",
        "build_parser",
    ):
        assert callable(getattr(cli, name)), name
    assert set(cli.COMMANDS) == {
        "train",
        "predict",
        "inspect",
        "package",
        "launch",
        "compare",
        "plan",
        "submit",
    } and issubclass(cli.UsageError, Exception)
    factory = _train._optimizer_factory("sgd", 0.1, 0.9)  # executors import it by reference
    assert type(pickle.loads(pickle.dumps(factory))) is _train._OptimizerFactory
    result = subprocess.run(
        [sys.executable, "-m", "sparkdl.cli", "--help"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.returncode == 0 and "usage: sparkdl train" in result.stdout


class _FakeModel:
    history = [
        {
            "epoch": 1,
            "loss": 2.0,
            "samples_per_sec": 100.0,
            "rank0_samples_per_sec": 60.0,
            "rank1_samples_per_sec": 40.0,
        },
        {
            "epoch": 2,
            "loss": 1.0,
            "samples_per_sec": 120.0,
            "rank0_samples_per_sec": 70.0,
            "rank1_samples_per_sec": 50.0,
        },
    ]
    run_info = {"num_workers": 2, "steps": {"resumed_at": 0}}

    def save(self, path):
        os.makedirs(path)


def _fake_spark(monkeypatch, captured):
    """Stands in for SparkSession and TorchEstimator so train()'s plumbing runs without a JVM."""
    import pyspark.sql

    class Builder:
        def appName(self, name):
            return self

        def master(self, master):
            captured["master"] = master
            return self

        def config(self, key, value):
            captured.setdefault("conf", {})[key] = value
            return self

        def getOrCreate(self):
            context = types.SimpleNamespace(master="local[2]", applicationId="local-1")
            return types.SimpleNamespace(sparkContext=context, stop=lambda: captured.setdefault("stopped", True))

    class FakeEstimator:
        def __init__(self, **kwargs):
            captured["estimator"] = kwargs

        def fit(self, data):
            captured["data"] = data
            return _FakeModel()

    # The estimator first: reading the real one (to restore it) imports pyspark.ml, which needs the real SparkSession.
    monkeypatch.setattr(sparkdl, "TorchEstimator", FakeEstimator)
    monkeypatch.setattr(
        pyspark.sql, "SparkSession", types.SimpleNamespace(builder=Builder(), getActiveSession=lambda: None)
    )


def test_train_passes_recovery_and_tracking_options_and_writes_metrics(tmp_path, monkeypatch):
    captured = {}
    _fake_spark(monkeypatch, captured)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = cli.sparkdl_main(
        [
            "train",
            "--data",
            "/data/x",
            "--model",
            "tests.models:digits_mlp",
            "--features",
            "features",
            "--label",
            "label",
            "--output",
            str(tmp_path / "run"),
            "--checkpoint-dir",
            "/ckpt/x",
            "--checkpoint-every",
            "50",
            "--max-failures",
            "3",
            "--checkpoint-sync",
            "--no-resume",
            "--mlflow-experiment",
            "exp",
            "--mlflow-tracking-uri",
            "file:/tmp/mlruns",
            "--mlflow-register",
            "digits",
            "--tensorboard-dir",
            "/tb",
            "--master",
            "local[2]",
            "--reader",
            "petastorm",
            "--validation",
            "0.1",
            "--precision",
            "bf16-mixed",
            "--slot-wait",
            "90",
        ]
    )
    assert code == 0
    kwargs = captured["estimator"]
    assert kwargs["slot_wait_s"] == 90.0
    assert (kwargs["reader"], kwargs["validation"], kwargs["precision"]) == ("petastorm", 0.1, "bf16-mixed")
    assert (kwargs["checkpoint_dir"], kwargs["checkpoint_every"], kwargs["max_failures"], kwargs["resume"]) == (
        "/ckpt/x",
        50,
        3,
        False,
    )
    assert kwargs["checkpoint_async"] is False
    assert (kwargs["mlflow_experiment"], kwargs["tensorboard_dir"]) == ("exp", "/tb")
    assert kwargs["mlflow_registered_model_name"] == "digits"
    assert os.environ["MLFLOW_TRACKING_URI"] == "file:/tmp/mlruns"
    assert captured["stopped"] and captured["master"] == "local[2]"
    assert captured["conf"] == {"spark.ui.showConsoleProgress": "false"}  # sparkdl prints its own progress
    metrics = json.load(open(tmp_path / "run" / "metrics.json"))
    assert metrics["status"] == "succeeded" and metrics["exit_code"] == 0
    assert metrics["throughput"] == {
        "samples_per_sec": [100.0, 120.0],
        "rank_samples_per_sec_mean": [65.0, 45.0],
        "slowest_rank": 1,
    }
    assert metrics["config"]["checkpoint_dir"] == "/ckpt/x"
    assert set(metrics["versions"]) >= {"sparkdl", "torch", "pyspark", "petastorm", "pyarrow", "python"}
    assert metrics["started_at"].endswith("Z") and metrics["wall_seconds"] >= 0


def test_failed_train_records_status_versions_and_exit_code(tmp_path, monkeypatch):
    captured = {}
    _fake_spark(monkeypatch, captured)

    def failing_fit(self, data):
        raise sparkdl.TrainingError([])

    monkeypatch.setattr(sparkdl.TorchEstimator, "fit", failing_fit)
    code = cli.main(
        [
            "--data",
            "/d",
            "--model",
            "tests.models:digits_mlp",
            "--features",
            "f",
            "--label",
            "l",
            "--output",
            str(tmp_path / "o"),
        ]
    )
    assert code == 1
    metrics = json.load(open(tmp_path / "o" / "metrics.json"))
    assert metrics["status"] == "failed" and metrics["exit_code"] == 1 and "TrainingError" in metrics["error"]
    assert "torch" in metrics["versions"]


def test_missing_module_hints_name_the_fix():
    assert "sparkdl package --output sparkdl.zip" in _train._missing_module_hint(
        "No module named 'sparkdl'", "models:f"
    )
    assert "--py-files sparkdl.zip,models.py" in _train._missing_module_hint(
        "No module named 'sparkdl.data'", "models:f"
    )
    assert "--py-files mymodels.py" in _train._missing_module_hint("No module named 'mymodels'", "mymodels:make")
    assert "--archives env.tar.gz#env" in _train._missing_module_hint("No module named 'petastorm'", "models:f")
    assert _train._missing_module_hint("some other failure", "models:f") == ""


def test_inspect_describes_a_dataset(tmp_path, capsys):
    from examples.digits import write_dataset

    path = write_dataset(str(tmp_path / "digits"))
    assert cli.sparkdl_main(["inspect", path, "--rows", "2"]) == 0
    text = capsys.readouterr().out
    assert "1797 rows in 1 file(s), 4 row group(s)" in text
    assert "features: list<element: float>" in text and "label: int64" in text
    assert "part-00000.parquet: 450, 450, 450, 447" in text
    assert cli.sparkdl_main(["inspect", path, "--json", "--rows", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "dataset" and doc["rows"] == 1797 and len(doc["head"]) == 2
    assert doc["head"][0]["features"][-1] == "... (64 values)" and doc["head"][0]["label"] == 0


def test_inspect_describes_a_run_and_a_model(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.json").write_text(
        json.dumps(
            {
                "status": "succeeded",
                "exit_code": 0,
                "wall_seconds": 12.5,
                "history": _FakeModel.history,
                "run": {
                    "num_workers": 2,
                    "strategy": {"name": "allreduce"},
                    "dataset": {"rows": 1797},
                    "attempts": [{}],
                    "steps": {"resumed_at": 28},
                },
                "versions": {"torch": "2.13.0"},
            }
        )
    )
    assert cli.sparkdl_main(["inspect", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "succeeded in 12.5s (exit 0)" in text and "resumed at step 28" in text
    assert "60, 40" in text  # each rank's samples/s of epoch 1

    module = torch.nn.Linear(3, 2)

    model = sparkdl.TorchModel(module, history=_FakeModel.history, feature_cols=["x"], output_shape=[2])
    model.save(str(tmp_path / "model"))
    assert cli.sparkdl_main(["inspect", str(tmp_path / "model")]) == 0
    text = capsys.readouterr().out
    assert "features: x -> prediction (output shape [2])" in text
    assert cli.sparkdl_main(["inspect", str(tmp_path / "nothing")]) == 2


def test_package_zips_sparkdl_reproducibly_without_bytecode(tmp_path):
    first, second = tmp_path / "a.zip", tmp_path / "b.zip"
    info = cli.package(str(first))
    cli.package(str(second))
    assert first.read_bytes() == second.read_bytes()  # same sources, same bytes
    names = zipfile.ZipFile(first).namelist()
    assert names == sorted(names) and info["files"] == len(names)
    assert {
        "sparkdl/__init__.py",
        "sparkdl/cli/__init__.py",
        "sparkdl/cli/_train.py",
        "sparkdl/tracking.py",
        "connectors/__init__.py",
    } <= set(names)
    assert not any(n.endswith(".pyc") or "__pycache__" in n for n in names)
    sources = {
        os.path.relpath(os.path.join(d, f), os.path.dirname(os.path.dirname(sparkdl.__file__)))
        for d, _, files in os.walk(os.path.dirname(sparkdl.__file__))
        for f in files
        if f.endswith(".py")
    }
    assert {s for s in sources} <= set(names)  # every module of the package is in the zip
    assert (
        "connectors/__init__.py"
        not in zipfile.ZipFile(cli.package(str(tmp_path / "c.zip"), connectors=False)["output"]).namelist()
    )


def test_input_arguments_become_input_specs():
    import sparkdl

    inputs = cli.parse_inputs(
        [
            "image=image:jpeg_bytes:224x224x3:flip:crop=4",
            "gray=image:png:28x28x1",
            "tokens=sequence:token_ids:128:-1",
            "dense=dense:age,income",
            "user=user_id",
        ]
    )
    assert inputs["image"] == sparkdl.Image("jpeg_bytes", size=(224, 224), channels=3, random_flip=True, random_crop=4)
    assert inputs["gray"] == sparkdl.Image("png", size=(28, 28), channels=1)
    assert inputs["tokens"] == sparkdl.Sequence(
        "token_ids", max_length=128, pad_value=-1, lengths_input="tokens_lengths"
    )
    assert inputs["dense"] == ["age", "income"] and inputs["user"] == "user_id"
    for bad, message in [
        ("image", "expected NAME=SPEC"),
        ("x=image:c:224", "HxW or HxWxC"),
        ("x=image:c:8x8:blur", "unknown image option"),
        ("x=sequence:c", "sequence:COLUMN:MAX_LENGTH"),
        ("x=a,b", "SPEC must be"),
        ("x=sequence:c:many", "invalid literal"),
    ]:
        with pytest.raises(cli.UsageError, match=message):
            cli.parse_inputs([bad])
    with pytest.raises(cli.UsageError, match="given twice"):
        cli.parse_inputs(["a=x", "a=y"])
    assert "image:COLUMN:HxW" in cli.build_parser().format_help()


def test_metric_options_reach_the_estimator_and_compute_what_they_name(tmp_path, monkeypatch, capsys):
    captured = {}
    _fake_spark(monkeypatch, captured)
    code = cli.main(
        [
            "--data",
            "/d",
            "--model",
            "tests.models:digits_mlp",
            "--features",
            "f",
            "--label",
            "l",
            "--output",
            str(tmp_path / "o"),
            "--validation",
            "0.2",
            "--metric",
            "accuracy",
            "--metric",
            "mae",
        ]
    )
    assert code == 0
    metrics = captured["estimator"]["metrics"]
    assert sorted(metrics) == ["accuracy", "mae"]
    logits, labels = (
        torch.tensor([[2.0, 0.1, 0.3], [0.0, 1.0, 3.0], [1.0, 0.0, 0.0], [0.0, 5.0, 1.0]]),
        torch.tensor([0, 2, 1, 1]),
    )
    assert metrics["accuracy"](logits, labels).item() == 0.75
    assert metrics["accuracy"](torch.tensor([[1.5], [-0.2], [0.3]]), torch.tensor([1, 0, 0])).item() == pytest.approx(
        2 / 3
    )  # binary logits
    assert metrics["mae"](torch.tensor([[1.0], [3.0]]), torch.tensor([2.0, 2.0])).item() == 1.0
    capsys.readouterr()
    assert (
        cli.main(
            [
                "--data",
                "/d",
                "--model",
                "tests.models:digits_mlp",
                "--features",
                "f",
                "--label",
                "l",
                "--output",
                str(tmp_path / "p"),
                "--metric",
                "accuracy",
            ]
        )
        == 2
    )  # before Spark starts
    assert "--metric is computed on held-out rows: give --validation FRACTION" in capsys.readouterr().err


def test_a_run_ends_with_its_final_figures_and_where_the_model_is():
    document = {
        "wall_seconds": 12.34,
        "history": [
            {"epoch": 1, "loss": 1.5, "val_loss": 1.6, "val_accuracy": 0.5},
            {
                "epoch": 2,
                "loss": 0.25,
                "val_loss": 0.3,
                "val_accuracy": 0.9375,
                "val_samples": 360,
                "samples_per_sec": 900.0,
            },
        ],
    }
    line = _train.summary_line(document, "/runs/a")
    assert line == (
        "sparkdl-train: done in 12.3s, 2 epoch(s): final loss 0.2500, val_loss 0.3000, val_accuracy 0.9375; "
        "model in /runs/a/model, metrics in /runs/a/metrics.json"
    )


def test_model_module_in_the_current_directory_is_imported_and_shipped_by_value(tmp_path, monkeypatch):
    # `sparkdl train|compare --model here:make` run where here.py is: a console script's sys.path
    # does not hold the current directory, and the executors have no copy of it.
    from sparkdl.cli import _common

    name = "sparkdl_cwd_model_under_test"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.layer = torch.nn.Linear(3, 2)\n\n    def forward(self, x):\n        return self.layer(x)\n\n"
        "def make():\n    return Net()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        factory = _common.load_factory(f"{name}:make")
        assert isinstance(factory(), torch.nn.Module)
        import cloudpickle
        from pyspark import cloudpickle as spark_cloudpickle

        # Unpickled where the module is not importable (as on an executor): it came by value.
        load = "import pickle, sys; m = pickle.loads(sys.stdin.buffer.read())(); print(type(m).__name__, m.layer.out_features)"
        for pickler in (cloudpickle, spark_cloudpickle):
            done = subprocess.run(
                [sys.executable, "-c", load],
                input=pickler.dumps(factory),
                capture_output=True,
                timeout=120,
                cwd=REPO_ROOT,
            )
            assert done.returncode == 0 and done.stdout.decode().split() == ["Net", "2"], done.stderr.decode()[-2000:]
    finally:
        module = sys.modules.pop(name, None)
        if module is not None:
            import cloudpickle
            from pyspark import cloudpickle as spark_cloudpickle

            for pickler in (cloudpickle, spark_cloudpickle):
                if name in pickler.list_registry_pickle_by_value():
                    pickler.unregister_pickle_by_value(module)


def test_a_model_module_found_nowhere_gets_advice_the_command_can_follow(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    for command in ("train", "compare"):
        code = cli.sparkdl_main(
            [
                command,
                "--data",
                "/d",
                "--model",
                "nowhere_models:make",
                "--features",
                "f",
                "--label",
                "l",
                "--output",
                str(tmp_path / command),
            ]
        )
        err = capsys.readouterr().err
        assert code == 2 and "cannot import 'nowhere_models'" in err, err
        assert "run the command where nowhere_models.py is, or add its directory to PYTHONPATH" in err
        assert "--py-files" not in err  # neither command takes it; only spark-submit does
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # a driver spark-submit started
    with pytest.raises(cli.UsageError, match="under spark-submit, ship it with --py-files nowhere_models.py"):
        cli.load_factory("nowhere_models:make")


def test_pyspark_pandas3_warning_is_filtered_once_sparkdl_runs_spark_and_nothing_else_is():
    import pandas

    # pyspark.testing.utils checks the pandas version at import, as sparkdl's first mapInArrow
    # does: the warning that opened every demo and notebook run.
    script = (
        "import sys, warnings\n"
        "if sys.argv[1] == 'sparkdl':\n    import sparkdl.estimator\n"
        "warnings.warn_explicit('another pyspark FutureWarning', FutureWarning, 'x.py', 1, module='pyspark.sql.other')\n"
        "import pyspark.testing.utils\n"
    )
    quiet = subprocess.run(
        [sys.executable, "-c", script, "sparkdl"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "PySpark does not yet fully support pandas" not in quiet.stderr
    assert "another pyspark FutureWarning" in quiet.stderr  # only that one message is filtered
    if int(pandas.__version__.split(".")[0]) >= 3:  # the stack where PySpark warns at all
        plain = subprocess.run(
            [sys.executable, "-c", script, "plain"], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
        )
        assert "PySpark does not yet fully support pandas >= 3.0.0" in plain.stderr


def test_the_estimator_takes_the_metric_names_the_command_line_takes():
    from sparkdl._runtime.validation import METRICS

    make = lambda: torch.nn.Linear(64, 10)  # noqa: E731
    parser_choices = next(a.choices for a in cli.build_parser()._actions if a.dest == "metrics")
    assert sorted(parser_choices) == sorted(METRICS)  # one vocabulary
    for name in METRICS:
        estimator = sparkdl.TorchEstimator(model=make, validation=0.2, metrics=[name], progress=False)
        assert estimator.settings.data.metrics == {name: METRICS[name]}
    assert sparkdl.TorchEstimator(model=make, validation=0.2, metrics="accuracy").settings.data.metrics == {
        "accuracy": METRICS["accuracy"]
    }
    with pytest.raises(sparkdl.ConfigError, match=r"unknown metric 'acc'; named metrics are accuracy, mae, mse"):
        sparkdl.TorchEstimator(model=make, validation=0.2, metrics=["acc"])


def test_predict_keep_columns_are_parsed_keep_the_label_and_are_checked_against_the_data():
    from sparkdl.cli._common import UsageError
    from sparkdl.cli._predict import _check_columns, _keep_columns, _options, build_predict_parser

    def parsed(*flags):
        return build_predict_parser().parse_args(["--model", "m", "--data", "d", "--output", "o", *flags])

    assert _keep_columns(parsed()) is None
    assert _keep_columns(parsed("--keep-columns", "id, user")) == ["id", "user"]
    assert _keep_columns(parsed("--keep-columns", "id", "--label", "y")) == ["id", "y"]  # the evaluation reads it
    with pytest.raises(UsageError, match="--keep-columns names no column"):
        _keep_columns(parsed("--keep-columns", ","))
    with pytest.raises(UsageError, match=r"--keep-columns names \['user'\], not columns of d; its columns are"):
        _check_columns(parsed("--keep-columns", "id,user"), ["id", "x"])
    _check_columns(parsed("--keep-columns", "id", "--label", "x"), ["id", "x"])
    assert _options(parsed("--optimize", "off")) == {"optimize": "off"} and _options(parsed()) == {}
