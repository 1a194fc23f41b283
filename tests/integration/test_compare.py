"""sparkdl.compare on a real local-cluster: the table, JSON and PNG of two strategies on digits, its
AllReduce row against a plain fit, a slowed worker, and ``sparkdl compare`` end to end. (Without
Spark: tests/unit/test_compare.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import sparkdl
from examples.digits import write_dataset
from tests.conftest import REPO_ROOT
from tests.models import digits_mlp

pytestmark = pytest.mark.spark


def _adam(params):
    return torch.optim.Adam(params, lr=3e-3)


def _accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


#: What every fit below shares; only the strategy (and the straggler) changes.
COMMON = dict(model=digits_mlp, optimizer=_adam, num_workers=2, batch_size=32, seed=0)
VALIDATED = dict(validation=0.2, metrics={"accuracy": _accuracy})
PARAMS = sum(p.numel() for p in digits_mlp().parameters())


@pytest.fixture(scope="module")
def compared(digits_df, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    comparison = sparkdl.compare(
        data=digits_df,
        strategies=[sparkdl.AllReduce(), sparkdl.ModelAveraging(sync_every=4)],
        epochs=2,
        target_loss=1.5,
        output_dir=str(out),
        **COMMON,
        **VALIDATED,
    )
    return comparison, out


def test_compare_writes_one_row_per_strategy_to_json_and_png_with_plausible_figures(compared):
    comparison, out = compared
    assert comparison.ok, comparison.table()
    document = json.load(open(out / "compare.json"))
    assert [row["label"] for row in document["rows"]] == ["AllReduce()", "ModelAveraging(sync_every=4)"]
    assert document["settings"]["epochs"] == 2 and document["settings"]["slowed"] is None
    assert document["versions"]["torch"] == torch.__version__
    for row in document["rows"]:
        assert row["status"] == "ok" and [p["epoch"] for p in row["curve"]] == [1, 2]
        assert row["samples_per_sec"] > 0 and row["steady_epochs"] == [2] and len(row["rank_samples_per_sec"]) == 2
        assert row["loss"] < row["history"][0]["loss"] and row["validation"]["val_accuracy"] > 0.5
        reached = [p for p in row["curve"] if p["loss"] <= 1.5]
        assert row["time_to_target_s"] == (reached[0]["seconds"] if reached else None)
    allreduce, averaging = comparison.rows
    # DDP sends every float32 gradient each step, for batch_size samples per rank...
    assert allreduce.comm_bytes_per_sample == pytest.approx(PARAMS * 4 / 32)
    # ... model averaging the parameters every 4th step: about a quarter (steps per epoch are
    # not a multiple of 4, so not exactly).
    assert 3.0 <= allreduce.comm_bytes_per_sample / averaging.comm_bytes_per_sample <= 5.0
    with open(out / "compare.png", "rb") as handle:
        png = handle.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    table = comparison.table()
    assert "| AllReduce() |" in table and "| ModelAveraging(sync_every=4) |" in table and "val_accuracy" in table


def test_the_allreduce_row_equals_a_plain_fit_with_the_same_settings(compared, digits_df):
    comparison, _ = compared
    row = comparison.row("AllReduce()")
    plain = sparkdl.TorchEstimator(strategy=sparkdl.AllReduce(), epochs=2, progress=False, **COMMON, **VALIDATED).fit(
        digits_df
    )
    history = plain.history
    # AllReduce is deterministic for a seed: the same losses to rounding, the same traffic exactly.
    assert row.loss == pytest.approx(history[-1]["loss"], rel=1e-9, abs=1e-12)
    assert row.validation["val_accuracy"] == pytest.approx(history[-1]["val_accuracy"], rel=1e-9)
    comm_per_sample = sum(r["comm_bytes"] for r in history) * 2 / sum(r["samples"] for r in history)
    assert row.comm_bytes_per_sample == comm_per_sample
    assert row.samples == sum(r["samples"] for r in history)


def test_a_slowed_worker_holds_back_the_synchronous_strategy_but_not_the_asynchronous_one(compared, digits_df):
    unslowed = compared[0].row("AllReduce()")
    slow_s, batch = 0.02, COMMON["batch_size"]
    comparison = sparkdl.compare(
        data=digits_df,
        strategies={"sync": sparkdl.AllReduce(), "async": sparkdl.ParameterServer()},
        epochs=2,
        slow_rank=1,
        slow_s=slow_s,
        **COMMON,
    )
    assert comparison.ok, comparison.table()
    assert comparison.settings["slowed"] == {"rank": 1, "seconds_per_step": slow_s}
    assert "slowed worker ON: rank 1 sleeps 0.02 s" in comparison.table()
    sync, asynchronous = comparison.row("sync"), comparison.row("async")
    # Rank 1 sleeps before every step, so it cannot exceed batch / slow_s samples per second...
    assert asynchronous.rank_samples_per_sec[1] <= batch / slow_s
    assert sync.rank_samples_per_sec[1] <= batch / slow_s
    # ... AllReduce's rank 0 waits for it at every step (10% for the epochs' start skew) ...
    assert sync.samples_per_sec <= 2 * batch / slow_s * 1.1 and sync.samples_per_sec < unslowed.samples_per_sec
    # ... and the parameter server's rank 0 does not.
    assert asynchronous.rank_samples_per_sec[0] > 1.5 * asynchronous.rank_samples_per_sec[1]


@pytest.mark.slow
def test_cli_compare_end_to_end_prints_the_table_keeps_a_failed_strategy_and_exits_1(tmp_path):
    data = write_dataset(str(tmp_path / "digits"))
    output = tmp_path / "out"
    # --model from a module in the current directory, as `sparkdl train --model` takes it.
    (tmp_path / "digits_here.py").write_text(
        "import torch\n\ndef make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n"
    )
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        os.path.join(os.path.dirname(sys.executable), "sparkdl"),
        "compare",
        "--master",
        "local[2]",
        "--data",
        data,
        "--model",
        "digits_here:make",
        "--features",
        "features",
        "--label",
        "label",
        "--num-workers",
        "2",
        "--epochs",
        "1",
        "--quiet",
        # alpha * num_workers = 1.8: EASGD's center update would diverge, so that fit fails at start-up.
        "--strategies",
        "allreduce,elastic_averaging:alpha=0.9",
        "--output",
        str(output),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| AllReduce() |" in result.stdout and "| ElasticAveraging(alpha=0.9) | FAILED (" in result.stdout
    assert "failed: ElasticAveraging(alpha=0.9)" in result.stderr
    assert "PySpark does not yet fully support pandas" not in result.stderr  # filtered where sparkdl runs Spark
    document = json.load(open(output / "compare.json"))
    rows = {row["label"]: row for row in document["rows"]}
    assert rows["AllReduce()"]["status"] == "ok" and rows["AllReduce()"]["samples"] == (1797 // 64) * 64
    assert (
        rows["ElasticAveraging(alpha=0.9)"]["status"] == "failed"
        and "alpha" in rows["ElasticAveraging(alpha=0.9)"]["error"]
    )
    assert document["status"] == "failed: ElasticAveraging(alpha=0.9)"
    assert (output / "compare.png").stat().st_size > 5000
