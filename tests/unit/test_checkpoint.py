"""Checkpoint settings and the failure policy, without Spark (the stores: test_checkpoint_store_contract.py)."""

import pytest

from sparkdl._launcher import Decision, FailurePolicy, LaunchConfig
from sparkdl.checkpoint import CheckpointConfig
from sparkdl.errors import ConfigError, RankFailure, TrainingError


def test_checkpoint_config_validation():
    with pytest.raises(ConfigError, match="checkpoint_every=0 must be a positive number of steps"):
        CheckpointConfig("/tmp/x", every_steps=0)
    with pytest.raises(ConfigError, match="keep_checkpoints=0"):
        CheckpointConfig("/tmp/x", keep=0)
    with pytest.raises(ConfigError, match="max_failures=-1 must be an integer >= 0"):
        LaunchConfig(num_workers=2, max_failures=-1)
    with pytest.raises(ConfigError, match="watchdog_timeout_s=0"):
        LaunchConfig(num_workers=2, watchdog_timeout_s=0)


def _error(exc_type, message="x"):
    return TrainingError([RankFailure(1, exc_type, message, "", "")])


@pytest.mark.parametrize(
    "exc_type, message, failures_so_far, expected",
    [
        ("WorkerLost", "killed", 1, Decision.RETRY),
        ("WatchdogTimeout", "stuck", 2, Decision.RETRY),
        ("RuntimeError", "Connection closed by peer", 1, Decision.RETRY),
        ("WorkerLost", "killed", 3, Decision.RAISE),  # max_failures=2 spent
        ("NonFiniteLossError", "loss is nan", 1, Decision.RAISE),
        ("DataError", "bad column", 1, Decision.RAISE),
        ("SparkJobFailed", "ModuleNotFoundError: No module named 'models'", 1, Decision.RAISE),
    ],
)
def test_failure_policy(exc_type, message, failures_so_far, expected):
    assert FailurePolicy(max_failures=2).decide(_error(exc_type, message), failures_so_far) is expected


def test_an_attempt_that_fails_like_the_previous_one_is_not_retried():
    policy = FailurePolicy(max_failures=5)
    first = TrainingError([RankFailure(1, "RuntimeError", "bad batch", "", "training step 7 (forward, backward, sync, optimizer)")])
    assert policy.decide(first, 1) is Decision.RETRY
    again = TrainingError([RankFailure(1, "RuntimeError", "bad batch", "", "training step 7 (forward, backward, sync, optimizer)")])
    assert policy.decide(again, 2, previous=first) is Decision.RAISE
    elsewhere = TrainingError([RankFailure(1, "RuntimeError", "bad batch", "", "training step 9 (forward, backward, sync, optimizer)")])
    assert policy.decide(elsewhere, 2, previous=first) is Decision.RETRY
    other_rank = TrainingError([RankFailure(0, "RuntimeError", "bad batch", "", "training step 7 (forward, backward, sync, optimizer)")])
    assert policy.decide(other_rank, 2, previous=first) is Decision.RETRY


def test_no_retries_by_default():
    assert FailurePolicy().decide(_error("WorkerLost"), 1) is Decision.RAISE
