"""sparkdl as a pip user has it: the wheel built from this checkout, installed (not editable) into
a fresh virtualenv by scripts/bootstrap's py313 stack, runs the quick start's fit with the job
that ships in the package (``sparkdl submit train``), from a folder outside the checkout.

Marked ``installed``: scripts/test selects it on the py313 stack only, whose virtualenv holds the
wheel (the other stacks install the checkout editable)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.installed, pytest.mark.spark, pytest.mark.slow]


def _outside_the_checkout(tmp_path) -> dict:
    """The environment of a user's shell: this virtualenv's commands first, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_dir = os.path.dirname(sys.executable)
    env.update(
        PATH=bin_dir + os.pathsep + env.get("PATH", ""),
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
        HOME=str(tmp_path),  # nothing of the developer's (~/.pydistutils.cfg, user site) joins in
    )
    return env


def test_the_installed_wheel_runs_the_demos_fit_from_outside_the_checkout(tmp_path):
    env = _outside_the_checkout(tmp_path)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, importlib.metadata as m, sparkdl; "
            "print(json.dumps({'file': sparkdl.__file__, 'python': list(sys.version_info[:2]), "
            "'direct_url': json.loads(m.distribution('sparkdl-torch').read_text('direct_url.json') or '{}')}))",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    installed = json.loads(probe.stdout)
    # Imported from the virtualenv's site-packages, from a wheel: not the checkout, not an editable install.
    assert os.path.realpath(installed["file"]).startswith(os.path.realpath(sys.prefix) + os.sep), installed
    assert "site-packages" in installed["file"], installed
    assert installed["direct_url"].get("url", "").endswith(".whl"), installed
    assert not installed["direct_url"].get("dir_info", {}).get("editable"), installed

    shutil.copy(os.path.join(REPO_ROOT, "examples", "digits.py"), tmp_path / "digits.py")
    written = subprocess.run(
        [sys.executable, "digits.py", "data"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert written.returncode == 0, written.stderr[-3000:]
    output = (tmp_path / "run").as_uri()  # outputs are URLs
    submit = [
        os.path.join(os.path.dirname(sys.executable), "sparkdl"),
        "submit",
        "train",
        "--master",
        "local-cluster[2,1,1024]",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        f"spark.sparkdl.cacheDir={tmp_path / 'cache'}",
        "--",
        "--data",
        "data",
        "--model",
        "digits:make_model",
        "--features",
        "features",
        "--label",
        "label",
        "--num-workers",
        "2",
        "--epochs",
        "4",
        "--batch-size",
        "32",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--validation",
        "0.2",
        "--metric",
        "accuracy",
        "--output",
        output,
    ]
    done = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    assert done.stdout.strip().splitlines()[-1].startswith("sparkdl-train: done in ")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "succeeded" and [r["epoch"] for r in metrics["history"]] == [1, 2, 3, 4]
    assert metrics["versions"]["python"].startswith(".".join(map(str, installed["python"]))), metrics["versions"]
    assert metrics["history"][-1]["val_accuracy"] > 0.85
    assert (tmp_path / "run" / "model" / "metadata.json").is_file()
