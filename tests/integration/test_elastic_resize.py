"""on_resize on a real cluster: a 2-worker fit interrupted and resumed on 1 worker follows the
uninterrupted 2-worker run with ``keep_global_batch`` (gradient accumulation), and does not with
``"none"``; ``"scale_lr"`` scales the param groups' learning rates by M/N."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import sparkdl
from tests.integration.test_elastic import _occupy_a_slot, _wait_for

pytestmark = pytest.mark.spark

# One batch per row group and no shuffle: rank r of 2 takes row groups r, r+2, ..., and 1 rank
# takes them all in order, so a 1-worker step of 2 micro-batches holds exactly the rows of the
# 2-worker step (row groups 2s and 2s+1). 32 row groups: 16 steps per epoch on 2 workers.
ROWS, BATCH, EPOCHS = 256, 8, 3
STEPS = ROWS // (2 * BATCH)


@pytest.fixture(scope="module")
def batch_per_group_data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("resize") / "rows.parquet"
    ids = np.arange(ROWS)
    table = pa.table(
        {
            "x0": np.sin(ids).astype(np.float32),
            "x1": np.cos(3 * ids).astype(np.float32),
            "label": ((ids * 7) % 3 == 0).astype(np.int64),
        }
    )
    pq.write_table(table, path, row_group_size=BATCH)
    return str(path)


def _linear() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


class _KillRank1At:
    """A loss that kills rank 1's process at its ``at``-th call of the first attempt."""

    def __init__(self, directory: str, at: int) -> None:
        self.directory, self.at, self.calls = directory, at, 0

    def __call__(self, output, label):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            self.calls += 1
            if self.calls == self.at:
                os._exit(9)
        return torch.nn.functional.cross_entropy(output, label)


def _fit(data, loss, **overrides):
    settings = dict(
        model=_linear,
        loss=loss,
        feature_cols=["x0", "x1"],
        label_col="label",
        num_workers=2,
        batch_size=BATCH,
        epochs=EPOCHS,
        seed=0,
        shuffle=False,
        progress=False,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    )
    settings.update(overrides)
    return sparkdl.TorchEstimator(**settings).fit(data)


def _scaled_lrs(ctx):
    model = ctx.prepare_model(_linear())
    optimizer = ctx.prepare_optimizer(
        torch.optim.SGD([{"params": [model.module.weight], "lr": 0.1}, {"params": [model.module.bias], "lr": 0.02}])
    )
    factor = ctx.apply_resize_lr(optimizer)
    return {"lrs": [group["lr"] for group in optimizer.param_groups], "factor": factor, "world": ctx.world_size}


def test_a_resume_on_fewer_workers_keeps_the_global_batch_or_not_as_on_resize_says(
    spark, batch_per_group_data, tmp_path
):
    data = batch_per_group_data
    reference = _fit(data, torch.nn.functional.cross_entropy)
    checkpoint_dir = str(tmp_path / "ckpt")
    # Rank 1 dies at the first step of epoch 2: the newest checkpoint is epoch 1's end, on 2 workers.
    with pytest.raises(sparkdl.TrainingError, match="WorkerLost"):
        _fit(data, _KillRank1At(str(tmp_path), STEPS + 1), checkpoint_dir=checkpoint_dir, checkpoint_async=False)
    shutil.copytree(checkpoint_dir, str(tmp_path / "ckpt-none"))

    # Another job holds one of the two slots: each fit below starts on 1 worker (min_workers=1).
    open(os.path.join(tmp_path, "started"), "w").close()
    threads = _occupy_a_slot(spark, str(tmp_path))
    try:
        _wait_for(os.path.join(tmp_path, "occupier-queued"))
        on_one = dict(min_workers=1, slot_wait_s=2.0)
        kept = _fit(data, torch.nn.functional.cross_entropy, checkpoint_dir=checkpoint_dir, **on_one)
        plain = _fit(
            data,
            torch.nn.functional.cross_entropy,
            checkpoint_dir=str(tmp_path / "ckpt-none"),
            on_resize="none",
            **on_one,
        )
        scaled = sparkdl.run(_scaled_lrs, num_workers=2, on_resize="scale_lr", spark=spark, progress=False, **on_one)
    finally:
        open(os.path.join(tmp_path, "release"), "w").close()
        for thread in threads:
            thread.join(timeout=60)

    assert kept.run_info["workers"] == [1] and kept.run_info["resumed"] == {"from_workers": 2, "on_workers": 1}
    resize = kept.run_info["resize"]
    assert resize["on_resize"] == "keep_global_batch" and resize["accumulation_steps"] == 2
    assert resize["global_batch_size"] == resize["planned_global_batch_size"] == 2 * BATCH
    assert [r["global_batch"] for r in kept.history] == [2 * BATCH] * EPOCHS
    # The same optimizer steps as the uninterrupted run...
    assert kept.run_info["steps"] == {"resumed_at": STEPS, "run": 2 * STEPS, "total": EPOCHS * STEPS}
    assert reference.run_info["steps"]["total"] == EPOCHS * STEPS
    # ...on the same rows with the same weights: the gradient is (g0 + g1) / 2 either way, summed
    # in another order (DDP's allreduce vs. accumulation), so the losses agree to float32
    # rounding accumulated over 32 steps (~1e-7 per step): 1e-5 relative is 100x that margin,
    # while "none" below differs in the third digit.
    assert kept.history[0]["loss"] == reference.history[0]["loss"]  # epoch 1: the same 2-worker run
    for got, want in zip(kept.history, reference.history):
        assert got["samples"] == want["samples"] == ROWS
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (kept.history, reference.history)
    for (name, got), want in zip(kept.module.state_dict().items(), reference.module.state_dict().values()):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), name

    # on_resize="none": 1 worker takes 32 steps of 8 rows per epoch; the run optimizes another problem.
    assert plain.run_info["resize"]["accumulation_steps"] == 1
    assert plain.run_info["resize"]["global_batch_size"] == BATCH
    assert plain.run_info["steps"]["total"] == STEPS + 2 * 2 * STEPS
    # Its losses leave the tolerance the accumulated run keeps (here by ~4e-4 relative: the
    # problem is easy, but the trajectory is another one).
    assert any(
        got["loss"] != pytest.approx(want["loss"], rel=1e-5)
        for got, want in zip(plain.history[1:], reference.history[1:])
    ), (plain.history, reference.history)

    # on_resize="scale_lr" on 1 of 2 workers: every param group's lr times 1/2.
    assert scaled == {"lrs": [pytest.approx(0.05), pytest.approx(0.01)], "factor": 0.5, "world": 1}
