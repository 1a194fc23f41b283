"""The checkpoint-store contract: what every :class:`~sparkdl.checkpoint.CheckpointStore` must do.

A new store joins by adding one entry to ``STORES``: a function that builds it in a fresh
location, and one that damages the newest checkpoint it holds — its manifest or one of its
parts — so the fallback can be checked.
"""

import os
import pickle
import threading
import uuid

import pytest
import torch

from sparkdl import checkpoint, filesystem
from sparkdl._runtime.checkpoint_writer import share
from sparkdl.checkpoint import (
    MANIFEST,
    Checkpoint,
    CheckpointConfig,
    CheckpointStore,
    FileCheckpointStore,
    RankState,
    encode,
    open_store,
    register_store,
)


def _damage_newest_file(store, how, target):
    """Rewrites the newest checkpoint's manifest or rank 1's part, through the store's own filesystem."""
    _, fs, root = filesystem.open_url(store.url, "checkpoint_dir")
    path = filesystem.join(
        root, f"ckpt-{store.steps()[-1]:012d}/{MANIFEST if target == 'manifest' else 'rank-00001.pt'}"
    )
    data = filesystem.read_bytes(fs, path)
    damaged = {
        "truncate": data[: len(data) // 2],
        "flip": data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:],
        "garbage": b"not a checkpoint",
    }[how]
    with fs.open_output_stream(path) as out:
        out.write(damaged)


def _local(tmp_path):
    return open_store(CheckpointConfig(str(tmp_path / "ckpt"), keep=2))


def _fsspec_only(tmp_path):
    # memory:// is a scheme pyarrow has no filesystem for: it goes through fsspec.
    return open_store(CheckpointConfig(f"memory://sparkdl-test/{uuid.uuid4().hex}", keep=2))


STORES = {"local": (_local, _damage_newest_file), "fsspec-memory": (_fsspec_only, _damage_newest_file)}


@pytest.fixture(params=sorted(STORES))
def store_and_damage(request, tmp_path):
    make, damage = STORES[request.param]
    store = make(tmp_path)
    assert isinstance(store, CheckpointStore) and store.keep == 2
    return store, damage


def _replicated(step):
    """Model and optimizer state as AllReduce ranks hold it: identical on every rank."""
    weights = {
        "0.weight": torch.full((8, 4), float(step)),
        "0.bias": torch.arange(8.0) + step,
        "2.weight": torch.ones(3, 8) * step,
    }
    optimizer = {
        "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.full((8, 4), step / 10)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
    }
    return {"model": weights, "optimizer": optimizer, "epochs": (step, "done")}


def _checkpoint(step, world_size=2, scale=1.0, split=True):
    """Every rank's part; ``split``: each rank holds its share of the replicated state (as
    ranks save it), else rank 0 holds all of it (as single-file checkpoints did)."""
    ranks = []
    for r in range(world_size):
        shared, leaves = (
            share(_replicated(step), r, world_size) if split else (_replicated(step) if r == 0 else None, None)
        )
        ranks.append(
            RankState(
                user={
                    "w": torch.arange(6, dtype=torch.float64).reshape(2, 3) * step * scale,
                    "meta": {"step": step, "rank": r},
                },
                replicated=shared,
                strategy={"center": torch.ones(3) * r},
                torch_rng=torch.get_rng_state(),
                cuda_rng=None,
                grad_scaler=None,
                batches_taken=step * 10 + r,
                replicated_leaves=leaves,
            )
        )
    return Checkpoint(step, world_size, ranks)


