"""Elastic worker counts on a real cluster: a checkpoint of N workers resumed on M, every row of
the interrupted epoch exactly once and the strategy state carried; a relaunch that finds fewer
free slots continues on fewer workers (min_workers), or fails below min_workers."""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import sparkdl
from sparkdl.checkpoint import CheckpointConfig, open_store

pytestmark = pytest.mark.spark

# 4 row groups of 64: on 2 ranks an epoch is 16 steps, on 1 rank 32, and (the shuffle buffer
# being 64 rows) exactly one pass over each rank's shard, so every epoch reads each row once.
ROWS, GROUPS, BATCH = 256, 4, 8
EPOCHS = 2


@pytest.fixture(scope="module")
def ids_data(tmp_path_factory) -> str:
    return write_ids_data(tmp_path_factory)


def write_ids_data(tmp_path_factory) -> str:
    """Rows that carry their id (== their position) as the first feature."""
    path = tmp_path_factory.mktemp("elastic") / "ids.parquet"
    ids = np.arange(ROWS)
    table = pa.table(
        {
            "id": ids.astype(np.float64),
            "x0": np.sin(ids).astype(np.float32),
            "label": (ids % 2).astype(np.int64),
        }
    )
    pq.write_table(table, path, row_group_size=ROWS // GROUPS)
    return str(path)


def _wait_for(path: str, timeout: float = 120.0) -> None:
    """Waits until another process creates ``path`` (a cross-process event: a file)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


class _IdLoop:
    """A custom loop that logs the ids of every batch it trains on (one JSON line per batch, one
    file per attempt and rank), checkpoints once at global step ``checkpoint_at`` and, on the
    first attempt, kills rank ``kill_rank``'s process right after that checkpoint is complete."""

    def __init__(
        self, log_dir: str, checkpoint_at: int, kill_rank: int, apply_model: bool = True, epochs: int = EPOCHS
    ) -> None:
        self.log_dir, self.checkpoint_at, self.kill_rank, self.apply_model = (
            log_dir,
            checkpoint_at,
            kill_rank,
            apply_model,
        )
        self.epochs = epochs

    def __call__(self, ctx):
        marker = os.path.join(self.log_dir, "killed")
        attempt = 2 if os.path.exists(marker) else 1
        torch.manual_seed(attempt)  # a resumed run must not rely on its own initial weights
        model = ctx.prepare_model(torch.nn.Linear(2, 2))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        epoch, step, global_step = 1, 0, 0
        restored = ctx.load_checkpoint()
        if restored is not None:
            if self.apply_model:
                model.load_state_dict(restored["model"])
                optimizer.load_state_dict(restored["optimizer"])
            epoch, step, global_step = restored["loop"]
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        log = open(os.path.join(self.log_dir, f"ids-{attempt}-{ctx.rank}.jsonl"), "a")
        while epoch <= self.epochs:
            for features, labels in ctx.epoch_batches(skip=step):
                ids = features[:, 0].long().tolist()
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(features.float()), labels)
                loss.backward()
                optimizer.step()
                step += 1
                global_step += 1
                log.write(json.dumps({"epoch": epoch, "step": global_step, "ids": ids}) + "\n")
                log.flush()
                if attempt == 1 and global_step == self.checkpoint_at:
                    weights = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                    state = {"loop": [epoch, step, global_step]}
                    identical = ctx.replicas_identical
                    ctx.save_checkpoint(
                        {**state, **({} if identical else weights)},
                        step=global_step,
                        replicated=weights if identical else None,
                    )
                    if ctx.rank == self.kill_rank:
                        open(marker, "w").close()
                        os._exit(9)
            epoch, step = epoch + 1, 0
        final = ctx.final_module(model)
        log.close()
        return {
            "start": start,
            "final": final.state_dict(),
            "resumed_from": ctx.resumed_from,
            "world_size": ctx.world_size,
        }


