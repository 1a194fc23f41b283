"""Surviving failures on a real cluster: kill a trainer mid-epoch, resume exactly, re-run, hang."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import torch

import sparkdl
from sparkdl.checkpoint import MANIFEST, CheckpointConfig, decode_part, open_store
from tests.integration.test_strategy_contract import STRATEGIES
from tests.models import accuracy, digits_mlp

pytestmark = pytest.mark.spark

EPOCHS = 3
CHECKPOINT_EVERY = 8
KILL_AT_STEP = 27  # mid-epoch 2 (22 steps per epoch), 3 steps after the checkpoint at step 24


class _KillOnce:
    """A cross-entropy loss that kills rank 1's process outright at its ``at``-th call — once per
    ``marker`` file, so the relaunched attempt trains on. ``os._exit`` is what an OOM kill looks
    like from inside: no exception, no report, no cleanup.

    It first joins the rank's checkpoint writer thread: the kill comes after the rank's part of
    the last checkpoint is stored, so which checkpoint the relaunch resumes from is certain (a
    rank killed while writing leaves that checkpoint incomplete, and the relaunch resumes from
    the one before: test_a_checkpoint_a_rank_did_not_finish_is_skipped_on_resume)."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker = marker
        self.at = at
        self.calls = 0

    def __call__(self, output, label):
        if _rank() < 0:  # the driver's preflight check of the loss: not a training step
            return torch.nn.functional.cross_entropy(output, label)
        self.calls += 1
        if self.calls == self.at and _rank() == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            for thread in threading.enumerate():
                if thread.name.startswith("sparkdl-checkpoint"):
                    thread.join()
            os._exit(9)
        return torch.nn.functional.cross_entropy(output, label)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else -1


