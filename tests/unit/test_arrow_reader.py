"""Both readers without Spark: identical batches, sharding, seeding, columns, filters, transforms,
the validation hold-out, and URLs through fsspec."""

from __future__ import annotations

import itertools
import os
import threading
from typing import List, Tuple

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from sparkdl._runtime.validation import validation_source
from sparkdl.data import selection
from sparkdl.data.batching import batches, validation_batches
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers import reader_from_name
from sparkdl.data.readers.arrow import ArrowReader
from sparkdl.data.readers.petastorm import PetastormReader
from sparkdl.data.selection import holdout_mask, shard_rows
from sparkdl.data.spec import DataSpec, ValidationSpec
from sparkdl.errors import ConfigError, DataError
from tests.models import pairs

READERS = [pytest.param("petastorm", marks=pytest.mark.petastorm), "arrow"]
UNEVEN = [[300, 40, 17, 5], [100], [64, 64]]  # 7 row groups, 590 rows


def write_ids(path, row_groups_per_file, filesystem=None) -> str:
    """Files whose rows carry their id: ``id`` (double), ``vec`` = [id, 2*id] (list<float>),
    ``label`` = id % 3, ``group`` = id // 100, and an unused string column ``note``."""
    next_id = 0
    if filesystem is None:
        os.makedirs(path, exist_ok=True)
    for index, sizes in enumerate(row_groups_per_file):
        tables = []
        for size in sizes:
            ids = np.arange(next_id, next_id + size)
            next_id += size
            tables.append(
                pa.table(
                    {
                        "id": ids.astype(np.float64),
                        "vec": pa.array(
                            list(np.stack([ids, ids * 2], 1).astype(np.float32)), type=pa.list_(pa.float32())
                        ),
                        "label": (ids % 3).astype(np.int64),
                        "group": (ids // 100).astype(np.int32),
                        "note": [f"row {i}" for i in ids],
                    }
                )
            )
        target = f"{path}/part-{index}.parquet"
        sink = filesystem.open(target, "wb") if filesystem is not None else target
        with pq.ParquetWriter(sink, tables[0].schema) as writer:
            for table in tables:
                writer.write_table(table)  # one row group per write
        if filesystem is not None:
            sink.close()
    return str(path)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return write_ids(tmp_path_factory.mktemp("uneven"), UNEVEN)


def ids_of(chunks) -> List[int]:
    return [int(i) for features, _ in chunks for i in features[:, 0]]


def one_pass(reader_name, info, spec, rank, world_size, pass_index=0):
    return pairs(reader_from_name(reader_name).read_pass(info, spec, rank, world_size, pass_index))


CONFIGS = {
    "shuffled": dict(),
    "unshuffled": dict(shuffle=False),
    "holdout-train": dict(holdout=0.25),
    "holdout-part": dict(holdout=0.25, part="holdout"),
    "dnf-filter": dict(filters=[("id", "<", 400), ("label", "!=", 1)]),
    "expression-filter": dict(filters=(pc.field("group") >= 2) | (pc.field("id") < 30)),
}


@pytest.mark.petastorm
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_both_readers_give_identical_batches_for_the_same_shard_and_seed(uneven, config, world_size):
    """The acceptance test of the Arrow reader: same rows, same order, same batches, over several
    passes, for row-group sharding (1-3 ranks) and the row-striding fallback (8 ranks > 7 groups)."""
    kwargs = CONFIGS[config]
    info = inspect_dataset(uneven, ["id", "vec"], "label", filters=kwargs.get("filters"))
    spec = DataSpec(batch_size=16, seed=11, shuffle_buffer_batches=2, **kwargs)
    for rank in sorted({0, world_size - 1}):
        streams = {}
        for name in ("petastorm", "arrow"):
            stream = batches(reader_from_name(name), info, spec, rank, world_size)
            streams[name] = list(itertools.islice(stream, 60))  # several passes over the shard
            stream.close()
        for (fa, la), (fb, lb) in zip(streams["petastorm"], streams["arrow"]):
            np.testing.assert_array_equal(fa, fb)
            np.testing.assert_array_equal(la, lb)
            assert fa.dtype == fb.dtype == np.float32 and la.dtype == lb.dtype == np.int64
        assert len(streams["arrow"]) == 60


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_one_pass_per_rank_partitions_the_rows_by_row_group_or_stride(uneven, world_size):
    info = inspect_dataset(uneven, ["id"], "label")
    spec = DataSpec(batch_size=4, seed=0)
    starts = np.concatenate([[0], np.cumsum(info.row_group_rows)])
    seen = []
    for rank in range(world_size):
        ids = ids_of(one_pass("arrow", info, spec, rank, world_size))
        if world_size <= info.num_row_groups:
            groups = [g for g in range(info.num_row_groups) if g % world_size == rank]
            expected = set(i for g in groups for i in range(starts[g], starts[g + 1]))
        else:  # striding: every rank reads every row group, keeps positions p % n == rank
            expected = set(range(rank, 590, world_size))
        assert set(ids) == expected and len(ids) == len(expected)
        seen.append(set(ids))
    assert set().union(*seen) == set(range(590))


def test_every_pass_is_freshly_seeded_and_reproducible(uneven):
    info = inspect_dataset(uneven, ["id"], "label")
    spec = DataSpec(batch_size=4, seed=5)
    first = ids_of(one_pass("arrow", info, spec, 0, 2, pass_index=0))
    again = ids_of(one_pass("arrow", info, spec, 0, 2, pass_index=0))
    second = ids_of(one_pass("arrow", info, spec, 0, 2, pass_index=1))
    assert first == again
    assert sorted(first) == sorted(second) and first != second  # same shard, new row-group order
    other_seed = ids_of(one_pass("arrow", info, DataSpec(batch_size=4, seed=6), 0, 2))
    assert sorted(other_seed) == sorted(first)
    unshuffled = ids_of(one_pass("arrow", info, DataSpec(batch_size=4, shuffle=False), 0, 2))
    assert unshuffled == sorted(unshuffled)  # file order without shuffling


def _record_reads(monkeypatch) -> Tuple[List[tuple], threading.Condition]:
    """(the (file, row group) reads so far, a condition notified at each one): the reading
    thread's progress as events a test can wait on."""
    reads: List[tuple] = []
    read = threading.Condition()
    original = selection.OpenFiles.read

    def recording(self, index, row_group, columns):
        table = original(self, index, row_group, columns)
        with read:
            reads.append((index, row_group))
            read.notify_all()
        return table

    monkeypatch.setattr(selection.OpenFiles, "read", recording)
    return reads, read


@pytest.mark.parametrize("ahead", [1, 3])
def test_arrow_reader_prefetches_a_bounded_number_of_row_groups(uneven, monkeypatch, ahead):
    """While the consumer holds the first row group, the next ``prefetch_row_groups`` are read in
    the background (waited for as events), and no more: not the whole shard."""
    info = inspect_dataset(uneven, ["id"], "label")
    assert info.num_row_groups == 7 > 1 + ahead
    reads, read = _record_reads(monkeypatch)
    stream = ArrowReader().read_pass(info, DataSpec(batch_size=4, shuffle=False, prefetch_row_groups=ahead), 0, 1, 0)
    try:
        first = next(stream)
        assert ids_of(pairs(iter([first])))[:3] == [0, 1, 2]
        # Read ahead while the consumer still holds the first row group (no next() yet).
        with read:
            assert read.wait_for(lambda: len(reads) >= 1 + ahead, timeout=10.0), (
                f"prefetch_row_groups={ahead}: only {len(reads) - 1} row group(s) were read ahead of the consumer"
            )
            # And no further: an absence has no event to wait on, so it gets a bounded window. A
            # local row group reads in milliseconds; a reader that does not stop would show here
            # (a loaded machine can only hide an over-read, never fail a correct reader).
            assert not read.wait_for(lambda: len(reads) > 1 + ahead, timeout=0.5), reads
    finally:
        stream.close()  # cancels what was not started and waits for the reading thread
    # The reads are the pass's next row groups, and bounded: the consumer took one, the threads
    # read ``ahead`` more (several decode threads may finish them in any order).
    assert sorted(reads) == [(0, 0), (0, 1), (0, 2), (0, 3)][: 1 + ahead]


def test_arrow_reader_reads_the_next_pass_ahead_while_the_last_row_group_of_this_one_is_consumed(uneven, monkeypatch):
    """Across a pass boundary (an epoch's start) the read-ahead goes on: while the consumer holds
    the last row group of pass 0, the first ones of pass 1 are read (waited for as events); and
    the chunks are still pass 0's rows, then pass 1's."""
    info = inspect_dataset(uneven, ["id"], "label")
    groups = info.num_row_groups
    reads, read = _record_reads(monkeypatch)
    spec = DataSpec(batch_size=4, shuffle=False, prefetch_row_groups=2)
    one_pass = ids_of(pairs(ArrowReader().read_pass(info, spec, 0, 1, 0)))
    reads.clear()
    stream = ArrowReader().chunks(info, spec, 0, 1)
    try:
        taken = [next(stream) for _ in range(groups)]  # the whole of pass 0, the last one held
        with read:
            assert read.wait_for(lambda: len(reads) >= groups + 2, timeout=10.0), (
                f"only {len(reads) - groups} row group(s) of pass 1 were read while pass 0's last was held"
            )
        taken += [next(stream) for _ in range(groups)]
    finally:
        stream.close()
    assert ids_of(pairs(iter(taken))) == one_pass + one_pass  # unshuffled: pass 1 repeats pass 0


@pytest.mark.parametrize("reader_name", READERS)
def test_only_the_needed_columns_are_read(uneven, reader_name, monkeypatch):
    info = inspect_dataset(uneven, ["vec"], "label")
    requested = []
    if reader_name == "arrow":
        original = selection.OpenFiles.read

        def recording(self, index, row_group, columns):
            requested.append(sorted(columns))
            return original(self, index, row_group, columns)

        monkeypatch.setattr(selection.OpenFiles, "read", recording)
    else:
        import petastorm

        original = petastorm.make_batch_reader

        def recording(url, schema_fields, **kwargs):
            requested.append(sorted(schema_fields))
            return original(url, schema_fields=schema_fields, **kwargs)

        monkeypatch.setattr(petastorm, "make_batch_reader", recording)
    chunks = one_pass(reader_name, info, DataSpec(batch_size=8), 0, 1)
    assert sum(len(f) for f, _ in chunks) == 590
    assert requested and all(cols == ["label", "vec"] for cols in requested)


@pytest.mark.parametrize("reader_name", READERS)
@pytest.mark.parametrize(
    "filters, keep",
    [
        ([("id", ">=", 500)], lambda i: i >= 500),
        (
            [[("label", "==", 0), ("id", "<", 100)], [("group", "==", 4)]],
            lambda i: (i % 3 == 0 and i < 100) or i // 100 == 4,
        ),
        (pc.field("note").isin(["row 7", "row 589"]), lambda i: i in (7, 589)),
    ],
)
def test_filters_keep_exactly_the_matching_rows(uneven, reader_name, filters, keep):
    info = inspect_dataset(uneven, ["vec"], "label", filters=filters)
    ids = []
    for rank in range(2):
        chunks = one_pass(reader_name, info, DataSpec(batch_size=8, filters=filters), rank, 2)
        ids += [int(v) for f, _ in chunks for v in f[:, 0]]
    assert sorted(ids) == [i for i in range(590) if keep(i)]
    assert sum(shard_rows(info, 2, filters=filters)) == len(ids)


def test_row_groups_ruled_out_by_statistics_are_not_read(uneven, monkeypatch):
    filters = [("id", ">=", 560)]  # only in the last row group (ids 526..589)
    info = inspect_dataset(uneven, ["id"], "label", filters=filters)
    reads = []
    original = selection.OpenFiles.read

    def recording(self, index, row_group, columns):
        reads.append((index, row_group))
        return original(self, index, row_group, columns)

    monkeypatch.setattr(selection.OpenFiles, "read", recording)
    ids = ids_of(one_pass("arrow", info, DataSpec(batch_size=8, filters=filters), 0, 1))
    assert ids == list(range(560, 590))
    assert reads == [(2, 1)]


def test_a_filter_on_an_unknown_column_fails_on_the_driver(uneven):
    with pytest.raises(
        DataError, match="filters .*cannot be applied to dataset .*columns: id, vec, label, group, note"
    ):
        inspect_dataset(uneven, ["id"], "label", filters=[("price", ">", 3)])
    with pytest.raises(DataError, match="neither a pyarrow.compute expression nor pyarrow's DNF form"):
        inspect_dataset(uneven, ["id"], "label", filters="id > 3")


def test_transform_fn_runs_on_every_batch_with_numpy_in_and_out(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    calls = []

    def scale(features, labels):
        calls.append((features.shape, features.dtype, labels.dtype))
        return features * 10, labels + 100

    spec = DataSpec(batch_size=16, seed=1, transform_fn=scale)
    plain = list(itertools.islice(batches(ArrowReader(), info, DataSpec(batch_size=16, seed=1), 0, 1), 5))
    transformed = list(itertools.islice(batches(ArrowReader(), info, spec, 0, 1), 5))
    for (f0, l0), (f1, l1) in zip(plain, transformed):
        np.testing.assert_array_equal(f1, f0 * 10)
        np.testing.assert_array_equal(l1, l0 + 100)
    assert calls[0] == ((16, 3), np.float32, np.int64)


@pytest.mark.parametrize(
    "transform_fn, message",
    [
        (lambda f, y: f, "must return a \\(features, labels\\) tuple"),
        (lambda f, y: (f[:3], y[:3]), "must keep the batch's 16 rows, returned 3 features and 3 labels"),
        (lambda f, y: (f.tolist(), y), "must return numpy arrays, got \\(list, ndarray\\)"),
    ],
)
def test_a_bad_transform_fn_is_named(uneven, transform_fn, message):
    info = inspect_dataset(uneven, ["id"], "label")
    stream = batches(ArrowReader(), info, DataSpec(batch_size=16, transform_fn=transform_fn), 0, 1)
    with pytest.raises(ConfigError, match=message):
        next(stream)
    stream.close()


def test_holdout_split_is_disjoint_complete_and_independent_of_seed_and_workers(uneven):
    info = inspect_dataset(uneven, ["id"], "label")

    def rows(part, world_size, seed):
        spec = DataSpec(batch_size=8, seed=seed, holdout=0.2, part=part)
        return sorted(i for rank in range(world_size) for i in ids_of(one_pass("arrow", info, spec, rank, world_size)))

    held = rows("holdout", 2, seed=0)
    train = rows("train", 2, seed=0)
    assert not set(held) & set(train) and sorted(held + train) == list(range(590))
    assert 0.15 * 590 < len(held) < 0.25 * 590
    assert rows("holdout", 3, seed=9) == held and rows("holdout", 8, seed=1) == held
    # Spread over the dataset, not a block at one end.
    assert min(held) < 100 and max(held) > 490
    assert sum(shard_rows(info, 2, holdout=0.2, part="holdout")) == len(held)
    assert sum(shard_rows(info, 3, holdout=0.2, part="train")) == len(train)
    np.testing.assert_array_equal(holdout_mask(np.array(held), 0.2), True)


def test_validation_batches_are_one_unshuffled_pass_with_a_smaller_last_batch(uneven):
    info = inspect_dataset(uneven, ["id"], "label")
    spec = DataSpec(batch_size=32, seed=3, holdout=0.3, validation=ValidationSpec())
    dataset, val_spec = validation_source(info, spec)
    assert val_spec.part == "holdout" and not val_spec.shuffle
    out = list(validation_batches(ArrowReader(), dataset, val_spec, 0, 1))
    ids = [int(i) for f, _ in out for i in f[:, 0]]
    assert ids == sorted(ids) and len(ids) == sum(shard_rows(info, 1, holdout=0.3, part="holdout"))
    assert [len(f) for f, _ in out[:-1]] == [32] * (len(out) - 1) and 0 < len(out[-1][0]) <= 32


@pytest.mark.parametrize("reader_name", READERS)
def test_urls_through_fsspec_memory_filesystem(reader_name):
    fs = fsspec.filesystem("memory")
    root = f"memory://sparkdl-test-{reader_name}/data"
    write_ids(root, [[50, 50], [30]], filesystem=fs)
    info = inspect_dataset(root, ["vec"], "label")
    assert [f.url for f in info.files] == [f"{root}/part-0.parquet", f"{root}/part-1.parquet"]
    assert info.num_rows == 130 and info.num_row_groups == 3
    chunks = one_pass(reader_name, info, DataSpec(batch_size=8, shuffle=False), 0, 1)
    np.testing.assert_array_equal(np.concatenate([f for f, _ in chunks])[:, 1], np.arange(130) * 2)


@pytest.mark.parametrize("reader_name", READERS)
def test_local_files_through_an_fsspec_url(tmp_path, reader_name):
    """``local://`` is fsspec's local filesystem (pyarrow does not know the scheme)."""
    write_ids(tmp_path / "d", [[40, 40]])
    info = inspect_dataset(f"local://{tmp_path}/d", ["id"], "label")
    assert info.files[0].url == f"local://{tmp_path}/d/part-0.parquet"
    chunks = one_pass(reader_name, info, DataSpec(batch_size=8, shuffle=False), 1, 2)
    assert ids_of(chunks) == list(range(40, 80))


@pytest.mark.petastorm
def test_reader_registry_names_both_readers():
    assert isinstance(reader_from_name("arrow"), ArrowReader)
    assert isinstance(reader_from_name("petastorm"), PetastormReader)
    with pytest.raises(ConfigError, match="reader='parquet' is unknown; valid: arrow, petastorm"):
        reader_from_name("parquet")
