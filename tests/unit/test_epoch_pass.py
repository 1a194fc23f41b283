"""An epoch is one pass over the shard, on row ids: with shuffling on, no row is taken twice in an
epoch while the rank's shard still holds rows it has not taken, and the rows an epoch leaves
out are exactly what the remainder rule predicts (issue #29, point 8).

The remainder rule: an epoch is ``L = steps_per_epoch * batch_size`` rows on every rank, and a
rank's stream goes on across epochs. A shard of ``S >= L`` rows leaves ``S - L`` rows out of
each epoch (they open the next one); a smaller shard (``S < L``) wraps around within the
epoch, so each of its rows is taken ``L // S`` or ``L // S + 1`` times, ``L % S`` of them the
more often. Real Parquet files with an ``id`` column, read through the real readers."""

from __future__ import annotations

import collections
import itertools
import os
from typing import Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl.data import reshard
from sparkdl.data.batching import batches, steps_per_epoch
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers import reader_from_name
from sparkdl.data.selection import shard_rows
from sparkdl.data.spec import DataSpec

BATCH = 32
EPOCHS = 3
#: Row groups per file. EQUAL: 1,400 rows in 14 groups of 100 (the issue's case: 1,400 rows,
#: batch 32); on 2 ranks two shards of 700. UNEQUAL: groups of 200 and 90 alternate, so on
#: 2 ranks one shard holds 800 rows and the other 360 (smaller than an epoch's 576: it wraps).
LAYOUTS = {
    "equal": [[100] * 7, [100] * 7],
    "unequal": [[200, 90] * 2, [200, 90] * 2],
}
READERS = [
    "arrow",
    pytest.param("petastorm", marks=pytest.mark.petastorm),  # run on the petastorm stack
]


def write_rows(path: str, row_groups_per_file: List[List[int]]) -> str:
    """Files whose rows carry their id (int64 ``id`` = the row's position) and ``label``."""
    os.makedirs(path, exist_ok=True)
    next_id = 0
    for index, sizes in enumerate(row_groups_per_file):
        with pq.ParquetWriter(
            f"{path}/part-{index}.parquet", pa.schema([("id", pa.int64()), ("label", pa.int64())])
        ) as writer:
            for size in sizes:
                ids = np.arange(next_id, next_id + size, dtype=np.int64)
                next_id += size
                writer.write_table(pa.table({"id": ids, "label": ids % 3}))  # one row group per write
    return path


def stream_ids(reader_name: str, dataset, spec: DataSpec, rank: int, world_size: int, count: int) -> List[np.ndarray]:
    stream = batches(reader_from_name(reader_name), dataset, spec, rank, world_size)
    try:
        return [np.asarray(features)[:, 0].astype(np.int64) for features, _ in itertools.islice(stream, count)]
    finally:
        stream.close()


def expected_counts(shard: int, epoch_rows: int) -> Dict[int, int]:
    """How many of the shard's rows an epoch takes how often, by the remainder rule."""
    low, more = divmod(epoch_rows, shard)
    expected = {low: shard - more, low + 1: more}
    return {times: rows for times, rows in expected.items() if rows}


