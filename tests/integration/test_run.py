"""sparkdl.run: what a custom loop sees inside the barrier tasks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import sparkdl

pytestmark = pytest.mark.spark


def test_each_rank_sees_its_rank_device_and_task_cores(spark):
    def train_fn(ctx):
        facts = (ctx.rank, ctx.world_size, str(ctx.device), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, facts)
        return gathered

    facts = sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False)
    # local-cluster[2,1,...]: one core per executor and spark.task.cpus=1, so one thread per rank.
    assert facts == [(0, 2, "cpu", 1, "1"), (1, 2, "cpu", 1, "1")]


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
        train_fn, num_workers=2, data=digits_df, feature_cols=["features"], label_col="label", batch_size=32, spark=spark, progress=False
    )
    module = digits_mlp()
    module.load_state_dict(state)
    _, (test_x, test_y) = digits_split
    assert accuracy(module, test_x, test_y) >= 0.93
    assert comm_bytes > 0
