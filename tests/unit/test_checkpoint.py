"""Checkpoint settings, the failure policy, and writing checkpoints (the copy to host memory,
the background write, the commit) without Spark (the stores: test_checkpoint_store_contract.py)."""

import datetime
import os
import threading

import pytest
import torch

from sparkdl._driver import Decision, FailurePolicy, LaunchConfig
from sparkdl._net.rendezvous_client import StoreClient
from sparkdl._net.rendezvous_store import StoreServer
from sparkdl._runtime.checkpoint_writer import CheckpointWriteError, CheckpointWriter, capture, owners, snapshot
from sparkdl._runtime.rendezvous import rendezvous, teardown
from sparkdl.checkpoint import MANIFEST, Checkpoint, CheckpointConfig, open_store, tree_leaves
from sparkdl.context import TrainContext
from sparkdl.errors import ConfigError, RankFailure, TrainingError
from sparkdl.strategies import AllReduce


def test_checkpoint_config_validation():
    with pytest.raises(ConfigError, match="checkpoint_every=0 must be a positive number of steps"):
        CheckpointConfig("/tmp/x", every_steps=0)
    with pytest.raises(ConfigError, match="keep_checkpoints=0"):
        CheckpointConfig("/tmp/x", keep=0)
    with pytest.raises(ConfigError, match="checkpoint_async='no' must be True or False"):
        CheckpointConfig("/tmp/x", async_write="no")
    assert CheckpointConfig("/tmp/x").async_write is True
    assert open_store(CheckpointConfig("/tmp/x", async_write=False)).async_write is False
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
    first = TrainingError(
        [RankFailure(1, "RuntimeError", "bad batch", "", "training step 7 (forward, backward, sync, optimizer)")]
    )
    assert policy.decide(first, 1) is Decision.RETRY
    again = TrainingError(
        [RankFailure(1, "RuntimeError", "bad batch", "", "training step 7 (forward, backward, sync, optimizer)")]
    )
    assert policy.decide(again, 2, previous=first) is Decision.RAISE
    elsewhere = TrainingError(
        [RankFailure(1, "RuntimeError", "bad batch", "", "training step 9 (forward, backward, sync, optimizer)")]
    )
    assert policy.decide(elsewhere, 2, previous=first) is Decision.RETRY
    other_rank = TrainingError(
        [RankFailure(0, "RuntimeError", "bad batch", "", "training step 7 (forward, backward, sync, optimizer)")]
    )
    assert policy.decide(other_rank, 2, previous=first) is Decision.RETRY


def test_no_retries_by_default():
    assert FailurePolicy().decide(_error("WorkerLost"), 1) is Decision.RAISE


# -- the copy to host memory -------------------------------------------------------------------


def test_the_snapshot_is_a_copy_that_later_training_does_not_change():
    weight = torch.zeros(4, 3)
    view = torch.arange(10.0)[2:5]  # a view: the copy holds its 3 values, not the whole storage
    state = {"model": {"w": weight, "v": view}, "history": [{"loss": 1.0}], "pair": (torch.ones(2), "x")}
    copy = snapshot(state)
    weight.add_(1)
    view.mul_(0)
    state["history"].append({"loss": 0.5})
    state["model"]["w2"] = torch.ones(1)
    assert torch.equal(copy["model"]["w"], torch.zeros(4, 3)) and torch.equal(
        copy["model"]["v"], torch.tensor([2.0, 3.0, 4.0])
    )
    assert copy["history"] == [{"loss": 1.0}] and set(copy["model"]) == {"w", "v"}
    assert copy["model"]["v"].untyped_storage().nbytes() == 3 * 4
    assert copy["pair"][1] == "x" and copy["model"]["w"].data_ptr() != weight.data_ptr()


