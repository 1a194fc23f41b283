"""Validated configs: each bad value is named with what would be valid."""

import pytest
import torch

import sparkdl
from sparkdl._driver import LaunchConfig, _failure_from_spark
from sparkdl.data.batching import steps_per_epoch
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError
from sparkdl.strategies import registered_strategies, strategy_from_name


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_num_workers_must_be_a_positive_int(value):
    with pytest.raises(ConfigError, match=f"num_workers={value!r} must be a positive integer"):
        LaunchConfig(num_workers=value)


def test_timeouts_are_checked():
    with pytest.raises(ConfigError, match="timeout_s=0 must be > 0"):
        LaunchConfig(num_workers=1, timeout_s=0)


@pytest.mark.parametrize("value", [0, -3, 2.0, None])
def test_batch_size_must_be_a_positive_int(value):
    with pytest.raises(ConfigError, match="batch_size="):
        DataSpec(batch_size=value)


def test_steps_per_epoch_uses_full_global_batches():
    assert steps_per_epoch(1437, 32, 2) == 22
    assert steps_per_epoch(64, 32, 2) == 1
    with pytest.raises(ConfigError, match="63 rows, fewer than num_workers \\* batch_size = 2 \\* 32 = 64"):
        steps_per_epoch(63, 32, 2)


def test_estimator_rejects_a_module_instance_and_a_string_of_columns():
    with pytest.raises(ConfigError, match="zero-argument callable"):
        sparkdl.TorchEstimator(model=torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="must be a list of column names"):
        sparkdl.TorchEstimator(model=lambda: torch.nn.Linear(2, 2), feature_cols="features")
    with pytest.raises(ConfigError, match="is not a sparkdl strategy"):
        sparkdl.TorchEstimator(model=lambda: torch.nn.Linear(2, 2), strategy="allreduce")


def test_strategies_are_found_by_name():
    assert "allreduce" in registered_strategies()
    assert strategy_from_name("allreduce", bucket_cap_mb=5).bucket_cap_mb == 5
    with pytest.raises(ConfigError, match="strategy='ring' is unknown; valid: .*allreduce"):
        strategy_from_name("ring")
    with pytest.raises(ConfigError, match="bucket_cap_mb=0 must be > 0"):
        sparkdl.AllReduce(bucket_cap_mb=0)


def test_spark_failure_without_a_rank_report_keeps_the_python_traceback():
    text = (
        "An error occurred while calling collectAndServe.\n: org.apache.spark.SparkException: Job aborted\n"
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "worker.py", line 1, in main\n'
        "ModuleNotFoundError: No module named 'models'\n\n\tat org.apache.spark.Something\n"
    )
    failure = _failure_from_spark(RuntimeError(text))
    assert failure.rank == -1
    assert failure.message.startswith("ModuleNotFoundError: No module named 'models'")
    assert "--py-files" in failure.message
    assert failure.traceback.startswith("Traceback (most recent call last):")


def test_a_spark_failure_after_the_ranks_finished_is_about_returning_the_result_not_the_launch():
    from sparkdl._driver.attempt import _result_lost
    from sparkdl.errors import TrainingError

    text = "An error occurred while calling collectToPython.\n: java.lang.OutOfMemoryError: Java heap space\n"
    failure = _failure_from_spark(RuntimeError(text), finished=2)
    told = str(TrainingError([failure]))
    assert told.startswith("training failed on the Spark job while returning the result: SparkJobFailed: ")
    assert "Java heap space" in told and "after 2 rank(s) had finished training" in told
    assert "spark.driver.memory" in told and "before any rank started" not in told
    lost = str(TrainingError([_result_lost([1])]))
    assert lost.startswith("training failed on rank 0 while returning its result: ResultLost: every rank finished")
    assert "Spark returned ranks [1]'s" in lost and "spark.driver.maxResultSize" in lost


def test_a_failed_mapinarrow_stage_is_named_by_its_python_error_not_its_sqlstate():
    text = (
        "[PYTHON_EXCEPTION] An exception was thrown from the Python worker.\n"
        "Traceback (most recent call last):\n"
        '  File "worker.py", line 1, in main\n'
        "ModuleNotFoundError: No module named 'sparkdl'\n"
        " SQLSTATE: 38000\n\nJVM stacktrace:\norg.apache.spark.SparkException: Job aborted\n"
    )
    failure = _failure_from_spark(RuntimeError(text))
    assert (
        failure.message.startswith("ModuleNotFoundError: No module named 'sparkdl'") and "--py-files" in failure.message
    )


def test_the_host_timeout_reads_spark_durations_and_refuses_what_a_heartbeat_cannot_meet():
    from sparkdl._task.config import DEFAULT_HOST_TIMEOUT_S, host_timeout_s

    assert host_timeout_s(None, 2.0) == DEFAULT_HOST_TIMEOUT_S == 45.0
    assert [host_timeout_s(text, 2.0) for text in ("20s", "20", "1.5min", "2m", "6000ms")] == [
        20.0,
        20.0,
        90.0,
        120.0,
        6.0,
    ]
    assert host_timeout_s("0", 2.0) is None and host_timeout_s("off", 2.0) is None
    for bad in ("5s", "soon", "-3s"):  # under three heartbeats, or no duration at all
        with pytest.raises(ConfigError, match=r"spark.sparkdl.hostTimeout=.* must be a duration of at least 6s"):
            host_timeout_s(bad, 2.0)