def _estimator(strategy, checkpoint_dir, loss=None, **overrides):
    settings = dict(
        model=digits_mlp,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        loss=loss or torch.nn.functional.cross_entropy,
        strategy=strategy,
        num_workers=2,
        batch_size=32,
        epochs=EPOCHS,
        seed=0,
        progress=False,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=CHECKPOINT_EVERY,
        max_failures=1,
    )
    settings.update(overrides)
    return sparkdl.TorchEstimator(**settings)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_killed_trainer_resumes_from_the_checkpoint_exactly(spark, digits_df, digits_split, tmp_path, strategy):
    reference = _estimator(strategy, str(tmp_path / "reference")).fit(digits_df)
    assert reference.run_info["attempts"] == [
        {"attempt": 1, "seconds": pytest.approx(reference.run_info["attempts"][0]["seconds"]), "error": None}
    ]

    killer = _KillOnce(str(tmp_path / "killed-once"), at=KILL_AT_STEP)
    resumed = _estimator(strategy, str(tmp_path / "resumed"), loss=killer).fit(digits_df)

    attempts = resumed.run_info["attempts"]
    assert len(attempts) == 2 and "WorkerLost" in attempts[0]["error"] and "rank 1" in attempts[0]["error"]
    steps = resumed.run_info["steps"]
    total = EPOCHS * (1437 // 64)
    # Resumed, not restarted: the second attempt started at the last checkpoint before the kill.
    assert steps == {"resumed_at": 24, "run": total - 24, "total": total}
    assert [r["epoch"] for r in resumed.history] == list(range(1, EPOCHS + 1))
    assert [r["samples"] for r in resumed.history] == [r["samples"] for r in reference.history]
    _, (test_x, test_y) = digits_split
    assert accuracy(resumed.module, test_x, test_y) >= 0.85
    # Under AllReduce every rank holds the same weights: the checkpoint keeps one copy of them.
    checkpoint = open_store(CheckpointConfig(str(tmp_path / "resumed"))).load_latest()
    copies = sum("model" in part.user for part in checkpoint.ranks) + sum(
        "model" in (part.replicated or {}) for part in checkpoint.ranks
    )
    assert copies == (1 if isinstance(strategy, sparkdl.AllReduce) else 2)
    # torch DCP's layout: each rank wrote its own part, the manifest names both. Under AllReduce
    # that one copy is split: each rank's part holds a share of the model's tensors.
    directory = tmp_path / "resumed" / f"ckpt-{checkpoint.step:012d}"
    assert sorted(os.listdir(directory)) == [MANIFEST, "rank-00000.pt", "rank-00001.pt"]
    assert [p["name"] for p in json.loads((directory / MANIFEST).read_text())["parts"]] == [
        "rank-00000.pt",
        "rank-00001.pt",
    ]
    parts = [decode_part((directory / f"rank-0000{r}.pt").read_bytes(), checkpoint.step, 2, r) for r in range(2)]
    assert all(bool(part.replicated_leaves) for part in parts) == isinstance(strategy, sparkdl.AllReduce)
    stats = resumed.run_info["checkpoints"]
    assert stats["count"] > 0 and stats["seconds"] > 0 and 0 < stats["written"] <= stats["count"]
    if getattr(type(strategy), "deterministic", True):
        # Same batches, RNG, optimizer and strategy state after the resume: bit-identical result.
        assert [r["loss"] for r in resumed.history] == [r["loss"] for r in reference.history]
        for key, value in reference.module.state_dict().items():
            assert torch.equal(value, resumed.module.state_dict()[key]), key


def test_rerunning_a_finished_job_returns_its_result_without_training(spark, digits_df, tmp_path):
    directory = str(tmp_path / "finished")
    first = _estimator(sparkdl.AllReduce(), directory, epochs=1).fit(digits_df)
    again = _estimator(sparkdl.AllReduce(), directory, epochs=1).fit(digits_df)
    assert again.run_info["from_finished_checkpoint"] is True and again.run_info["attempts"] == []
    assert again.history == first.history
    for key, value in first.module.state_dict().items():
        assert torch.equal(value, again.module.state_dict()[key])
    fresh = _estimator(sparkdl.AllReduce(), directory, epochs=1, resume=False, seed=1).fit(digits_df)
    assert fresh.run_info["from_finished_checkpoint"] is False and len(fresh.run_info["attempts"]) == 1
    assert not torch.equal(fresh.module[0].weight, first.module[0].weight)


def test_deterministic_failures_are_not_retried(spark, digits_df, tmp_path, caplog):
    def nan_loss(output, label):
        return torch.nn.functional.cross_entropy(output, label) * float("nan")

    with caplog.at_level("WARNING", logger="sparkdl"):
        with pytest.raises(sparkdl.TrainingError, match="NonFiniteLossError"):
            _estimator(sparkdl.AllReduce(), str(tmp_path / "nan"), loss=nan_loss, max_failures=3).fit(digits_df)
    assert not [r for r in caplog.records if "relaunching" in r.getMessage()]


def test_retries_are_bounded_by_max_failures(spark, tmp_path):
    def always_dies(ctx):
        torch.distributed.barrier()
        if ctx.rank == 1:
            os._exit(5)
        torch.distributed.barrier()

    with pytest.raises(sparkdl.TrainingError) as info:
        sparkdl.run(always_dies, num_workers=2, spark=spark, progress=False, max_failures=1)
    assert info.value.exc_type == "WorkerLost" and "attempt 2; max_failures=1" in str(info.value)


def test_watchdog_fails_a_rank_that_blocks_forever(spark):
    def train_fn(ctx):
        torch.distributed.barrier()  # both ranks are up and past the rendezvous: the stall is rank 1's alone
        if ctx.rank == 1:
            ctx.set_phase("waiting on purpose")
            threading.Event().wait()  # blocks forever: no progress, but heartbeats go on
        for i in range(1_000_000):  # rank 0 keeps making progress until the run is cancelled
            ctx.set_phase(f"polling {i}")
            time.sleep(0.05)

    started = time.monotonic()
    # watchdog_timeout_s=5: rank 0 would be named only if its heartbeats (one a second) all failed
    # to arrive for 5 s; its clock starts once both ranks started, so a slow worker start of one
    # executor does not count (JobMonitor.on_connect).
    with pytest.raises(sparkdl.TrainingError) as info:
        sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False, watchdog_timeout_s=5)
    # Generous (a loaded machine starts a stage slowly): it only catches a watchdog that never
    # fires, which would leave the run blocked for good.
    assert time.monotonic() - started < 180
    error = info.value
    assert error.rank == 1 and error.exc_type == "WatchdogTimeout"
    assert "while waiting on purpose" in str(error) and "raise watchdog_timeout_s" in str(error)
    assert sparkdl.run(lambda ctx: ctx.rank, num_workers=2, spark=spark, progress=False) == 0


def test_custom_loop_checkpoints_resume_after_a_kill(spark, tmp_path):
    marker = str(tmp_path / "died")

    def train_fn(ctx):
        state = ctx.load_checkpoint() or {"step": 0, "value": torch.zeros(())}
        started_at = state["step"]
        value = state["value"]
        for step in range(state["step"] + 1, 11):
            value = value + step
            if step == 7 and ctx.rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                ctx.wait_for_checkpoint()  # dies after its part of checkpoint 6 is stored
                os._exit(1)
            if step % 3 == 0:
                ctx.save_checkpoint({"step": step, "value": value}, step=step)
        return started_at, float(value)

    started_at, value = sparkdl.run(
        train_fn, num_workers=2, spark=spark, progress=False, checkpoint_dir=str(tmp_path / "ckpt"), max_failures=1
    )
    assert started_at == 6 and value == sum(range(1, 11))