def _adam_state(hidden=16):
    model = torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 2)
    )
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_replicated_state_is_split_over_the_ranks_once_and_made_whole_again():
    state = _adam_state()
    world_size = 3
    leaves = tree_leaves(state)
    chosen = owners(leaves, world_size)
    sizes = [
        sum(leaves[i].numel() * leaves[i].element_size() for i, r in chosen.items() if r == rank)
        for rank in range(world_size)
    ]
    largest = max(leaf.numel() * leaf.element_size() for leaf in leaves if isinstance(leaf, torch.Tensor))
    assert max(sizes) - min(sizes) <= largest  # balanced up to one tensor
    parts = [capture({"rank": r}, state, {}, None, 0, torch.device("cpu"), r, world_size) for r in range(world_size)]
    held = [i for part in parts for i in part.replicated_leaves]
    assert sorted(held) == sorted(chosen) and len(held) == len(set(held))  # each tensor exactly once
    for part in parts:  # a rank copies only its share: the other tensors are not in its part
        assert sum(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(part.replicated)) == len(
            part.replicated_leaves
        )
    whole = Checkpoint.from_parts(5, world_size, parts)
    assert whole.user_state(2)["rank"] == 2
    merged = whole.user_state(1)
    for name, tensor in state["model"].items():
        assert torch.equal(merged["model"][name], tensor), name
    for index, moments in state["optimizer"]["state"].items():
        assert all(torch.equal(merged["optimizer"]["state"][index][k], v) for k, v in moments.items())
    assert merged["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    with pytest.raises(ValueError, match="do not fit together"):
        Checkpoint.from_parts(5, world_size, [parts[0], parts[0], parts[2]])


# -- writing: one rank through a real TrainContext, several through the real rendezvous store ---


@pytest.fixture
def one_rank(tmp_path):
    """A TrainContext of a one-rank run (real rendezvous and process group) with a checkpoint_dir."""
    env = rendezvous(0, 1, ["127.0.0.1:0"], lambda value: [value], torch.device("cpu"), timeout_s=60)
    runtime = AllReduce().create_runtime(env)

    def make(async_write=True):
        store = open_store(CheckpointConfig(str(tmp_path / "ckpt"), async_write=async_write))
        records = []
        ctx = TrainContext(env, runtime, records.append, store=store)
        return ctx, records

    yield make
    runtime.close()
    teardown()


def test_a_saved_checkpoint_holds_the_state_at_the_save_not_what_training_did_next(one_rank, tmp_path):
    ctx, _ = one_rank()
    state = _adam_state(hidden=256)
    saved = {k: v.clone() for k, v in state["model"].items()}
    ctx.save_checkpoint({"step": 1}, step=1, replicated=state)
    for tensor in state["model"].values():  # what the next optimizer steps do, while the write runs
        tensor.add_(1.0)
    ctx.close()
    assert ctx.checkpoint_stats["count"] == 1 and ctx.checkpoint_stats["written"] == 1
    assert ctx.checkpoint_stats["write_seconds"] > 0
    restored = ctx.load_checkpoint()
    assert restored["step"] == 1
    for name, tensor in saved.items():
        assert torch.equal(restored["model"][name], tensor), name


def test_without_async_write_the_checkpoint_is_committed_when_save_returns(one_rank, tmp_path):
    ctx, _ = one_rank(async_write=False)
    ctx.save_checkpoint({"step": 3, "w": torch.ones(3)}, step=3)
    assert (tmp_path / "ckpt" / "ckpt-000000000003" / MANIFEST).is_file()
    assert ctx.checkpoint_stats["written"] == 1


def _block(tmp_path, step, rank=0):
    """Makes the part's path a directory: the rank's real write of it fails (rename onto a directory)."""
    (tmp_path / "ckpt" / f"ckpt-{step:012d}" / f"rank-{rank:05d}.pt").mkdir(parents=True)


def test_a_background_write_error_is_raised_at_the_next_save(one_rank, tmp_path):
    ctx, _ = one_rank()
    ctx.save_checkpoint({"step": 1}, step=1)
    _block(tmp_path, 2)
    ctx.save_checkpoint({"step": 2}, step=2)  # returns: the write fails in the background
    url = f"file://{tmp_path}/ckpt/ckpt-000000000002"
    with pytest.raises(CheckpointWriteError, match=f"rank 0 could not write checkpoint {url}: .*Is a directory"):
        ctx.save_checkpoint({"step": 3}, step=3)
    assert ctx.load_checkpoint()["step"] == 1  # 2 has no manifest: it does not count
    ctx.save_checkpoint({"step": 3}, step=3)  # raised once; the run may go on
    ctx.close()
    assert ctx.load_checkpoint()["step"] == 3


def test_a_background_write_error_is_raised_and_reported_at_close(one_rank, tmp_path):
    ctx, records = one_rank()
    _block(tmp_path, 7)
    ctx.save_checkpoint({"step": 7}, step=7)
    with pytest.raises(CheckpointWriteError, match="rank 0 could not write checkpoint file://.*/ckpt-000000000007"):
        ctx.close()
    # close runs after the task reported done: the failure goes to the driver from here
    failure = RankFailure.from_json(next(r for r in records if r["kind"] == "error")["failure"])
    assert (failure.rank, failure.exc_type, failure.phase) == (0, "CheckpointWriteError", "writing a checkpoint")


def test_a_failing_rank_logs_a_write_error_at_close_instead_of_replacing_its_own(one_rank, tmp_path, caplog):
    ctx, records = one_rank()
    _block(tmp_path, 4)
    ctx.save_checkpoint({"step": 4}, step=4)
    with caplog.at_level("WARNING", logger="sparkdl.rank0"):
        with pytest.raises(ZeroDivisionError):
            try:
                raise ZeroDivisionError
            finally:
                ctx.close()
    assert any("could not write checkpoint" in r.getMessage() for r in caplog.records)
    assert not [r for r in records if r["kind"] == "error"]


def _writers(tmp_path, world_size, stats):
    server = StoreServer("127.0.0.1", b"s" * 32, timeout_s=10)
    clients = [StoreClient(server.address, b"s" * 32, r, datetime.timedelta(seconds=10)) for r in range(world_size)]
    writers = [
        CheckpointWriter(
            open_store(CheckpointConfig(str(tmp_path / "ckpt"), keep=2)), r, world_size, stats[r], client=clients[r]
        )
        for r in range(world_size)
    ]
    return server, clients, writers


def test_the_last_rank_to_store_its_part_commits_and_nobody_waits_for_the_others(tmp_path):
    world_size = 3
    stats = [{"written": 0, "write_seconds": 0.0} for _ in range(world_size)]
    server, clients, writers = _writers(tmp_path, world_size, stats)
    state = _adam_state()
    try:
        for step in (10, 20):
            parts = [
                capture({"r": r, "step": step}, state, {}, None, step + r, torch.device("cpu"), r, world_size)
                for r in range(world_size)
            ]
            threads = [threading.Thread(target=writers[r].submit, args=(step, parts[r])) for r in range(world_size)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            for writer in writers:
                writer.wait()
        directory = tmp_path / "ckpt" / "ckpt-000000000020"
        assert sorted(os.listdir(directory)) == [MANIFEST, "rank-00000.pt", "rank-00001.pt", "rank-00002.pt"]
        loaded = open_store(CheckpointConfig(str(tmp_path / "ckpt"))).load_latest()
        assert loaded.step == 20 and [p.batches_taken for p in loaded.ranks] == [20, 21, 22]
        assert all(torch.equal(loaded.user_state(2)["model"][k], v) for k, v in state["model"].items())
        assert [s["written"] for s in stats] == [2, 2, 2]
        assert clients[0].num_keys() == 0  # the committer cleaned up after each checkpoint

        # Rank 2 never stores its part of 30 (it died): ranks 0 and 1 finish without waiting,
        # and the checkpoint stays incomplete, so a resume uses 20.
        for r in (0, 1):
            writers[r].submit(30, capture({"r": r}, state, {}, None, 0, torch.device("cpu"), r, world_size))
            writers[r].wait()
        assert not (tmp_path / "ckpt" / "ckpt-000000000030" / MANIFEST).exists()
        assert open_store(CheckpointConfig(str(tmp_path / "ckpt"))).load_latest().step == 20
    finally:
        for client in clients:
            client.close()
        server.close()


def test_ranks_that_save_different_steps_in_one_call_get_an_error(tmp_path):
    stats = [{"written": 0, "write_seconds": 0.0} for _ in range(2)]
    server, clients, writers = _writers(tmp_path, 2, stats)
    try:
        writers[0].submit(5, capture({}, None, {}, None, 0, torch.device("cpu"), 0, 2))
        writers[0].wait()
        writers[1].submit(6, capture({}, None, {}, None, 0, torch.device("cpu"), 1, 2))
        with pytest.raises(
            CheckpointWriteError,
            match=r"rank 1 could not write checkpoint .*ckpt-000000000006: .*different steps \[5, 6\]",
        ):
            writers[1].wait()
    finally:
        for client in clients:
            client.close()
        server.close()


def test_check_writable_names_the_path_and_the_reason(tmp_path):
    from sparkdl.errors import ConfigError
    from sparkdl.filesystem import check_writable

    check_writable(str(tmp_path / "new" / "ckpt"), "checkpoint_dir")  # made if missing, left empty
    assert os.listdir(tmp_path / "new" / "ckpt") == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint_dir='.*file/ckpt' cannot be written: .*Not a directory"):
        check_writable(str(tmp_path / "file" / "ckpt"), "checkpoint_dir")
