"""sparkdl from a Spark Connect client: a real Connect server (SparkConnectServer, started with the
real spark-submit over local-cluster[2,1,1024]) and a client session with no SparkContext.

Runs in its own pytest process (marker ``connect``; scripts/test runs it apart), because a Connect
session switches PySpark's process-wide mode."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import sparkdl
from tests.conftest import REPO_ROOT
from tests.models import accuracy, digits_mlp, wide_mlp

pytestmark = [pytest.mark.spark, pytest.mark.connect]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_port(port: int, server: subprocess.Popen, log: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the Spark Connect server exited with {server.returncode}:\n{open(log).read()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.5)  # polling a port that has no readiness event; bounded by the deadline
    raise RuntimeError(
        f"the Spark Connect server did not listen on {port} within {timeout_s}s:\n{open(log).read()[-3000:]}"
    )


@pytest.fixture(scope="module")
def connect(tmp_path_factory):
    """A Connect client session on a fresh Connect server; the server is stopped afterwards."""
    from pyspark.sql import SparkSession

    port = _free_port()
    work = tmp_path_factory.mktemp("connect")
    log = str(work / "server.log")
    spark_submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    command = [
        spark_submit,
        "--class",
        "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--master",
        "local-cluster[2,1,1024]",
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
        "--conf",
        "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.driver.bindAddress=127.0.0.1",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.sql.shuffle.partitions=4",
        "--conf",
        # The largest message the server takes (default 128 MiB), lowered so that a model above
        # it stays small enough for a test (test_a_model_above_the_plan_limit...).
        "spark.connect.grpc.maxInboundMessageSize=16m",
        "--conf",
        f"spark.executorEnv.PYTHONPATH={REPO_ROOT}{os.pathsep}{os.path.join(REPO_ROOT, 'tests')}",
        "--conf",
        f"spark.sparkdl.cacheDir={work / 'cache'}",
        "spark-internal",
    ]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_for_port(port, server, log)
        session = SparkSession.builder.remote(f"sc://127.0.0.1:{port}").getOrCreate()
        yield session
        session.stop()
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


@pytest.fixture(scope="module")
def connect_digits(connect, digits_split):
    (train_x, train_y), (test_x, test_y) = digits_split
    schema = "features array<double>, label long"
    train = connect.createDataFrame([(x.astype(float).tolist(), int(y)) for x, y in zip(train_x, train_y)], schema)
    test = connect.createDataFrame([(x.astype(float).tolist(), int(y)) for x, y in zip(test_x, test_y)], schema)
    return train, test, test_x, test_y


def test_the_client_has_no_spark_context(connect):
    from sparkdl._spark import Session

    session = Session(connect)
    assert session.connect and session.channel_host() == "127.0.0.1"
    with pytest.raises(Exception):  # noqa: B017 - PySpark's error class for it differs by version
        connect.sparkContext  # noqa: B018 - what makes Connect different


@pytest.mark.smoke  # scripts/test runs it on every stack
def test_fit_and_transform_from_a_connect_client_with_live_progress(connect_digits):
    train, test, test_x, test_y = connect_digits
    records = []
    model = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        num_workers=2,
        batch_size=32,
        epochs=6,
        progress=records.append,
    ).fit(train)
    assert [r["epoch"] for r in records] == list(range(1, 7))  # each epoch reached the client while fit ran
    assert accuracy(model.module, test_x, test_y) >= 0.9
    predictions = np.array([r["prediction"] for r in model.transform(test).collect()])
    expected = model.module(torch.from_numpy(test_x)).detach().numpy()
    np.testing.assert_allclose(predictions, expected, rtol=1e-4, atol=1e-5)


def _rank_sum(ctx):
    total = torch.tensor([float(ctx.rank + 1)])
    torch.distributed.all_reduce(total)
    rows = sum(len(x) for _ in range(1) for x, _ in ctx.epoch_batches())
    return {"sum": total.item(), "rows": rows, "world": ctx.world_size}


def test_run_from_a_connect_client(connect, connect_digits):
    train, _, _, _ = connect_digits
    result = sparkdl.run(
        _rank_sum,
        num_workers=2,
        data=train,
        feature_cols=["features"],
        label_col="label",
        batch_size=32,
        spark=connect,
        progress=False,
    )
    assert result == {"sum": 3.0, "rows": (1437 // 64) * 32, "world": 2}


def _cpu_amount(ctx):
    from pyspark import TaskContext

    world = torch.tensor([1.0])
    torch.distributed.all_reduce(world)
    return {
        "world": int(world.item()),
        "cpu_amount": str(TaskContext.get().cpuAmount()),
        "threads": torch.get_num_threads(),
    }


def test_the_training_stage_runs_with_its_own_resource_profile_from_a_connect_client(connect):
    """Four ranks on the server's two one-core executors: only the training stage's profile of
    half a core per task (built over Connect, sent with the stage) makes room for them."""
    from pyspark import TaskContext

    if not hasattr(TaskContext, "cpuAmount"):  # PySpark before 4.3: fractional CPUs refused, named
        with pytest.raises(sparkdl.ConfigError, match=r"fractional task CPUs need Spark 4\.3"):
            sparkdl.run(_cpu_amount, num_workers=4, spark=connect, progress=False, resources={"cpus": 0.5})
        return
    result = sparkdl.run(
        _cpu_amount, num_workers=4, spark=connect, progress=False, resources=sparkdl.Resources(cpus=0.5), slot_wait_s=60
    )
    assert result == {"world": 4, "cpu_amount": "0.5", "threads": 1}


def _fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    torch.distributed.barrier()


def test_a_failing_rank_is_named_on_the_client(connect):
    with pytest.raises(sparkdl.TrainingError, match=r"rank 1.*ValueError: rank 1 refuses"):
        sparkdl.run(_fail_on_rank_1, num_workers=2, spark=connect, progress=False)


def test_too_few_slots_fail_fast_from_a_connect_client_after_slot_wait_s(connect):
    started = time.monotonic()
    with pytest.raises(sparkdl.InsufficientSlotsError, match="num_workers=3 needs 3 concurrent task slots") as info:
        sparkdl.run(_rank_sum, num_workers=3, spark=connect, progress=False, slot_wait_s=5)
    # 2 of 3 tasks start and wait at the barrier; the client gives up after the 5 s asked for
    # (the default 30 s would make this bound fail), and says which setting waits longer.
    assert "started within slot_wait_s=5s" in str(info.value) and "raise slot_wait_s" in str(info.value)
    assert time.monotonic() - started < 28


def test_checkpoints_and_recovery_from_a_connect_client(connect_digits, tmp_path):
    from tests.integration.test_recovery import _KillOnce

    train, _, _, _ = connect_digits
    killer = _KillOnce(str(tmp_path / "killed-once"), at=27)
    model = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        loss=killer,
        num_workers=2,
        batch_size=32,
        epochs=2,
        progress=False,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=8,
        max_failures=1,
    ).fit(train)
    assert len(model.run_info["attempts"]) == 2 and model.run_info["steps"]["resumed_at"] == 24
    assert [r["epoch"] for r in model.history] == [1, 2]


def _block_rank_1(ctx):
    import threading

    torch.distributed.barrier()  # both ranks are up and past the rendezvous: the stall is rank 1's alone
    if ctx.rank == 1:
        ctx.set_phase("waiting on purpose")
        threading.Event().wait()  # no progress, heartbeats go on
    for i in range(1_000_000):
        ctx.set_phase(f"polling {i}")
        time.sleep(0.05)


def test_the_watchdog_cancels_a_hung_rank_from_a_connect_client(connect):
    started = time.monotonic()
    # watchdog_timeout_s=5: rank 0 would be named only if all of its heartbeats (one a second)
    # failed to arrive for 5 s; the clock starts once both ranks started (JobMonitor.on_connect).
    with pytest.raises(sparkdl.TrainingError) as info:
        sparkdl.run(_block_rank_1, num_workers=2, spark=connect, progress=False, watchdog_timeout_s=5)
    # Generous: it only catches a watchdog that never fires (the run would stay blocked).
    assert time.monotonic() - started < 180
    assert info.value.rank == 1 and info.value.exc_type == "WatchdogTimeout"
    assert "while waiting on purpose" in str(info.value)
    assert (
        sparkdl.run(lambda ctx: ctx.rank, num_workers=2, spark=connect, progress=False) == 0
    )  # the cluster is free again


def test_a_pipeline_model_saves_and_loads_from_a_connect_client(connect_digits, tmp_path):
    """Spark ML's Pipeline writer over Connect: the server writes the Pipeline's metadata, the
    client (no SparkContext) the TorchModel's files, so the path must be one both reach (here
    both run on this machine; on a cluster, a URL such as s3://...)."""
    from pyspark.ml import Pipeline, PipelineModel

    train, test, _, test_y = connect_digits
    estimator = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        num_workers=2,
        batch_size=64,
        epochs=2,
        progress=False,
    )
    fitted = Pipeline(stages=[estimator]).fit(train)
    path = str(tmp_path / "pipeline_model")
    fitted.save(path)
    back = PipelineModel.load(path)
    assert isinstance(back.stages[0], sparkdl.TorchModel) and back.stages[0].uid == fitted.stages[0].uid
    before = np.stack(fitted.transform(test).select("prediction").toPandas()["prediction"])
    after = np.stack(back.transform(test).select("prediction").toPandas()["prediction"])
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
    assert (after.argmax(1) == test_y).mean() > 0.5  # trained: chance is 0.1


def test_a_model_above_the_plan_limit_is_refused_unsaved_and_scores_from_where_it_was_saved(connect, tmp_path):
    # ~26 MiB of weights: above the 16 MiB a message to this server may hold, so it cannot
    # travel inside the plan; saved, only its URL does, and the executors read the weights.
    model = sparkdl.TorchModel.from_state(wide_mlp().state_dict(), model=wide_mlp, output_shape=[2])
    rows = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    df = connect.createDataFrame([(i, row.tolist()) for i, row in enumerate(rows)], "id long, features array<float>")
    with pytest.raises(sparkdl.ConfigError, match=r"too large to travel inside a Spark Connect plan .* = 16 MiB"):
        model.transform(df)
    model.save(str(tmp_path / "wide"))
    got = np.array([r["prediction"] for r in model.transform(df).orderBy("id").collect()])
    with torch.inference_mode():
        want = model.module(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