def _epoch_ids(log_dir: str, attempt: int, epoch: int, until_step=None) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for name in os.listdir(log_dir):
        if name.startswith(f"ids-{attempt}-"):
            with open(os.path.join(log_dir, name)) as handle:
                for line in handle:
                    record = json.loads(line)
                    if record["epoch"] == epoch and (until_step is None or record["step"] <= until_step):
                        counts.update(record["ids"])
    return counts


def _run(spark, ids_data, loop, num_workers, checkpoint_dir, strategy):
    return sparkdl.run(
        loop,
        num_workers=num_workers,
        strategy=strategy,
        data=ids_data,
        feature_cols=["id", "x0"],
        label_col="label",
        batch_size=BATCH,
        seed=0,
        spark=spark,
        progress=False,
        checkpoint_dir=checkpoint_dir,
        checkpoint_async=False,
    )


ALL_ROWS = collections.Counter(range(ROWS))


@pytest.mark.parametrize(
    "strategy", [sparkdl.AllReduce(), sparkdl.ModelAveraging(sync_every=4)], ids=["allreduce", "model_averaging"]
)
@pytest.mark.parametrize("old_world, new_world", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_workers_with_every_row_once(
    spark, ids_data, tmp_path, strategy, old_world, new_world
):
    log_dir, checkpoint_dir = tmp_path / "log", str(tmp_path / "ckpt")
    log_dir.mkdir()
    steps = ROWS // (BATCH * old_world)
    at = steps + steps // 2 - 1  # mid-epoch 2, not on a sync step of ModelAveraging(sync_every=4)
    loop = _IdLoop(str(log_dir), checkpoint_at=at, kill_rank=old_world - 1)
    with pytest.raises(sparkdl.TrainingError, match="WorkerLost"):
        _run(spark, ids_data, loop, old_world, checkpoint_dir, strategy)
    checkpoint = open_store(CheckpointConfig(checkpoint_dir)).load_latest()
    assert checkpoint.step == at and checkpoint.world_size == old_world

    result = _run(spark, ids_data, loop, new_world, checkpoint_dir, strategy)
    assert result["resumed_from"] == old_world and result["world_size"] == new_world
    # Epoch 1 ran whole before the failure; epoch 2: before the checkpoint + after the resume.
    assert _epoch_ids(str(log_dir), 1, 1) == ALL_ROWS
    before, after = _epoch_ids(str(log_dir), 1, 2, until_step=at), _epoch_ids(str(log_dir), 2, 2)
    assert sum(before.values()) == (at - steps) * BATCH * old_world
    assert before + after == ALL_ROWS, "the interrupted epoch lost or repeated rows"
    # The resumed model started from the checkpoint's: AllReduce's one copy, or the average of
    # ModelAveraging's replicas (what the next synchronization would have made).
    if isinstance(strategy, sparkdl.AllReduce):
        expected = checkpoint.ranks[0].replicated["model"]
    else:
        replicas = [part.user["model"] for part in checkpoint.ranks]
        expected = {k: sum(r[k].double() for r in replicas) / len(replicas) for k in replicas[0]}
    for key, value in expected.items():
        assert torch.allclose(result["start"][key].double(), value.double(), atol=1e-6), key
    if old_world == 2 and isinstance(strategy, sparkdl.ModelAveraging):
        assert not torch.equal(checkpoint.ranks[0].user["model"]["weight"], checkpoint.ranks[1].user["model"]["weight"])


def test_the_parameter_server_resumes_on_fewer_workers_with_its_shards_re_laid_out(spark, ids_data, tmp_path):
    log_dir, checkpoint_dir = tmp_path / "log", str(tmp_path / "ckpt")
    log_dir.mkdir()
    strategy = sparkdl.ParameterServer()
    at = 20  # mid-epoch 2 of 16 steps
    loop = _IdLoop(str(log_dir), checkpoint_at=at, kill_rank=1, apply_model=False)
    with pytest.raises(sparkdl.TrainingError, match="WorkerLost"):
        _run(spark, ids_data, loop, 2, checkpoint_dir, strategy)
    checkpoint = open_store(CheckpointConfig(checkpoint_dir)).load_latest()
    result = _run(spark, ids_data, loop, 1, checkpoint_dir, strategy)
    # The replica pulled from the one server holds both old shards' values (balanced layout:
    # the shards are consecutive pieces of the flat parameters).
    shards = torch.cat([part.strategy["tables"][0]["values"] for part in checkpoint.ranks])
    pulled = torch.cat([result["start"]["weight"].reshape(-1), result["start"]["bias"].reshape(-1)])
    assert torch.equal(pulled, shards)
    assert _epoch_ids(str(log_dir), 1, 2, until_step=at) + _epoch_ids(str(log_dir), 2, 2) == ALL_ROWS


# -- min_workers: a relaunch that finds a slot taken by another job -----------------------------


def _linear() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


class _KillAfterOccupied:
    """A loss that, on the first attempt, marks training as started and kills rank 1's process at
    its ``at``-th call — once another job's task is queued for the slot it frees."""

    def __init__(self, directory: str, at: int) -> None:
        self.directory, self.at, self.calls = directory, at, 0

    def __call__(self, output, label):
        if torch.distributed.is_initialized() and not os.path.exists(os.path.join(self.directory, "killed")):
            open(os.path.join(self.directory, "started"), "w").close()
            self.calls += 1
            if self.calls == self.at and torch.distributed.get_rank() == 1:
                _wait_for(os.path.join(self.directory, "occupier-queued"))
                open(os.path.join(self.directory, "killed"), "w").close()
                os._exit(9)
        return torch.nn.functional.cross_entropy(output, label)


def _occupy_a_slot(spark, directory: str) -> threading.Thread:
    """Once training has started, another job's one task queues for a slot and holds it until
    ``release`` appears; ``occupier-queued`` appears once Spark has the job's stage active."""
    sc = spark.sparkContext
    release = os.path.join(directory, "release")

    def occupy():
        _wait_for(os.path.join(directory, "started"))
        sc.setJobGroup("elastic-test-occupier", "holds one slot")
        sc.parallelize([0], 1).map(lambda _: _wait_for(release)).collect()

    def watch():
        _wait_for(os.path.join(directory, "started"))
        tracker = sc.statusTracker()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            jobs = tracker.getJobIdsForGroup("elastic-test-occupier")
            stages = {s for j in jobs for s in (tracker.getJobInfo(j).stageIds if tracker.getJobInfo(j) else [])}
            if stages & set(tracker.getActiveStageIds()):
                open(os.path.join(directory, "occupier-queued"), "w").close()
                return
            time.sleep(0.05)

    threads = [threading.Thread(target=occupy, daemon=True), threading.Thread(target=watch, daemon=True)]
    for thread in threads:
        thread.start()
    return threads


def _estimator(directory, loss, **overrides):
    settings = dict(
        model=_linear,
        loss=loss,
        feature_cols=["id", "x0"],
        label_col="label",
        num_workers=2,
        batch_size=BATCH,
        epochs=3,
        seed=0,
        progress=True,
        max_failures=1,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
    )
    settings.update(overrides)
    return sparkdl.TorchEstimator(**settings)


def test_a_relaunch_with_a_slot_taken_continues_on_fewer_workers_down_to_min_workers(spark, ids_data, tmp_path, capsys):
    directory = str(tmp_path)
    threads = _occupy_a_slot(spark, directory)
    try:
        model = _estimator(
            directory,
            _KillAfterOccupied(directory, at=22),
            min_workers=1,
            checkpoint_dir=str(tmp_path / "ckpt"),
            checkpoint_every=4,
            checkpoint_async=False,
        ).fit(ids_data)
    finally:
        open(os.path.join(directory, "release"), "w").close()
        for thread in threads:
            thread.join(timeout=60)
    info = model.run_info
    assert info["workers"] == [2, 1] and len(info["attempts"]) == 2
    assert info["resumed"] == {"from_workers": 2, "on_workers": 1}
    assert "continuing on 1 worker(s)" in capsys.readouterr().out
    # Epoch 2 began on 2 workers and ended on 1: its samples counted once each, none lost.
    assert [r["samples"] for r in model.history] == [ROWS, ROWS, ROWS]
    assert info["steps"]["resumed_at"] == 20


def test_a_relaunch_below_min_workers_fails_naming_both_settings(spark, ids_data, tmp_path):
    directory = str(tmp_path)
    threads = _occupy_a_slot(spark, directory)
    try:
        with pytest.raises(
            sparkdl.InsufficientSlotsError,
            match=r"found 1 free task slot\(s\), fewer than min_workers=2 \(num_workers=2\)",
        ):
            _estimator(directory, _KillAfterOccupied(directory, at=3), min_workers=2, progress=False).fit(ids_data)
    finally:
        open(os.path.join(directory, "release"), "w").close()
        for thread in threads:
            thread.join(timeout=60)


def test_a_first_launch_with_a_slot_taken_starts_on_fewer_workers_down_to_min_workers(
    spark, ids_data, tmp_path, capsys
):
    """min_workers applies to the first launch too: another job holds one of the two slots, so
    after slot_wait_s the fit starts on the one that is free, and says so."""
    directory = str(tmp_path)
    open(os.path.join(directory, "started"), "w").close()  # the occupier queues at once
    threads = _occupy_a_slot(spark, directory)
    try:
        _wait_for(os.path.join(directory, "occupier-queued"))
        model = _estimator(
            directory, torch.nn.functional.cross_entropy, min_workers=1, slot_wait_s=2.0, max_failures=0
        ).fit(ids_data)
    finally:
        open(os.path.join(directory, "release"), "w").close()
        for thread in threads:
            thread.join(timeout=60)
    assert model.run_info["workers"] == [1] and len(model.run_info["attempts"]) == 1
    out = capsys.readouterr().out
    assert (
        "attempt 1: only 1 free task slot(s) for num_workers=2 within slot_wait_s=2s (min_workers=1): continuing on 1 worker(s), starting there"
        in out
    )
    assert [r["samples"] for r in model.history] == [ROWS, ROWS, ROWS]


def test_a_relaunch_without_min_workers_waits_for_a_taken_slot_at_most_slot_wait_s(spark, ids_data, tmp_path, capsys):
    """No min_workers: the relaunch needs both slots, another job holds one. It says what it
    waits for and fails after slot_wait_s naming the settings (it used to wait silently until
    the other job ended, or the stage's start watch, a minute later)."""
    directory = str(tmp_path)
    threads = _occupy_a_slot(spark, directory)
    try:
        with pytest.raises(sparkdl.InsufficientSlotsError) as info:
            _estimator(directory, _KillAfterOccupied(directory, at=3), slot_wait_s=3.0, max_failures=1).fit(ids_data)
        failed_after = time.time() - os.path.getmtime(os.path.join(directory, "killed"))
    finally:
        open(os.path.join(directory, "release"), "w").close()
        for thread in threads:
            thread.join(timeout=60)
    message = str(info.value)
    assert "the relaunch after a failure (attempt 2) found 1 free task slot(s) of the num_workers=2" in message, message
    assert "slot_wait_s=3s" in message and "min_workers" in message, message
    out = capsys.readouterr().out
    assert (
        "attempt 2: waiting up to slot_wait_s=3s for 2 free task slots (1 free now; held or awaited by stage" in out
    ), out
    # The failed attempt's own clean-up (the lost rank's report, the cancel: seconds), then 3 s.
    assert failed_after < 3.0 + 30, failed_after
