"""Failures on a real cluster reach the driver as one clear error, fast, and leave Spark usable."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import sparkdl
from tests.models import digits_mlp

pytestmark = pytest.mark.spark

# Generous bound for "never a hang" on a loaded 2-core machine; a hang would be minutes.
FAILURE_BOUND_S = 90


def _cluster_still_trains(spark):
    assert sparkdl.run(lambda ctx: ctx.world_size, num_workers=2, spark=spark, progress=False) == 2


def test_exception_in_one_rank_names_the_rank_and_keeps_its_traceback(spark):
    def train_fn(ctx):
        if ctx.rank == 1:
            raise ValueError("bad thing on purpose")
        torch.distributed.barrier()  # rank 0 would wait forever for rank 1 without cancellation
        return "unreachable"

    started = time.monotonic()
    with pytest.raises(sparkdl.TrainingError) as info:
        sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False)
    assert time.monotonic() - started < FAILURE_BOUND_S
    error = info.value
    assert error.rank == 1
    assert error.exc_type == "ValueError"
    assert "rank 1" in str(error) and "bad thing on purpose" in str(error)
    assert "train_fn" in error.remote_traceback and 'raise ValueError("bad thing on purpose")' in error.remote_traceback
    _cluster_still_trains(spark)


def test_nan_loss_fails_with_the_rank_epoch_and_setting(spark, digits_df):
    def exploding_loss(output, label):
        return torch.nn.functional.cross_entropy(output, label) * float("nan")

    estimator = sparkdl.TorchEstimator(model=digits_mlp, loss=exploding_loss, num_workers=2, epochs=2, progress=False)
    with pytest.raises(sparkdl.TrainingError) as info:
        estimator.fit(digits_df)
    assert info.value.exc_type == "NonFiniteLossError"
    assert "loss is nan at epoch 1, step 1" in str(info.value)
    assert "learning rate" in str(info.value)


def test_a_nan_loss_on_one_rank_names_that_rank_and_step_though_it_spreads(spark, digits_df):
    calls = [0]

    def loss_nan_on_rank_1_at_step_5(output, label):
        loss = torch.nn.functional.cross_entropy(output, label)
        if not torch.distributed.is_initialized():
            return loss  # the driver's preflight
        calls[0] += 1  # one process per rank: this rank's step
        return loss * float("nan") if torch.distributed.get_rank() == 1 and calls[0] == 5 else loss

    # Rank 1's NaN gradients reach rank 0 through the allreduce, so rank 0's loss is NaN from
    # step 6; both ranks notice at the same periodic check, and rank 1's step 5 is the cause.
    estimator = sparkdl.TorchEstimator(
        model=digits_mlp, loss=loss_nan_on_rank_1_at_step_5, num_workers=2, batch_size=16, epochs=1, progress=False
    )
    with pytest.raises(sparkdl.TrainingError) as info:
        estimator.fit(digits_df)
    assert info.value.rank == 1 and info.value.exc_type == "NonFiniteLossError"
    assert "loss is nan at epoch 1, step 5 on rank 1" in str(info.value)
    assert str(info.value).startswith("training failed on rank 1 while training step 5 ")


def test_a_rank_whose_process_dies_fails_the_fit_and_names_it(spark):
    def train_fn(ctx):
        torch.distributed.barrier()
        if ctx.rank == 1:
            os._exit(3)  # what the OOM killer looks like from the inside: no exception, no report
        torch.distributed.barrier()
        return "unreachable"

    started = time.monotonic()
    with pytest.raises(sparkdl.TrainingError) as info:
        sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False)
    assert time.monotonic() - started < FAILURE_BOUND_S
    assert info.value.rank == 1
    assert info.value.exc_type == "WorkerLost"
    assert "exited without reporting" in str(info.value)
    _cluster_still_trains(spark)


def test_too_few_slots_fails_within_seconds_naming_both_numbers(spark):
    from sparkdl._driver import check_slots
    from sparkdl._task.config import LaunchConfig

    check_slots(spark.sparkContext, 2, wait_s=300)  # returns once both executors have registered
    tracker = spark.sparkContext.statusTracker()
    jobs_before = set(tracker.getJobIdsForGroup())
    started = time.monotonic()
    with pytest.raises(sparkdl.InsufficientSlotsError) as info:
        sparkdl.run(lambda ctx: None, num_workers=3, spark=spark, progress=False)
    elapsed = time.monotonic() - started
    # Decided from the registered executors, before any stage: the driver's slot check names
    # both numbers (the start watch of a launched stage would say "0 of the barrier stage's tasks
    # started"). Its only wait is for executors still registering, up to slot_wait_s; both are
    # up here, so a check that waited that timeout out (or hung) fails this bound,
    # while a loaded machine's JVM calls take well under it.
    assert "num_workers=3" in str(info.value) and "the cluster has 2 (2 executor(s)" in str(info.value)
    assert "slot_wait_s" not in str(info.value)  # every executor had registered: waiting longer would not help
    assert set(tracker.getJobIdsForGroup()) == jobs_before, "a Spark job was launched"
    assert elapsed < LaunchConfig(num_workers=3).slot_wait_s, f"the slot check took {elapsed:.1f}s"


def test_a_setting_a_rank_refuses_is_a_config_error_on_the_driver_and_not_retried(spark):
    """ShardedDataParallel(shard_modules=...) naming no submodule, found by the ranks (a custom
    loop: the driver never sees the model): ``except sparkdl.ConfigError`` catches it, with the
    rank, its host and traceback kept, and max_failures does not relaunch what can only repeat."""

    def train_fn(ctx):
        ctx.prepare_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))

    strategy = sparkdl.ShardedDataParallel(shard_modules=["encoder"])
    with pytest.raises(sparkdl.ConfigError) as info:
        sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False, strategy=strategy, max_failures=2)
    error = info.value
    assert isinstance(error, sparkdl.TrainingError) and error.rank in (0, 1), str(error)
    assert "shard_modules entry 'encoder' names no submodule of Sequential" in str(error) and "ran on host" in str(
        error
    )
    assert "sharded.py" in error.remote_traceback
    assert "attempt 2" not in str(error)  # raised at once: a relaunch fails the same way


def test_shard_modules_naming_no_submodule_fails_fit_before_launch(spark, digits_df, monkeypatch):
    from sparkdl._driver import attempt as driver

    launched = []
    monkeypatch.setattr(driver, "run_attempt", lambda *args, **kwargs: launched.append(1))
    estimator = sparkdl.TorchEstimator(
        model=digits_mlp,
        num_workers=2,
        progress=False,
        strategy=sparkdl.ShardedDataParallel(shard_modules=["encoder"]),
    )
    with pytest.raises(
        sparkdl.ConfigError, match="shard_modules entry 'encoder' names no submodule of Sequential"
    ) as info:
        estimator.fit(digits_df)
    assert not isinstance(info.value, sparkdl.TrainingError) and not launched  # the driver's check: no barrier stage


def test_rank_logs_reach_the_driver_prefixed_with_the_rank(spark, caplog):
    def train_fn(ctx):
        ctx.logger.warning("hello from rank %d", ctx.rank)
        return None

    with caplog.at_level("WARNING", logger="sparkdl"):
        sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False)
    messages = sorted(r.getMessage() for r in caplog.records if r.name.startswith("sparkdl.rank"))
    assert messages == ["[rank 0] hello from rank 0", "[rank 1] hello from rank 1"]


# ---- bad arguments fail before launch, with a message naming the problem ---------------------


def test_missing_column(digits_df):
    estimator = sparkdl.TorchEstimator(model=digits_mlp, feature_cols=["pixels"], num_workers=2)
    with pytest.raises(sparkdl.DataError, match="'pixels' not in the DataFrame; its columns are: features, label"):
        estimator.fit(digits_df)


def test_missing_path(tmp_path):
    estimator = sparkdl.TorchEstimator(model=digits_mlp, num_workers=2)
    with pytest.raises(sparkdl.DataError, match="no dataset at .*does-not-exist.*does not exist"):
        estimator.fit(str(tmp_path / "does-not-exist"))


def test_bad_batch_size_fails_at_construction():
    with pytest.raises(sparkdl.ConfigError, match="batch_size=0 must be a positive integer"):
        sparkdl.TorchEstimator(model=digits_mlp, batch_size=0)


def test_batch_larger_than_the_data(tmp_path, spark):
    path = _write(tmp_path / "tiny", n=20)
    estimator = sparkdl.TorchEstimator(model=digits_mlp, num_workers=2, batch_size=16, progress=False)
    with pytest.raises(sparkdl.ConfigError, match="20 rows, fewer than num_workers \\* batch_size = 2 \\* 16"):
        estimator.fit(path)


def test_empty_dataset(tmp_path):
    path = _write(tmp_path / "empty", n=0)
    with pytest.raises(sparkdl.DataError, match="is empty"):
        sparkdl.TorchEstimator(model=digits_mlp, num_workers=2).fit(path)


def test_unreadable_file_is_named(tmp_path):
    path = _write(tmp_path / "corrupt", n=64)
    with open(os.path.join(path, "part-1.parquet"), "wb") as handle:
        handle.write(b"this is not parquet at all")
    with pytest.raises(sparkdl.DataError, match="part-1.parquet"):
        sparkdl.TorchEstimator(model=digits_mlp, num_workers=2).fit(path)


def test_non_numeric_feature_column(spark):
    df = spark.createDataFrame([("a", 1), ("b", 0)], "features string, label long")
    with pytest.raises(sparkdl.DataError, match="feature column 'features' has type string, which is not numeric"):
        sparkdl.TorchEstimator(model=digits_mlp, num_workers=2).fit(df)


@pytest.mark.parametrize("row, raised", [(5, sparkdl.DataError), (50, sparkdl.TrainingError)])
def test_null_features_are_reported_with_the_column(spark, tmp_path, row, raised):
    path = str(tmp_path / "nulls")
    os.makedirs(path)
    x = np.ones((64, 4), dtype=np.float32)
    x[row, 2] = np.nan
    table = pa.table({"f": pa.array(list(x), type=pa.list_(pa.float32())), "label": np.zeros(64, dtype=np.int64)})
    pq.write_table(table, path + "/p.parquet", row_group_size=8)
    estimator = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Linear(4, 2), feature_cols=["f"], num_workers=2, batch_size=8, progress=False
    )
    # Row 5 is in the batch the driver checks before launch (a DataError, nothing launched);
    # row 50 is found by a rank (a TrainingError); both name the column and where it is.
    with pytest.raises(raised, match="feature column\\(s\\) f contain NaN or null values in .*p.parquet"):
        estimator.fit(path)


def _write(path, n):
    os.makedirs(path, exist_ok=True)
    table = pa.table(
        {
            "features": pa.array([np.zeros(64, dtype=np.float32)] * n, type=pa.list_(pa.float32())),
            "label": pa.array(np.zeros(n, dtype=np.int64)),
        }
    )
    pq.write_table(table, os.path.join(path, "part-0.parquet"))
    return str(path)


# ---- a flood of unauthenticated connections to the driver's channel (issue #15) --------------


def _driver_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_connection_flood_on_the_driver_channel_neither_breaks_the_fit_nor_leaks(
    spark, tmp_path, monkeypatch, caplog
):
    import re
    import socket
    import threading

    from sparkdl._driver import attempt as driver

    servers = []

    class Recorded(driver.ChannelServer):  # the real server; only remembers its address
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            servers.append(self)

    markers = str(tmp_path)

    def train_fn(ctx):
        open(os.path.join(markers, f"started-{ctx.rank}"), "w").close()
        deadline = time.monotonic() + FAILURE_BOUND_S
        while not os.path.exists(os.path.join(markers, "flood-done")):
            if time.monotonic() > deadline:
                raise TimeoutError("the driver-side flood never finished")
            time.sleep(0.05)  # polling a file another process writes
        return ctx.world_size * 21

    def wait_for(condition, what):
        deadline = time.monotonic() + FAILURE_BOUND_S
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)  # polling for another process's progress, not synchronizing

    total, batch = 2000, 200
    seen = {"held": 0, "peak_server_threads": 0}
    errors = []

    def flood():
        held = []
        try:
            wait_for(
                lambda: servers and all(os.path.exists(os.path.join(markers, f"started-{r}")) for r in range(2)),
                "both ranks",
            )
            server = servers[0]
            for _ in range(total // batch):
                held += [socket.create_connection(server.address, timeout=10) for _ in range(batch)]
                with server._lock:
                    seen["peak_server_threads"] = max(seen["peak_server_threads"], len(server._threads))
            seen["held"] = len(held)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            for sock in held:
                sock.close()
            open(os.path.join(markers, "flood-done"), "w").close()

    _cluster_still_trains(spark)  # Spark's own threads and connections are warm
    base_threads, base_fds = threading.active_count(), _driver_fds()
    monkeypatch.setattr(driver, "ChannelServer", Recorded)
    flooder = threading.Thread(target=flood, name="test-flooder", daemon=True)
    flooder.start()
    with caplog.at_level("WARNING", logger="sparkdl.channel"):
        result = sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False)
    flooder.join(FAILURE_BOUND_S)
    assert not errors, errors
    assert result == 42
    assert seen["held"] == total
    assert seen["peak_server_threads"] <= 64 + 2  # the pending cap + the two ranks
    wait_for(
        lambda: threading.active_count() <= base_threads and _driver_fds() <= base_fds + 2,
        "threads and fds back to baseline",
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "sparkdl.channel"]
    print(
        f"driver flood of {total}: peak {seen['peak_server_threads']} channel threads; {len(lines)} warning lines:",
        *lines,
        sep="\n  ",
    )
    assert len(lines) < 20, lines
    counts = [re.search(r"dropped ([\d,]+) more unauthenticated connections", line) for line in lines]
    assert any(counts), lines
    refused = sum(int(m.group(1).replace(",", "")) for m in counts if m) + sum("refusing" in line for line in lines)
    assert total - 64 <= refused <= total, lines  # pending ones cut off by the fit's end are not logged
    _cluster_still_trains(spark)