def epoch_figures(reader_name, dataset, spec, world_size):
    """Per epoch and rank: (rows taken twice or more, rows not taken, {times: rows}), and what
    the remainder rule expects."""
    counts = shard_rows(dataset, world_size, spec.holdout, "train", spec.filters)
    steps = steps_per_epoch(sum(counts), spec.batch_size, world_size)
    got, want = [], []
    for rank in range(world_size):
        shard_ids = set()
        for ids in stream_ids(
            reader_name,
            dataset,
            dataclasses_replace(spec, shuffle=False),
            rank,
            world_size,
            -(-counts[rank] // spec.batch_size),
        ):
            shard_ids.update(ids.tolist())
        taken = stream_ids(reader_name, dataset, spec, rank, world_size, EPOCHS * steps)
        for epoch in range(EPOCHS):
            seen = collections.Counter(np.concatenate(taken[epoch * steps : (epoch + 1) * steps]).tolist())
            assert set(seen) <= shard_ids
            histogram = collections.Counter(seen.values())
            histogram[0] = len(shard_ids - set(seen))
            histogram = {times: rows for times, rows in histogram.items() if rows}
            got.append((epoch, rank, histogram))
            want.append((epoch, rank, expected_counts(len(shard_ids), steps * spec.batch_size)))
    return got, want


def dataclasses_replace(spec, **changes):
    import dataclasses

    return dataclasses.replace(spec, **changes)


@pytest.mark.parametrize("reader_name", READERS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("seed", [0, 7])
def test_a_shuffled_epoch_takes_each_row_once_but_the_remainder(tmp_path, reader_name, layout, world_size, seed):
    dataset = inspect_dataset(write_rows(str(tmp_path / "rows"), LAYOUTS[layout]), ["id"], "label")
    spec = DataSpec(batch_size=BATCH, seed=seed, shuffle=True)
    got, want = epoch_figures(reader_name, dataset, spec, world_size)
    assert got == want


@pytest.mark.parametrize(
    "options",
    [
        dict(shuffle=False),
        dict(holdout=0.2),
        dict(filters=[("id", "<", 1100)]),
        dict(shuffle_buffer_batches=1),
        dict(shuffle_buffer_batches=40),
    ],
    ids=["ordered", "holdout", "filters", "buffer-1", "buffer-40"],
)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_rule_holds_ordered_with_hold_out_filters_and_any_buffer(tmp_path, options, world_size):
    filters = options.get("filters")
    dataset = inspect_dataset(write_rows(str(tmp_path / "rows"), LAYOUTS["unequal"]), ["id"], "label", filters=filters)
    spec = DataSpec(batch_size=16, seed=3, **options)
    got, want = epoch_figures("arrow", dataset, spec, world_size)
    assert got == want


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_position_replay_is_the_real_stream_over_several_epochs(tmp_path, world_size):
    """Elastic resume replays the stream with positions only: it must cut the same batches
    across pass and epoch boundaries (ids are positions in these files)."""
    dataset = inspect_dataset(write_rows(str(tmp_path / "rows"), LAYOUTS["unequal"]), ["id"], "label")
    spec = DataSpec(batch_size=BATCH, seed=5)
    steps = steps_per_epoch(sum(shard_rows(dataset, world_size)), BATCH, world_size)
    for rank in range(world_size):
        real = [ids.tolist() for ids in stream_ids("arrow", dataset, spec, rank, world_size, 4 * steps)]
        replay = [b.tolist() for b in reshard.stream_positions(dataset, spec, rank, world_size, 0, 4 * steps)]
        assert replay == real
        told = reshard.stream_positions(dataset, spec, rank, world_size, steps, 3 * steps, epoch_rows=steps * BATCH)
        assert [b.tolist() for b in told] == real[steps : 3 * steps]


@pytest.mark.parametrize(
    "shard, chunk, batch, steps, buffer",
    [(5, 2, 8, 2, 2), (3, 3, 4, 5, 1), (100, 10, 4, 8, 3), (97, 13, 5, 9, 4), (40, 7, 8, 5, 2), (41, 41, 8, 5, 8)],
    ids=[
        "pass-shorter-than-a-batch",
        "tiny-shard",
        "shard-over-3-epochs",
        "odd-sizes",
        "shard-equals-epoch",
        "one-row-group",
    ],
)
def test_the_rule_holds_for_any_shard_and_epoch_size(shard, chunk, batch, steps, buffer):
    """The stream alone (position-only chunks, as an elastic replay cuts them): passes shorter
    than a batch, shards several epochs long, an epoch exactly one shard."""
    from sparkdl.data.batching import cut_stream
    from sparkdl.data.inputs import POSITION_KEY
    from sparkdl.data.readers.base import PASS_END

    def source():
        for pass_index in itertools.count():
            starts = list(range(0, shard, chunk))
            np.random.default_rng(pass_index).shuffle(starts)
            for start in starts:
                yield {POSITION_KEY: np.arange(start, min(start + chunk, shard))}
            yield PASS_END

    epochs = 6
    spec = DataSpec(batch_size=batch, seed=2, shuffle_buffer_batches=buffer)
    cuts = list(itertools.islice(cut_stream(source(), spec, 0, steps * batch), epochs * steps))
    assert all(len(b[POSITION_KEY]) == batch for b in cuts)
    for epoch in range(epochs):
        seen = collections.Counter(
            np.concatenate([b[POSITION_KEY] for b in cuts[epoch * steps : (epoch + 1) * steps]]).tolist()
        )
        histogram = collections.Counter(seen.values())
        histogram[0] = shard - len(seen)
        assert {t: n for t, n in histogram.items() if n} == expected_counts(shard, steps * batch), epoch
