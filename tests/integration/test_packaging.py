"""Executors without sparkdl installed: the job fails with a message that says how to ship it, and
succeeds once `sparkdl package`'s zip goes with --py-files.

The executors run an interpreter that sees the pinned third-party stack but not sparkdl: a tiny
venv whose site-packages holds a plain .pth line naming .venv's site-packages. A plain path line
does not process the .pth files inside that directory, so .venv's editable-install hook for
sparkdl is not loaded. The driver runs .venv's Python (it has sparkdl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

import sparkdl
from examples.digits import write_dataset
from tests.conftest import REPO_ROOT
from tests.models import digits_mlp

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def executor_python(tmp_path_factory):
    """A Python with torch, pyspark, pyarrow... but no sparkdl, and checked to be so."""
    root = tmp_path_factory.mktemp("executor-venv")
    venv.EnvBuilder(with_pip=False).create(str(root))
    site = subprocess.run(
        [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "pinned-stack.pth"), "w") as handle:
        handle.write(sysconfig.get_paths()["purelib"] + "\n")  # .venv's site-packages, as a plain path
    python = str(root / "bin" / "python")
    probe = subprocess.run(
        [
            python,
            "-c",
            "import torch, pyspark, pyarrow\ntry:\n import sparkdl\nexcept ImportError:\n print('no sparkdl')",
        ],
        capture_output=True,
        text=True,
        cwd=str(root),
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert probe.returncode == 0 and probe.stdout.strip() == "no sparkdl", probe.stdout + probe.stderr
    return python


def _submit(executor_python, tmp_path, py_files, output):
    data = write_dataset(str(tmp_path / "digits"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    command = [
        os.path.join(BIN, "spark-submit"),
        "--master",
        "local[2]",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        f"spark.pyspark.python={executor_python}",  # executors: no sparkdl
        "--conf",
        f"spark.pyspark.driver.python={sys.executable}",  # driver: .venv, with sparkdl
        "--conf",
        f"spark.sparkdl.cacheDir={tmp_path}/cache",
        "--driver-java-options",
        f"-Dlog4j.configurationFile=file:{REPO_ROOT}/jobs/log4j2.properties",
        "--py-files",
        ",".join(py_files),
        os.path.join(REPO_ROOT, "jobs", "train.py"),
        "--data",
        data,
        "--model",
        "models:digits_mlp",
        "--features",
        "features",
        "--label",
        "label",
        "--num-workers",
        "2",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--output",
        output,
    ]
    # cwd away from the repository, so nothing finds sparkdl/ by accident.
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path))


def test_missing_sparkdl_on_executors_fails_with_how_to_ship_it(executor_python, tmp_path):
    output = str(tmp_path / "run")
    result = _submit(executor_python, tmp_path, [os.path.join(REPO_ROOT, "tests", "models.py")], output)
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    message = next(
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.startswith("sparkdl-train: training failed")
    )
    assert "No module named 'sparkdl'" in message
    assert "--py-files / --archives" in message  # the launcher's advice
    text = result.stdout + result.stderr
    assert "sparkdl package --output sparkdl.zip" in text and "--py-files sparkdl.zip,models.py" in text
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    assert metrics["status"] == "failed" and metrics["exit_code"] == 1
    assert "sparkdl package" in metrics["error"]


def test_sparkdl_zip_on_py_files_trains_on_executors_without_sparkdl(executor_python, tmp_path):
    zip_path = str(tmp_path / "sparkdl.zip")
    built = subprocess.run(
        [os.path.join(BIN, "sparkdl"), "package", "--output", zip_path], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == zip_path
    names = zipfile.ZipFile(zip_path).namelist()
    assert (
        "sparkdl/__init__.py" in names
        and "sparkdl/strategies/allreduce.py" in names
        and "connectors/__init__.py" in names
    )

    output = str(tmp_path / "run")
    result = _submit(executor_python, tmp_path, [zip_path, os.path.join(REPO_ROOT, "tests", "models.py")], output)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    assert metrics["status"] == "succeeded"
    assert [r["epoch"] for r in metrics["history"]] == [1, 2]
    assert metrics["history"][-1]["loss"] < metrics["history"][0]["loss"]
    model = sparkdl.TorchModel.load(os.path.join(output, "model"), model=digits_mlp)
    assert sum(p.numel() for p in model.module.parameters()) == sum(p.numel() for p in digits_mlp().parameters())


def test_building_sparkdl_prints_no_warning_of_its_own_packaging(tmp_path):
    """What `pip install sparkdl-torch` runs (an isolated PEP 517 build), on a copy of the sources so
    nothing is written into the checkout; setuptools' deprecation warnings would show here."""
    import shutil

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO_ROOT, name), source / name)
    for package in ("sparkdl", "connectors"):
        shutil.copytree(
            os.path.join(REPO_ROOT, package), source / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", str(source), "-w", str(tmp_path / "wheel")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = built.stdout + built.stderr
    assert built.returncode == 0, output
    ours = [
        line for line in output.splitlines() if "warning" in line.lower() and "is ignored" not in line
    ]  # pip's own index notes
    assert ours == [], output
    [wheel] = os.listdir(tmp_path / "wheel")
    with zipfile.ZipFile(tmp_path / "wheel" / wheel) as archive:
        metadata = archive.read(f"sparkdl_torch-{sparkdl.__version__}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "\nName: sparkdl-torch\n" in metadata
