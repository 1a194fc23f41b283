"""Errors in terms of what the user did, on the real local cluster: no internal cache paths, no
pages of executor traceback for failures sparkdl explains, nothing retried that can only repeat."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch

import sparkdl
from tests.models import digits_mlp

pytestmark = pytest.mark.spark


def _estimator(**overrides):
    settings = dict(model=digits_mlp, num_workers=2, batch_size=32, epochs=1, progress=False, max_failures=2)
    settings.update(overrides)
    return sparkdl.TorchEstimator(**settings)


def test_an_empty_dataframe_is_named_as_the_dataframe(spark, digits_df):
    with pytest.raises(sparkdl.DataError) as info:
        _estimator().fit(digits_df.limit(0))
    assert str(info.value).startswith("the DataFrame has no rows")
    assert "sparkdl-cache" not in str(info.value) and "file://" not in str(info.value)


def test_a_nan_in_the_features_is_one_paragraph_naming_the_column(spark, digits_df):
    from pyspark.sql import functions as F

    poisoned = digits_df.withColumn(
        "features",
        F.when(F.monotonically_increasing_id() == 5, F.array_repeat(F.lit(math.nan), 64)).otherwise(F.col("features")),
    )
    # Found before launch when the row is in the batch the driver checks, else by a rank.
    with pytest.raises((sparkdl.DataError, sparkdl.TrainingError)) as info:
        _estimator(epochs=2, shuffle=False).fit(poisoned)
    message = str(info.value)
    if isinstance(info.value, sparkdl.TrainingError):
        assert (
            info.value.exc_type == "DataError" and "DataError" in info.value.remote_traceback
        )  # still there for whoever needs it
    assert "feature column(s) features contain NaN or null values in the DataFrame" in message
    assert "Traceback" not in message and "sparkdl-cache" not in message and len(message) < 600


@pytest.mark.parametrize("problem", ["optimizer", "loss"])
def test_a_factory_or_loss_that_can_only_fail_is_named_before_launch_and_not_retried(spark, digits_df, problem):
    def bad_optimizer(params):
        return {"lr": 0.1}

    def classes_out_of_range(output, label):
        return torch.nn.functional.cross_entropy(output[:, :3], label)

    overrides = {"optimizer": bad_optimizer} if problem == "optimizer" else {"loss": classes_out_of_range}
    started = time.monotonic()
    with pytest.raises(sparkdl.ConfigError) as info:  # not a TrainingError: nothing was launched
        _estimator(**overrides).fit(digits_df)
    if problem == "optimizer":
        assert "returned dict, not a torch.optim.Optimizer" in str(info.value)
    else:
        assert "loss(output [32, 10], label [32]) raised IndexError" in str(info.value)
        assert "number of classes" in str(info.value)
    assert time.monotonic() - started < 30  # one small batch on the driver, no barrier stage


def test_a_failure_that_repeats_at_the_same_step_is_not_retried_again(spark, capsys, caplog):
    def train_fn(ctx):
        ctx.set_phase("reading record 3")
        torch.distributed.barrier()
        if ctx.rank == 1:
            raise ValueError("record 3 is malformed")
        torch.distributed.barrier()

    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        with pytest.raises(sparkdl.TrainingError) as info:
            sparkdl.run(train_fn, num_workers=2, spark=spark, max_failures=5)
    assert info.value.rank == 1 and "record 3 is malformed" in str(info.value)
    assert "attempt 2; max_failures=5; the same failure as attempt 1, so not retried again" in str(info.value)
    # The relaunch notice appeared once, not once on the console and once more through logging.
    notices = capsys.readouterr().out.count("attempt 1 failed") + caplog.text.count("attempt 1 failed")
    assert notices == 1


def test_a_checkpoint_dir_that_cannot_be_written_is_named_before_training_and_not_retried(
    spark, digits_df, tmp_path, caplog
):
    not_a_directory = tmp_path / "taken-by-a-file"
    not_a_directory.write_text("x")
    with caplog.at_level(logging.INFO, logger="sparkdl"), pytest.raises(sparkdl.ConfigError) as info:
        _estimator(epochs=2, checkpoint_dir=str(not_a_directory / "ckpt")).fit(digits_df)
    message = str(info.value)
    assert (
        message.startswith(f"checkpoint_dir='file://{not_a_directory}/ckpt' cannot be written")
        and "Not a directory" in message
    ), message
    # Checked on the driver before the barrier stage: no rank started, nothing was relaunched.
    assert "attempt 1 failed" not in caplog.text and "rank 0" not in caplog.text and "epoch 1" not in caplog.text, (
        caplog.text[-2000:]
    )
