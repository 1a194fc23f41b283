"""sparkdl.run: what a custom loop sees inside the barrier tasks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import sparkdl

pytestmark = pytest.mark.spark


class _FactsWithOtherThreadsAtStart:
    """A train_fn whose unpickling, in the Python worker before the task starts, leaves torch at
    3 threads and ``OMP_NUM_THREADS=3``: what a user's ``spark.executorEnv.OMP_NUM_THREADS`` or an
    earlier task of a reused worker does (Spark itself sets ``OMP_NUM_THREADS`` to
    ``spark.task.cpus`` otherwise, so only this shows what sparkdl sets)."""

    def __getstate__(self):
        return {"threads": 3}

    def __setstate__(self, state):
        os.environ["OMP_NUM_THREADS"] = str(state["threads"])
        torch.set_num_threads(state["threads"])
        self.at_start = (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"])

    def __call__(self, ctx):
        facts = (
            ctx.rank,
            ctx.world_size,
            str(ctx.device),
            torch.get_num_threads(),
            os.environ.get("OMP_NUM_THREADS"),
            self.at_start,
            os.environ.get("SPARKDL_TEST_WORKERS"),
        )
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, facts)
        return gathered


def test_each_rank_sees_its_rank_device_and_task_cores(spark):
    # Python workers of their own (the executor env is part of a worker's identity), so the
    # threads this run leaves in its workers reach no other test's tasks.
    environment = spark.sparkContext.environment
    environment["SPARKDL_TEST_WORKERS"] = "task-threads"
    try:
        facts = sparkdl.run(_FactsWithOtherThreadsAtStart(), num_workers=2, spark=spark, progress=False)
    finally:
        del environment["SPARKDL_TEST_WORKERS"]
    # local-cluster[2,1,...]: spark.task.cpus=1, so each task runs torch and OpenMP on one thread,
    # whatever the worker had when the task started.
    assert facts == [(0, 2, "cpu", 1, "1", (3, "3"), "task-threads"), (1, 2, "cpu", 1, "1", (3, "3"), "task-threads")]


@pytest.mark.smoke  # scripts/test runs it on every stack
def test_run_returns_rank_zeros_value_and_streams_reports(spark):
    received = []

    def train_fn(ctx):
        ctx.report(step=1, rank_value=float(ctx.rank))
        if ctx.rank == 0:
            ctx.report_epoch({"epoch": 1, "loss": 0.5})
        return {"rank": ctx.rank, "mean": ctx.all_reduce_mean({"x": float(ctx.rank)})}

    value = sparkdl.run(train_fn, num_workers=2, spark=spark, progress=received.append)
    assert value == {"rank": 0, "mean": {"x": 0.5}}
    assert {"epoch": 1, "loss": 0.5} in received
    assert sorted(r["rank_value"] for r in received if "rank_value" in r) == [0.0, 1.0]


def test_what_each_rank_prints_reaches_the_driver_prefixed_and_logs_once(spark, capfd, caplog):
    def train_fn(ctx):
        import sys

        print(f"printed by {ctx.rank}")
        print(f"stderr of {ctx.rank}", file=sys.stderr)
        sys.stdout.write(f"no newline from {ctx.rank}")  # the last partial line comes too
        ctx.logger.warning("logged by %d", ctx.rank)
        return None

    capfd.readouterr()
    sparkdl.run(train_fn, num_workers=2, spark=spark, progress=True)
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert out.count(f"[sparkdl rank {rank}] printed by {rank}\n") == 1, out
        assert out.count(f"[sparkdl rank {rank}] no newline from {rank}") == 1, out
        assert f"[sparkdl rank {rank}] stderr of {rank}" in err, err
        # The logger's record arrives once, as a log record, not again as forwarded stderr.
        assert f"logged by {rank}" not in out + err, (out, err)
        assert sum(f"logged by {rank}" in record.getMessage() for record in caplog.records) == 1


def test_epoch_batches_without_data_is_a_clear_error(spark):
    def train_fn(ctx):
        next(iter(ctx.epoch_batches()))

    with pytest.raises(sparkdl.TrainingError, match="this run has no dataset: pass data="):
        sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False)


def test_custom_loop_trains_with_the_strategy_helpers(spark, digits_df, digits_split):
    from tests.models import accuracy, digits_mlp

    def train_fn(ctx):
        torch.manual_seed(0)
        model = ctx.prepare_model(digits_mlp())
        optimizer = ctx.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=3e-3))
        for _ in range(8):
            for features, labels in ctx.epoch_batches():
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(features), labels).backward()
                optimizer.step()
        return ctx.final_module(model).state_dict(), ctx.comm_bytes

    state, comm_bytes = sparkdl.run(
        train_fn,
        num_workers=2,
        data=digits_df,
        feature_cols=["features"],
        label_col="label",
        batch_size=32,
        spark=spark,
        progress=False,
    )
    module = digits_mlp()
    module.load_state_dict(state)
    _, (test_x, test_y) = digits_split
    assert accuracy(module, test_x, test_y) >= 0.93
    assert comm_bytes > 0


def _probe_rendezvous(address):
    """From inside the job: an unauthenticated raw client and torch's TCPStore client each try
    to read the rendezvous store at ``address``; what each got."""
    import datetime
    import socket

    from sparkdl._net.rendezvous_wire import GREETING, GREETING_BYTES, Message, Op, encode

    with socket.create_connection(address, timeout=10) as raw:
        raw.sendall(encode(Message(Op.GET, items=(b"0//cpu//0/0",))) + b"\0" * 68)
        raw.settimeout(10)
        reply = b""
        try:
            while chunk := raw.recv(4096):
                reply += chunk
        except ConnectionResetError:
            pass
    raw_result = "greeting only" if reply.startswith(GREETING) and len(reply) == GREETING_BYTES else repr(reply[:80])
    try:
        dist.TCPStore(address[0], address[1], is_master=False, timeout=datetime.timedelta(seconds=2))
        torch_result = "connected"
    except RuntimeError as exc:
        torch_result = type(exc).__name__
    return raw_result, torch_result


def _refused(address) -> bool:
    import socket

    try:
        with socket.create_connection(address, timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def test_the_rendezvous_admits_only_the_jobs_ranks_and_closes_with_the_run(spark):
    def train_fn(ctx):
        address = (ctx._rank.env.master_addr, ctx._rank.env.master_port)
        # A DDP model holds the process group, and so the store, past the loop (what kept
        # torch's own TCPStore listening after fit in a reused worker).
        model = ctx.prepare_model(torch.nn.Linear(4, 2))
        model(torch.randn(8, 4)).sum().backward()
        probes = _probe_rendezvous(address) if ctx.rank == 0 else None
        dist.barrier()
        return address, probes, type(model).__name__

    address, probes, model_type = sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False)
    assert model_type == "DistributedDataParallel"
    assert probes[0] == "greeting only" and probes[1] in ("DistNetworkError", "DistStoreError")
    assert _refused(tuple(address))


def test_an_allreduce_fit_closes_its_rendezvous_when_it_returns(spark, digits_df, tmp_path):
    import json

    from tests.models import digits_mlp

    record = str(tmp_path / "rendezvous.json")

    def model_fn():
        # Built on each rank after its rendezvous (and once on the driver, outside any).
        from sparkdl._runtime.rendezvous import active_store

        if dist.is_initialized() and dist.get_rank() == 0:
            server, client = active_store()
            assert server is None  # the driver serves the launch's store, no rank does
            with open(record, "w") as handle:
                json.dump({"address": list(client.address), "probes": _probe_rendezvous(client.address)}, handle)
        return digits_mlp()

    sparkdl.TorchEstimator(
        model=model_fn,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        strategy=sparkdl.AllReduce(),
        num_workers=2,
        batch_size=64,
        epochs=1,
        progress=False,
    ).fit(digits_df)
    with open(record) as handle:
        seen = json.load(handle)
    assert seen["probes"][0] == "greeting only" and seen["probes"][1] in ("DistNetworkError", "DistStoreError")
    assert _refused(tuple(seen["address"]))


def _subnormals_on_every_rank(ctx):
    values = torch.tensor([1e-39], dtype=torch.float32).mul(1.0)  # below float32's smallest normal
    dist.all_reduce(values, op=dist.ReduceOp.MAX)  # every rank's CPU, not only rank 0's
    return float(values)


def test_ranks_flush_subnormal_floats_to_zero_unless_the_setting_says_not_to(spark):
    # Subnormals cost x86 CPUs microcode-slow arithmetic: a DiLoCo fit whose gradients underflowed
    # stepped 4.5x slower across hosts (spark.sparkdl.flushDenormals, docs/settings.md).
    assert sparkdl.run(_subnormals_on_every_rank, num_workers=2, spark=spark, progress=False) == 0.0
    spark.conf.set("spark.sparkdl.flushDenormals", "false")
    try:
        assert sparkdl.run(_subnormals_on_every_rank, num_workers=2, spark=spark, progress=False) == pytest.approx(
            1e-39, rel=1e-3
        )
        spark.conf.set("spark.sparkdl.flushDenormals", "sometimes")
        with pytest.raises(sparkdl.ConfigError, match="spark.sparkdl.flushDenormals='sometimes'"):
            sparkdl.run(_subnormals_on_every_rank, num_workers=2, spark=spark, progress=False)
    finally:
        spark.conf.unset("spark.sparkdl.flushDenormals")