def _assert_replicated_is_whole(loaded, step):
    expected = _replicated(step)
    assert loaded.ranks[0].replicated.keys() == expected.keys() and all(
        part.replicated is None for part in loaded.ranks[1:]
    )
    for name, tensor in expected["model"].items():
        assert torch.equal(loaded.ranks[0].replicated["model"][name], tensor), name
    state = loaded.ranks[0].replicated["optimizer"]["state"][0]
    assert torch.equal(state["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"]) and state["step"].item() == step
    assert loaded.ranks[0].replicated["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert loaded.ranks[0].replicated["epochs"] == (step, "done")


def test_round_trip_is_bit_exact_and_keeps_the_newest(store_and_damage):
    store, _ = store_and_damage
    for step in (10, 20, 30):
        store.save(_checkpoint(step))
    loaded = store.load_latest()
    assert (loaded.step, loaded.world_size) == (30, 2)
    assert torch.equal(loaded.ranks[1].user["w"], _checkpoint(30).ranks[1].user["w"])
    assert loaded.ranks[1].user["meta"] == {"step": 30, "rank": 1}
    assert loaded.ranks[1].batches_taken == 301
    assert torch.equal(loaded.ranks[0].torch_rng, _checkpoint(30).ranks[0].torch_rng)
    # The ranks' shares of the replicated state are whole again, and every rank sees it.
    _assert_replicated_is_whole(loaded, 30)
    assert set(loaded.user_state(1)) == {"model", "optimizer", "epochs", "w", "meta"}
    assert torch.equal(loaded.user_state(1)["model"]["0.bias"], torch.arange(8.0) + 30)
    # keep=2: the oldest is gone, so damaging the newest falls back to 20, not 10
    if hasattr(store, "steps"):
        assert store.steps() == [20, 30]


@pytest.mark.parametrize("target", ["manifest", "part"])
@pytest.mark.parametrize("how", ["truncate", "flip", "garbage"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(store_and_damage, how, target, caplog):
    store, damage = store_and_damage
    store.save(_checkpoint(1))
    store.save(_checkpoint(2))
    damage(store, how, target)
    with caplog.at_level("WARNING", logger="sparkdl.checkpoint"):
        loaded = store.load_latest()
    assert loaded is not None and loaded.step == 1
    assert loaded.ranks[0].user["meta"] == {"step": 1, "rank": 0}
    assert any("ckpt-000000000002" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)


def test_parts_are_stored_in_parallel_by_each_ranks_copy_and_committed_by_any_rank(store_and_damage):
    store, _ = store_and_damage
    checkpoint = _checkpoint(40, world_size=3)
    copies = [pickle.loads(pickle.dumps(store)) for _ in range(3)]  # one per task, as the launcher ships it
    infos = [None] * 3
    threads = [
        threading.Thread(target=lambda r=r: infos.__setitem__(r, copies[r].save_part(40, 3, r, checkpoint.ranks[r])))
        for r in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [info.rank for info in infos] == [0, 1, 2] and len({info.name for info in infos}) == 3
    copies[2].commit(40, 3, list(reversed(infos)))  # the last rank to finish commits, whichever it is
    loaded = store.load_latest()
    assert (loaded.step, loaded.world_size) == (40, 3)
    assert [part.batches_taken for part in loaded.ranks] == [400, 401, 402]
    _assert_replicated_is_whole(loaded, 40)


def test_parts_without_a_commit_are_not_a_checkpoint(store_and_damage):
    """A rank died before its part was stored (or the committer before the manifest): the run
    resumes from the previous checkpoint, and the next commit still keeps ``keep``."""
    store, _ = store_and_damage
    store.save(_checkpoint(1))
    newer = _checkpoint(2)
    store.save_part(2, 2, 0, newer.ranks[0])  # rank 1's part never came
    assert store.load_latest().step == 1
    store.save_part(2, 2, 1, newer.ranks[1])  # both parts, but nobody committed
    assert store.load_latest().step == 1
    store.save(_checkpoint(3))
    store.save(_checkpoint(4))
    assert store.load_latest().step == 4
    if hasattr(store, "steps"):
        assert store.steps() == [3, 4]


def test_a_checkpoint_that_keeps_the_replicated_state_whole_on_rank_0_loads(store_and_damage):
    store, _ = store_and_damage
    store.save(_checkpoint(6, split=False))
    loaded = store.load_latest()
    _assert_replicated_is_whole(loaded, 6)
    assert loaded.ranks[1].user["meta"] == {"step": 6, "rank": 1}


def test_an_empty_store_means_start_fresh(store_and_damage):
    store, _ = store_and_damage
    assert store.load_latest() is None
    assert store.load_finished() == (False, None)


def test_checkpoints_hold_data_not_code(store_and_damage, tmp_path):
    store, _ = store_and_damage
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    checkpoint = _checkpoint(1)
    checkpoint.ranks[0].user["x"] = Evil()
    store.save(checkpoint)  # torch.save pickles whatever it is given...
    assert store.load_latest() is None  # ...but loading is weights_only: the file is refused
    assert not marker.exists()


def test_finished_result_and_clear(store_and_damage):
    store, _ = store_and_damage
    store.save(_checkpoint(5))
    store.save_finished({"answer": 42})
    assert store.load_finished() == (True, {"answer": 42})
    store.clear()
    assert store.load_finished() == (False, None)
    assert store.load_latest() is None


def test_the_store_travels_to_tasks_and_sees_the_same_checkpoints(store_and_damage):
    store, _ = store_and_damage
    store.save(_checkpoint(7))
    copy = pickle.loads(pickle.dumps(store))  # the launcher ships the driver's store to every task
    assert copy.url == store.url and copy.load_latest().step == 7
    copy.save(_checkpoint(8))
    assert store.load_latest().step == 8


def test_file_store_layout_is_one_part_per_rank_and_a_manifest_without_temporary_files(tmp_path):
    import json

    store = _local(tmp_path)
    for step in range(1, 5):
        store.save(_checkpoint(step))
    root = tmp_path / "ckpt"
    assert sorted(os.listdir(root)) == ["ckpt-000000000003", "ckpt-000000000004"]
    assert sorted(os.listdir(root / "ckpt-000000000004")) == ["manifest.json", "rank-00000.pt", "rank-00001.pt"]
    manifest = json.loads((root / "ckpt-000000000004" / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"]) == (4, 2)
    assert [(p["rank"], p["name"], p["size"]) for p in manifest["parts"]] == [
        (r, f"rank-0000{r}.pt", os.path.getsize(root / "ckpt-000000000004" / f"rank-0000{r}.pt")) for r in range(2)
    ]


def test_file_store_loads_single_file_checkpoints_of_earlier_versions(tmp_path, caplog):
    """``ckpt-<step>.pt`` (one file, rank 0 holding the replicated state) still loads, also as
    the fallback behind a damaged newer checkpoint, and is pruned like the others."""
    store = _local(tmp_path)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "ckpt-000000000005.pt").write_bytes(encode(_checkpoint(5, split=False)))
    loaded = store.load_latest()
    assert loaded.step == 5 and loaded.ranks[1].batches_taken == 51
    _assert_replicated_is_whole(loaded, 5)
    store.save(_checkpoint(6))
    _damage_newest_file(store, "flip", "part")
    with caplog.at_level("WARNING", logger="sparkdl.checkpoint"):
        assert store.load_latest().step == 5
    store.save(_checkpoint(7))
    store.save(_checkpoint(8))  # keep=2: the single file goes with the damaged 6
    assert sorted(os.listdir(root)) == ["ckpt-000000000007", "ckpt-000000000008"]


def test_open_store_uses_the_store_registered_for_a_scheme(tmp_path, monkeypatch):
    # The registry is process-wide: this test's store must not outlive it (a later test's
    # sparkdltest:// checkpoints would land in this one's memory:// store).
    monkeypatch.setattr(checkpoint, "_STORES", dict(checkpoint._STORES))

    @register_store("sparkdltest")
    class _Recording(FileCheckpointStore):
        def __init__(self, url, keep=3):
            self.requested = url
            super().__init__(f"memory://{url.split('://', 1)[1]}", keep)

    store = open_store(CheckpointConfig("sparkdltest://bucket/run-1", keep=4))
    assert isinstance(store, _Recording) and store.requested == "sparkdltest://bucket/run-1" and store.keep == 4
    # Anything else is a file store; plain paths become file:// URLs.
    plain = open_store(CheckpointConfig(str(tmp_path / "plain")))
    assert type(plain) is FileCheckpointStore and plain.url == f"file://{tmp_path / 'plain'}"


def test_a_checkpoint_of_another_world_size_names_the_setting():
    from sparkdl.errors import ConfigError

    with pytest.raises(ConfigError, match="written by 2 workers but this run has num_workers=3"):
        _checkpoint(4).rank_state(0, 3, "file:///ckpt")
