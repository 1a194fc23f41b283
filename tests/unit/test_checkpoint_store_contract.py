"""The checkpoint-store contract: what every :class:`~sparkdl.checkpoint.CheckpointStore` must do.

A new store joins by adding one entry to ``STORES``: a function that builds it in a fresh
location, and one that damages the newest checkpoint it holds (so the fallback can be checked).
"""

import os
import pickle
import uuid

import pytest
import torch

from sparkdl import filesystem
from sparkdl.checkpoint import (
    Checkpoint,
    CheckpointConfig,
    CheckpointStore,
    FileCheckpointStore,
    RankState,
    open_store,
    register_store,
)


def _damage_newest_file(store, how):
    """Rewrites the newest ``ckpt-*.pt`` of a file store through its own filesystem."""
    _, fs, root = filesystem.open_url(store.url, "checkpoint_dir")
    path = filesystem.join(root, f"ckpt-{store.steps()[-1]:012d}.pt")
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


def _checkpoint(step, world_size=2, scale=1.0):
    ranks = [
        RankState(
            user={"w": torch.arange(6, dtype=torch.float64).reshape(2, 3) * step * scale, "meta": {"step": step, "rank": r}},
            replicated={"shared": torch.full((4,), float(step))} if r == 0 else None,
            strategy={"center": torch.ones(3) * r},
            torch_rng=torch.get_rng_state(),
            cuda_rng=None,
            grad_scaler=None,
            batches_taken=step * 10 + r,
        )
        for r in range(world_size)
    ]
    return Checkpoint(step, world_size, ranks)


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
    # rank 1 sees the state rank 0 kept for everyone, merged under its own
    assert set(loaded.user_state(1)) == {"shared", "w", "meta"}
    assert torch.equal(loaded.user_state(1)["shared"], torch.full((4,), 30.0))
    # keep=2: the oldest is gone, so damaging the newest falls back to 20, not 10
    if hasattr(store, "steps"):
        assert store.steps() == [20, 30]


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(store_and_damage, how):
    store, damage = store_and_damage
    store.save(_checkpoint(1))
    store.save(_checkpoint(2))
    damage(store, how)
    loaded = store.load_latest()
    assert loaded is not None and loaded.step == 1
    assert loaded.ranks[0].user["meta"] == {"step": 1, "rank": 0}


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


def test_file_store_leaves_no_temporary_files(tmp_path):
    store = _local(tmp_path)
    for step in range(1, 5):
        store.save(_checkpoint(step))
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["ckpt-000000000003.pt", "ckpt-000000000004.pt"]


def test_open_store_uses_the_store_registered_for_a_scheme(tmp_path):
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