def test_checkpoints_resume_and_models_save_on_a_scheme_only_fsspec_knows(spark, digits_df, tmp_path):
    from tests.fsspec_only import register

    register(str(tmp_path / "store"))  # sparkdltest://x is <tmp>/store/x; pyarrow has no such scheme
    killer = _KillOnce(str(tmp_path / "killed-once"), at=KILL_AT_STEP)
    model = _estimator(sparkdl.AllReduce(), "sparkdltest://runs/one", loss=killer).fit(digits_df)
    attempts = model.run_info["attempts"]
    assert len(attempts) == 2 and "WorkerLost" in attempts[0]["error"]
    assert model.run_info["steps"]["resumed_at"] == 24  # the relaunch read the checkpoint back
    assert sorted(os.listdir(tmp_path / "store" / "runs" / "one"))[-1] == "finished.pkl"

    model.save("sparkdltest://models/digits")
    loaded = sparkdl.TorchModel.load("sparkdltest://models/digits")
    for key, value in model.module.state_dict().items():
        assert torch.equal(value, loaded.module.state_dict()[key]), key
    again = _estimator(sparkdl.AllReduce(), "sparkdltest://runs/one").fit(digits_df)
    assert again.run_info["from_finished_checkpoint"] is True and again.history == model.history


@pytest.mark.parametrize("last_save, raised_at", [(9, "the next save"), (6, "close")])
def test_a_background_write_error_surfaces_on_the_driver_with_the_rank(spark, tmp_path, last_save, raised_at):
    # Rank 1's part of checkpoint 6 cannot be stored: its path is a directory (a real failure of
    # the rename). The write fails in the background; rank 1 raises it at its next save or, when
    # 6 was the last one, when the task closes its context.
    (tmp_path / "ckpt" / "ckpt-000000000006" / "rank-00001.pt").mkdir(parents=True)

    def train_fn(ctx):
        for step in range(3, last_save + 1, 3):
            ctx.save_checkpoint({"step": step, "value": torch.full((1000,), float(step))}, step=step)
        return "done"

    with pytest.raises(sparkdl.TrainingError) as info:
        sparkdl.run(train_fn, num_workers=2, spark=spark, progress=False, checkpoint_dir=str(tmp_path / "ckpt"))
    error = info.value
    assert (error.rank, error.exc_type) == (1, "CheckpointWriteError"), raised_at
    assert f"rank 1 could not write checkpoint file://{tmp_path}/ckpt/ckpt-000000000006: " in str(error)
    # Rank 0's part of 6 is there, but without rank 1's there is no manifest: 3 is the newest.
    assert (tmp_path / "ckpt" / "ckpt-000000000006" / "rank-00000.pt").is_file()
    assert open_store(CheckpointConfig(str(tmp_path / "ckpt"))).load_latest().step == 3


def test_a_checkpoint_a_rank_did_not_finish_is_skipped_on_resume(spark, tmp_path):
    """Rank 1 never stores its part of checkpoint 6 and then dies: 6 has rank 0's part and no
    manifest, so the relaunch resumes from 3 and redoes 4..10 exactly."""
    blocked = tmp_path / "ckpt" / "ckpt-000000000006" / "rank-00001.pt"
    blocked.mkdir(parents=True)
    marker = str(tmp_path / "died")

    def train_fn(ctx):
        if ctx.rank == 1 and os.path.exists(marker):
            shutil.rmtree(str(blocked))  # the relaunch's storage works again
        state = ctx.load_checkpoint() or {"step": 0, "value": torch.zeros(())}
        started_at, value = state["step"], state["value"]
        for step in range(state["step"] + 1, 11):
            value = value + step
            if step == 8 and ctx.rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # before its next save could report the failed write
            if step % 3 == 0:
                ctx.save_checkpoint({"step": step, "value": value}, step=step)
        return started_at, float(value)

    started_at, value = sparkdl.run(
        train_fn, num_workers=2, spark=spark, progress=False, checkpoint_dir=str(tmp_path / "ckpt"), max_failures=1
    )
    assert started_at == 3 and value == sum(range(1, 11))
    newest = open_store(CheckpointConfig(str(tmp_path / "ckpt"))).load_latest()
    assert newest.step == 9 and float(newest.user_state(1)["value"]) == sum(range(1, 10))
