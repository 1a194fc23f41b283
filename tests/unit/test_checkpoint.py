"""Checkpoint store and failure policy, without Spark."""

import os

import pytest
import torch

from sparkdl._launcher import Decision, FailurePolicy, LaunchConfig
from sparkdl.checkpoint import CheckpointConfig, CheckpointStore
from sparkdl.errors import ConfigError, RankFailure, TrainingError


def _state(value):
    return {"ranks": [{"weights": torch.full((3,), float(value)), "step": value}], "history": [{"epoch": 1, "loss": 0.5}]}


def test_round_trip_is_bit_exact_and_keeps_the_last_k(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2)
    weights = torch.randn(5, 7, dtype=torch.float64)
    for step in (10, 20, 30):
        store.save(step, {"w": weights * step, "rng": torch.get_rng_state(), "meta": {"step": step, "shape": [5, 7]}})
    assert store.steps() == [20, 30]
    step, state = store.load_latest()
    assert step == 30
    assert torch.equal(state["w"], weights * 30)
    assert state["meta"] == {"step": 30, "shape": [5, 7]}
    assert not [n for n in os.listdir(tmp_path / "ckpt") if ".tmp-" in n], "temporary files left behind"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    store = CheckpointStore(str(tmp_path), keep=3)
    store.save(1, _state(1))
    newest = store.save(2, _state(2))
    data = open(newest, "rb").read()
    with open(newest, "wb") as handle:
        if damage == "truncate":
            handle.write(data[: len(data) // 2])
        elif damage == "flip":
            handle.write(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
        else:
            handle.write(b"not a checkpoint")
    step, state = store.load_latest()
    assert step == 1 and state["ranks"][0]["step"] == 1


def test_no_checkpoint_means_start_fresh(tmp_path):
    assert CheckpointStore(str(tmp_path / "empty")).load_latest() is None


def test_checkpoints_hold_data_not_code(tmp_path):
    store = CheckpointStore(str(tmp_path))
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    store.save(1, {"x": Evil()})  # torch.save pickles whatever it is given...
    assert store.load_latest() is None  # ...but loading is weights_only: the file is refused
    assert not marker.exists()


def test_finished_marker_and_clear(tmp_path):
    store = CheckpointStore(str(tmp_path))
    assert store.load_finished() == (False, None)
    store.save(5, _state(5))
    store.save_finished({"answer": 42})
    assert store.load_finished() == (True, {"answer": 42})
    store.clear()
    assert store.load_finished() == (False, None) and store.steps() == []


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


def test_no_retries_by_default():
    assert FailurePolicy().decide(_error("WorkerLost"), 1) is Decision.RAISE
