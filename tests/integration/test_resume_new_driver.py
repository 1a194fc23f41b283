"""A DataFrame run resumed by a new driver process after its first driver died: the copy kept
beside the checkpoints (sparkdl/data/kept_copy.py) outlives the driver, the second driver reuses
it, and every row of the interrupted epoch is trained exactly once (counted on row ids); the
copy is deleted when the run completes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import sparkdl
from sparkdl.checkpoint import CheckpointConfig, open_store
from sparkdl.data import kept_copy
from tests.conftest import REPO_ROOT
from tests.integration.test_cache import _alive, _descendants, _disk
from tests.integration.test_elastic import ALL_ROWS, BATCH, ROWS, _epoch_ids, write_ids_data

pytestmark = pytest.mark.spark

EPOCHS = 2


class CrashingLoop:
    """Trains and logs the ids of every batch (one JSON line per batch, one file per driver and
    rank, read by test_elastic's ``_epoch_ids``). The first driver's ranks checkpoint at global
    step ``checkpoint_at``, then rank 0 says so in a marker file and every rank waits (bounded)
    for the test to kill their driver."""

    def __init__(self, log_dir: str, checkpoint_at: int, driver: int) -> None:
        self.log_dir, self.checkpoint_at, self.driver = log_dir, checkpoint_at, driver

    def __call__(self, ctx):
        model = ctx.prepare_model(torch.nn.Linear(2, 2))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
        epoch, step, global_step = 1, 0, 0
        restored = ctx.load_checkpoint()
        if restored is not None:
            model.load_state_dict(restored["model"])
            optimizer.load_state_dict(restored["optimizer"])
            epoch, step, global_step = restored["loop"]
        log = open(os.path.join(self.log_dir, f"ids-{self.driver}-{ctx.rank}.jsonl"), "a")
        while epoch <= EPOCHS:
            for features, labels in ctx.epoch_batches(skip=step):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(features.float()), labels).backward()
                optimizer.step()
                step, global_step = step + 1, global_step + 1
                ids = features[:, 0].long().tolist()
                log.write(json.dumps({"epoch": epoch, "step": global_step, "ids": ids}) + "\n")
                log.flush()
                if self.driver == 1 and global_step == self.checkpoint_at:
                    weights = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                    ctx.save_checkpoint({"loop": [epoch, step, global_step]}, step=global_step, replicated=weights)
                    self._wait_for_the_driver_to_die(ctx.rank)
            epoch, step = epoch + 1, 0
        log.close()
        return {"resumed_from": ctx.resumed_from, "world_size": ctx.world_size}

    def _wait_for_the_driver_to_die(self, rank: int) -> None:
        if rank == 0:  # the checkpoint is committed: save_checkpoint is synchronous (checkpoint_async=False)
            open(os.path.join(self.log_dir, "checkpointed"), "w").close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.1)
        raise RuntimeError("the first driver was not stopped within 120 s")


def _fit(spark, df, loop, num_workers, checkpoint_dir):
    return sparkdl.run(
        loop,
        num_workers=num_workers,
        data=df,
        feature_cols=["id", "x0"],
        label_col="label",
        batch_size=BATCH,
        seed=0,
        spark=spark,
        progress=False,
        checkpoint_dir=checkpoint_dir,
        checkpoint_async=False,
    )


# The first driver: a script of its own (its own process, JVM and executors), fitting a DataFrame
# on 2 workers until the test stops it.
_FIRST_DRIVER = """
import sys
sys.path[:0] = [{root!r}]
from pyspark.sql import SparkSession, functions as F
from tests.integration.test_resume_new_driver import CrashingLoop, _fit

spark = (
    SparkSession.builder.master("local[2]").appName("sparkdl-first-driver")
    .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.local.dir", {local_dir!r})
    .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate()
)
df = spark.read.parquet({data!r}).orderBy(F.rand(3))
_fit(spark, df, CrashingLoop({log_dir!r}, {at}, driver=1), 2, {checkpoint_dir!r})
"""


def _start_first_driver(tmp_path, data, log_dir, at, checkpoint_dir):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(temp),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": REPO_ROOT,
    }
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    script = _FIRST_DRIVER.format(
        root=REPO_ROOT, local_dir=str(temp), data=data, log_dir=log_dir, at=at, checkpoint_dir=checkpoint_dir
    )
    with open(tmp_path / "first-driver.log", "w") as output:
        return subprocess.Popen(
            [sys.executable, "-c", script], env=env, cwd=str(tmp_path), stdout=output, stderr=subprocess.STDOUT
        )


def _stop(driver, tmp_path):
    """SIGTERMs the first driver (how Airflow, Kubernetes and YARN stop one: sparkdl's own
    clean-up runs) once its checkpoint is committed; ends what it started, by PID."""
    marker = os.path.join(tmp_path, "log", "checkpointed")
    descendants = []
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(marker):  # bounded poll on another process's file
            assert driver.poll() is None and time.monotonic() < deadline, _output(tmp_path)
            time.sleep(0.1)
        descendants = _descendants(driver.pid)
        driver.terminate()
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        deadline = time.monotonic() + 30
        while [pid for pid in descendants if _alive(pid)] and time.monotonic() < deadline:  # its JVM and workers go
            time.sleep(0.1)
        for pid in descendants:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert driver.returncode == -signal.SIGTERM, _output(tmp_path)


def _output(tmp_path):
    return (tmp_path / "first-driver.log").read_text()[-3000:]


def test_a_second_driver_resumes_a_dead_drivers_dataframe_run_with_every_row_of_the_epoch_once(
    spark, tmp_path_factory, tmp_path, caplog
):
    from pyspark.sql import functions as F

    data = write_ids_data(tmp_path_factory)
    log_dir, checkpoint_dir = tmp_path / "log", str(tmp_path / "ckpt")
    log_dir.mkdir()
    steps = ROWS // (BATCH * 2)
    at = steps + steps // 2 - 1  # mid-epoch 2 on 2 workers
    driver = _start_first_driver(tmp_path, data, str(log_dir), at, checkpoint_dir)
    _stop(driver, tmp_path)

    checkpoint = open_store(CheckpointConfig(checkpoint_dir)).load_latest()
    assert checkpoint.step == at and checkpoint.world_size == 2
    copy = tmp_path / "ckpt" / kept_copy.DIRECTORY
    record = json.loads((copy / kept_copy.RECORD).read_text())
    assert record["rows"] == ROWS and (copy / record["copy"]).is_dir(), _disk(copy)  # outlived its driver
    # This process is the second driver: it never materialized this DataFrame, and its rows
    # come in another order than the first driver's (another seed).
    df = spark.read.parquet(data).orderBy(F.rand(4))
    with caplog.at_level(logging.INFO, logger="sparkdl"):
        result = _fit(spark, df, CrashingLoop(str(log_dir), at, driver=2), 1, checkpoint_dir)

    assert result == {"resumed_from": 2, "world_size": 1}
    assert "reusing the DataFrame's copy kept beside the checkpoints" in caplog.text
    assert "cannot be replayed" not in caplog.text
    assert _epoch_ids(str(log_dir), 1, 1) == ALL_ROWS
    before, after = _epoch_ids(str(log_dir), 1, 2, until_step=at), _epoch_ids(str(log_dir), 2, 2)
    assert sum(before.values()) == (at - steps) * BATCH * 2
    assert before + after == ALL_ROWS, "the interrupted epoch lost or repeated rows"
    # Completed: the result is stored with the checkpoints, the copy is gone.
    assert not copy.exists(), _disk(copy)
    assert open_store(CheckpointConfig(checkpoint_dir)).load_finished()[0]


def test_a_dataframe_of_the_same_rows_reuses_the_kept_copy_other_rows_replace_it(spark, tmp_path, caplog):
    """Array features, stored as float32 bytes: the record's fingerprint (of the copy as
    written) matches the DataFrame's rows packed the same way, in any order; a changed value,
    or resume=False, writes a new copy; the completed run deletes it."""
    from sparkdl._driver.dataframe_copy import remove_after_run
    from sparkdl._driver.prepare_data import prepare_dataset

    rows = [([float(i), i / 3.0], i % 2) for i in range(40)]
    schema = "features array<double>, label long"
    checkpoint = CheckpointConfig(str(tmp_path / "ckpt"))
    copy = tmp_path / "ckpt" / kept_copy.DIRECTORY

    def prepare(data, config=checkpoint):
        df = spark.createDataFrame(data, schema)
        return prepare_dataset(df, ["features"], 2, spark, label_col="label", pack_arrays=True, checkpoint=config).url

    first = prepare(rows)
    record = json.loads((copy / kept_copy.RECORD).read_text())
    assert first == f"file://{copy}/{record['copy']}" and record["layout"] == ["features"] and record["rows"] == 40
    assert record["schema"] == [["features", "array<float>"], ["label", "bigint"]]
    with caplog.at_level(logging.INFO, logger="sparkdl"):
        assert prepare(rows[::-1]) == first  # the same rows, another order and plan
    assert "reusing the DataFrame's copy kept beside the checkpoints" in caplog.text
    caplog.clear()
    relabeled = [(features, 1 - label if i == 7 else label) for i, (features, label) in enumerate(rows)]
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        changed = prepare(relabeled)
    assert changed != first and "it has 40 rows like the copy, but not the same values" in caplog.text
    assert sorted(os.listdir(copy)) == sorted([os.path.basename(changed), kept_copy.RECORD])  # the old copy is gone
    fresh = prepare(relabeled, CheckpointConfig(checkpoint.url, resume=False))  # a run from scratch: a new copy
    assert fresh != changed and sorted(os.listdir(copy)) == sorted([os.path.basename(fresh), kept_copy.RECORD])
    remove_after_run(checkpoint)
    assert not copy.exists()
