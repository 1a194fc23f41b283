"""``watchdog_timeout_s="auto"`` on a real cluster: a hang in a run of fast steps is reported in
seconds, and a run of slow steps with a long checkpoint is left alone.

The hang is a rank blocked on an Event that is never set (no progress, heartbeats go on); the
slow parts are timed waits standing for a step's compute and a checkpoint write that lasts as
long as twenty such steps (twice the "auto" bound inside a step: 10 x the slowest step). The driver's
error is awaited by ``sparkdl.run`` itself, never by sleeping."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import List, Tuple

import pytest
import torch

import sparkdl
from tests.models import digits_mlp

pytestmark = pytest.mark.spark

HANG_AT_STEP = 150  # well past the warm-up (10 steps): the pace is known
#: A slow step's compute: above AutoWatchdog's floor of 6 s / 10, so the pace sets the bound.
STEP_S = 0.75
#: The slow checkpoint write: 20 steps, twice what "auto" allows a rank inside a step.
CHECKPOINT_S = 20 * STEP_S


def _fast_steps_then_rank_1_hangs(marker: str):
    def loop(ctx):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = 0
        while True:  # epochs until the hang; the run is cancelled then
            for features, labels in ctx.epoch_batches():
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(features.float()), labels.long()).backward()
                for p in model.parameters():  # the step's gradient sync, as DDP's
                    torch.distributed.all_reduce(p.grad)
                optimizer.step()
                steps += 1
                if ctx.rank == 1 and steps == HANG_AT_STEP:
                    with open(marker, "w") as f:
                        f.write(repr(time.time()))
                    threading.Event().wait()  # hung inside a step: no progress, heartbeats go on

    return loop


class _Warnings(logging.Handler):
    """When the driver's sparkdl logger warned what."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: List[Tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.getMessage()))


def test_a_hang_in_a_run_of_fast_steps_is_reported_within_ten_seconds(spark, digits_df, tmp_path):
    marker = str(tmp_path / "hung-at")
    warnings = _Warnings()
    logging.getLogger("sparkdl").addHandler(warnings)
    try:
        with pytest.raises(sparkdl.TrainingError) as info:
            sparkdl.run(
                _fast_steps_then_rank_1_hangs(marker),
                num_workers=2,
                data=digits_df,
                feature_cols=["features"],
                label_col="label",
                batch_size=8,
                spark=spark,
                progress=False,
                watchdog_timeout_s="auto",
            )
    finally:
        logging.getLogger("sparkdl").removeHandler(warnings)
    raised = time.time()
    with open(marker) as f:
        hung = float(f.read())
    error, message = info.value, str(info.value)
    # Rank 1 hung; rank 0 waits for it in the next step's sync. Which stood still first, as the
    # driver's heartbeats (one a second) saw it, is a race: either may be named.
    assert error.exc_type == "WatchdogTimeout" and error.rank in (0, 1), message
    assert error.failures[0].phase.startswith("training step "), message
    assert "watchdog_timeout_s='auto': 10 x the slowest step's compute" in message, message
    # Named on the driver at once; the error once Spark has cancelled the job and the tasks ended.
    named = [when for when, text in warnings.records if text.startswith("watchdog: rank ")]
    assert named and named[0] - hung < 10.0, f"named {named[0] - hung if named else None}s after the hang"
    assert raised - hung < 20.0, f"raised {raised - hung:.1f}s after the hang: {message}"


class _SlowToSave(torch.nn.Module):
    """The digits MLP whose first checkpoint on rank 0 takes CHECKPOINT_S more (a slow store)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.net = digits_mlp()
        self.marker = marker

    def forward(self, x):
        return self.net(x)

    def state_dict(self, *args, **kwargs):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            threading.Event().wait(CHECKPOINT_S)  # stands for a slow write
        return super().state_dict(*args, **kwargs)


def _slow_step_loss(output, label):
    if torch.distributed.is_initialized():  # not the driver's preflight check of the loss
        threading.Event().wait(STEP_S)  # stands for a slow forward and backward
    return torch.nn.functional.cross_entropy(output, label)


def test_a_run_of_slow_steps_and_a_checkpoint_twenty_steps_long_completes_untouched(
    spark, digits_df, digits_split, tmp_path
):
    marker = str(tmp_path / "slow-save-done")
    estimator = sparkdl.TorchEstimator(
        model=lambda: _SlowToSave(marker),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        loss=_slow_step_loss,
        num_workers=2,
        batch_size=48,  # 14 slow steps per rank
        epochs=1,
        seed=0,
        progress=False,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=12,  # after the warm-up's steps: judged by the steps' pace
        watchdog_timeout_s="auto",
    )
    model = estimator.fit(digits_df)
    assert os.path.exists(marker)  # the slow checkpoint happened
    (attempt,) = model.run_info["attempts"]
    steps = model.run_info["steps"]["total"]  # 14: 718 rows per rank in steps of 48
    assert steps > 12 and attempt["error"] is None and attempt["seconds"] > STEP_S * steps + CHECKPOINT_S
    assert model.history[0]["samples"] == steps * 2 * 48
