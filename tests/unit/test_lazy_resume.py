"""An elastic resume holds one old part's strategy state at a time (issue #45).

Three ranks train a model with an Adagrad and a lazy-Adam ShardedEmbedding table and save a real
checkpoint in a :class:`FileCheckpointStore`; two ranks resume from it. Every read of the store
is recorded (its filesystem wrapped, not replaced), and every sparse-table tensor of an old part
is watched from the moment it is read (``weakref.finalize``): when each old part's strategy state
is read, no other old part's rows may be alive, each is read once, and every row comes back bit
for bit on its new owner. A same-size resume reads its own part's strategy state only; parts of
the format before (strategy state inline) still load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import weakref
from typing import Any, Dict, List, Set, Tuple

import pytest
import torch
import torch.distributed as dist

from sparkdl import filesystem
from sparkdl._runtime.resume import old_rank_states
from sparkdl.checkpoint import MANIFEST, FileCheckpointStore, PartInfo, RankState, StoredRankState, decode_part
from sparkdl.checkpoint.format import WHOLE_PART_FORMAT, _fields, _seal, part_digest
from sparkdl.strategies.parameter_server.rows import owners
from tests.gloo import join_group, save_results, spawn_ranks
from tests.unit.test_sparse_checkpoint import _assert_identical, _held, _start, _train, _union

OLD_WORLD, NEW_WORLD, STEP = 3, 2, 6


class _RecordingFs:
    """The store's real filesystem, every ranged read recorded as (file name, bytes, what
    ``snapshot`` says then)."""

    def __init__(self, fs: Any, snapshot: Any = lambda: None) -> None:
        self._fs, self.snapshot, self.reads = fs, snapshot, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def open_input_file(self, path: str) -> Any:
        recorder, real = self, self._fs.open_input_file(path)

        class _File:
            def __enter__(self) -> "_File":
                return self

            def __exit__(self, *exc: Any) -> None:
                real.close()

            def size(self) -> int:
                return real.size()

            def read_at(self, nbytes: int, offset: int) -> bytes:
                recorder.reads.append((os.path.basename(path), nbytes, recorder.snapshot()))
                return real.read_at(nbytes, offset)

        return _File()


def _recording_store(url: str, snapshot: Any = lambda: None) -> Tuple[FileCheckpointStore, _RecordingFs]:
    store = FileCheckpointStore(url)
    fs = store._fs = _RecordingFs(store._fs, snapshot)
    return store, fs


def _sparse_tensors(strategy: Dict[str, Any]) -> List[torch.Tensor]:
    return [
        tensor for table in strategy["sparse"] for tensor in (table["ids"], table["values"], *table["state"].values())
    ]


def _save_worker(url: str, rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, OLD_WORLD)
    runtime, net, optimizer = _start(rank, port, OLD_WORLD)
    try:
        _train(net, optimizer, 10 + rank, STEP)
        held = _held(runtime)
        state = runtime.state_dict()
        part = RankState(
            user={"loop": {"rank": rank}},
            replicated=None,
            strategy=state,
            torch_rng=torch.get_rng_state(),
            cuda_rng=None,
            grad_scaler=None,
            batches_taken=STEP,
        )
        infos: List[Any] = [None] * OLD_WORLD
        dist.all_gather_object(infos, FileCheckpointStore(url).save_part(STEP, OLD_WORLD, rank, part))
        if rank == 0:
            FileCheckpointStore(url).commit(STEP, OLD_WORLD, infos)
        dist.barrier()
    finally:
        runtime.close()
    save_results({"held": held, "state": state}, out_dir, rank)


def _resume_worker(url: str, rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, NEW_WORLD)
    alive: Set[int] = set()  # old ranks whose sparse rows are alive
    store, fs = _recording_store(url, lambda: sorted(alive))
    runtime, net, optimizer = _start(rank, port, NEW_WORLD)
    try:
        checkpoint = store.load_latest()
        loaded = list(fs.reads)
        fs.reads.clear()
        users = [checkpoint.user_state(old_rank) for old_rank in range(OLD_WORLD)]
        old = old_rank_states(checkpoint, users)
        taken: List[int] = []

        class _Watched:
            """Old rank ``i``'s pair as the strategy sees it; each strategy state taken is watched."""

            def __init__(self, old_rank: int) -> None:
                self.old_rank = old_rank

            def __len__(self) -> int:
                return 2

            def __getitem__(self, index: int) -> Any:
                if index != 1:
                    return old[self.old_rank][index]
                strategy = old[self.old_rank][1]
                tensors = _sparse_tensors(strategy)
                count = [len(tensors)]
                alive.add(self.old_rank)
                taken.append(self.old_rank)

                def gone(old_rank: int = self.old_rank) -> None:
                    count[0] -= 1
                    if not count[0]:
                        alive.discard(old_rank)

                for tensor in tensors:
                    weakref.finalize(tensor, gone)
                del tensors
                return strategy

        user, strategy = runtime.reshard_state([_Watched(r) for r in range(OLD_WORLD)], OLD_WORLD)
        during = list(fs.reads)
        still_alive = sorted(alive)
        runtime.load_state_dict(strategy)
        del strategy
        restored = _held(runtime)
        dist.barrier()
    finally:
        runtime.close()
    save_results(
        {
            "loaded": loaded,
            "during": during,
            "still_alive": still_alive,
            "taken": taken,
            "user": user,
            "stored": all(isinstance(part, StoredRankState) for part in checkpoint.ranks),
            "restored": restored,
        },
        out_dir,
        rank,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Tuple[str, List[Dict[str, Any]]]:
    out = tmp_path_factory.mktemp("lazy_save")
    url = str(out / "ckpt")
    return url, spawn_ranks(functools.partial(_save_worker, url), OLD_WORLD, str(out))


def test_an_elastic_resume_holds_one_old_part_of_rows_at_a_time_and_restores_every_row(saved, tmp_path):
    url, results = saved
    resumed = spawn_ranks(functools.partial(_resume_worker, url), NEW_WORLD, str(tmp_path))
    parts = [f"rank-{r:05d}.pt" for r in range(OLD_WORLD)]
    sizes = [os.path.getsize(os.path.join(url, f"ckpt-{STEP:012d}", name)) for name in parts]
    for result in resumed:
        assert result["stored"]  # the checkpoint came back without its strategy states
        # Loading it read each part's head and checksummed its strategy section, never whole.
        assert {name for name, _, _ in result["loaded"]} == set(parts)
        assert all(nbytes < size for name, nbytes, _ in result["loaded"] for size in [sizes[parts.index(name)]])
        # The re-sharding read each old part's strategy section once, in rank order, and when it
        # read one, no other old part's rows were alive: one old part held at a time.
        assert [name for name, _, _ in result["during"]] == parts
        assert [alive for _, _, alive in result["during"]] == [[], [], []]
        assert result["taken"] == list(range(OLD_WORLD)) and result["still_alive"] == []
    for table in range(2):
        expected = _union([r["held"] for r in results], table)
        _assert_identical(_union([r["restored"] for r in resumed], table), expected)  # values, optimizer state
        for rank, result in enumerate(resumed):
            ids = torch.tensor(sorted(result["restored"][table]), dtype=torch.int64)
            assert len(ids) and bool((owners(ids, NEW_WORLD) == rank).all())
    assert [r["user"] for r in resumed] == [{"loop": {"rank": 0}}, {"loop": {"rank": 1}}]


def _assert_equal_trees(got: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert sorted(got, key=str) == sorted(expected, key=str)
        for key in expected:
            _assert_equal_trees(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            _assert_equal_trees(a, b)
    else:
        assert got == expected


def test_a_same_size_resume_reads_its_own_strategy_state_only(saved):
    url, results = saved
    store, fs = _recording_store(url)
    checkpoint = store.load_latest()
    fs.reads.clear()
    part = checkpoint.rank_state(1, OLD_WORLD, url)
    assert checkpoint.user_state(1) == {"loop": {"rank": 1}} and fs.reads == []  # the heads are read already
    _assert_equal_trees(part.strategy, results[1]["state"])
    assert [name for name, _, _ in fs.reads] == ["rank-00001.pt"]
    assert "strategy" not in vars(part)  # read, handed out, not kept


def _write_whole_parts(url: str, step: int, parts: List[RankState]) -> None:
    """A checkpoint as the format before wrote it: each part's strategy state inline (format 2)."""
    _, fs, root = filesystem.open_url(url, "checkpoint_dir")
    directory = filesystem.join(root, f"ckpt-{step:012d}")
    infos = []
    for rank, part in enumerate(parts):
        data = _seal(
            {
                "format": WHOLE_PART_FORMAT,
                "step": step,
                "world_size": len(parts),
                "rank": rank,
                "state": _fields(part),
            }
        )
        filesystem.write_atomically(fs, filesystem.join(directory, f"rank-{rank:05d}.pt"), data)
        infos.append(dataclasses.asdict(PartInfo(rank, f"rank-{rank:05d}.pt", len(data), part_digest(data))))
    manifest = {"format": WHOLE_PART_FORMAT, "step": step, "world_size": len(parts), "parts": infos}
    filesystem.write_atomically(fs, filesystem.join(directory, MANIFEST), json.dumps(manifest).encode())


def test_checkpoints_whose_parts_hold_their_strategy_state_inline_still_load(saved, tmp_path):
    url, results = saved
    checkpoint = FileCheckpointStore(url).load_latest()
    whole = [decode_part(_read_part(url, r), STEP, OLD_WORLD, r) for r in range(OLD_WORLD)]  # format 3, whole
    for r, part in enumerate(whole):
        _assert_equal_trees(part.strategy, results[r]["state"])
        assert part.user == checkpoint.ranks[r].user and part.batches_taken == STEP
    older = str(tmp_path / "older")
    _write_whole_parts(older, STEP, whole)
    loaded = FileCheckpointStore(older).load_latest()
    assert loaded.step == STEP and not any(isinstance(part, StoredRankState) for part in loaded.ranks)
    pairs = old_rank_states(loaded, [loaded.user_state(r) for r in range(OLD_WORLD)])
    for r, pair in enumerate(pairs):
        user, strategy = pair
        assert user == {"loop": {"rank": r}}
        _assert_equal_trees(strategy, results[r]["state"])


def _read_part(url: str, rank: int) -> bytes:
    with open(os.path.join(url, f"ckpt-{STEP:012d}", f"rank-{rank:05d}.pt"), "rb") as file:
        return file.read()


def test_a_strategy_state_damaged_after_the_load_is_refused_with_the_part_named(saved, tmp_path):
    url, _ = saved
    copy = tmp_path / "copy"
    directory = copy / f"ckpt-{STEP:012d}"
    directory.mkdir(parents=True)
    for name in os.listdir(os.path.join(url, f"ckpt-{STEP:012d}")):
        (directory / name).write_bytes(open(os.path.join(url, f"ckpt-{STEP:012d}", name), "rb").read())
    checkpoint = FileCheckpointStore(str(copy)).load_latest()
    data = bytearray((directory / "rank-00002.pt").read_bytes())
    data[-10] ^= 0xFF
    (directory / "rank-00002.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"rank-00002\.pt is damaged .*delete its checkpoint directory"):
        _ = checkpoint.ranks[2].strategy
    assert checkpoint.ranks[1].strategy["world_size"] == OLD_WORLD  # the intact parts still read
