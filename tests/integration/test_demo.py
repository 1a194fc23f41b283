"""The README's first command, as written: scripts/demo trains digits with spark-submit on a local
cluster and ends with the figures a user wants first. Marked spark as well as slow so that it runs
once, on the quick start's own stack (the demo always uses .venv)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_the_demo_trains_reports_validation_accuracy_and_says_where_the_model_is(tmp_path):
    env = dict(os.environ, SPARKDL_DEMO_DIR=str(tmp_path), EPOCHS="4")
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, "scripts", "demo")], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # PySpark's pandas-3 FutureWarning no longer opens the run (filtered in sparkdl._spark).
    assert "PySpark does not yet fully support pandas" not in done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    epochs = [line for line in lines if line.startswith("[sparkdl] epoch ")]
    assert [line.split()[2] for line in epochs] == ["1/4", "2/4", "3/4", "4/4"]
    last = lines[-1]
    found = re.fullmatch(
        r"sparkdl-train: done in [0-9.]+s, 4 epoch\(s\): final loss ([0-9.]+), val_loss ([0-9.]+), val_accuracy ([0-9.]+); "
        r"model in (\S+), metrics in (\S+)",
        last,
    )
    assert found, last
    loss, val_loss, val_accuracy = (float(found.group(i)) for i in (1, 2, 3))
    assert found.group(4) == str(tmp_path / "run" / "model") and found.group(5) == str(
        tmp_path / "run" / "metrics.json"
    )
    history = json.load(open(tmp_path / "run" / "metrics.json"))["history"]
    assert (history[-1]["loss"], history[-1]["val_loss"], history[-1]["val_accuracy"]) == pytest.approx(
        (loss, val_loss, val_accuracy), abs=5e-5
    )
    assert val_accuracy > 0.85 and os.path.isfile(tmp_path / "run" / "model" / "metadata.json")
