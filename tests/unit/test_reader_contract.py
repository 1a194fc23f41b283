"""The reader contract: what every :class:`~sparkdl.data.readers.base.DataReader` must do.

Each test runs once per reader in :data:`READERS`; a new reader joins by adding its name there.
The expectations come from the shared selection rules (:mod:`sparkdl.data.selection`) and from
the files themselves (read here with plain pyarrow), never from another reader, so a reader that
passes reads the same rows, in the same order, as the rules say. The data: several Parquet files
of uneven row groups (an empty one, a one-row one, a file with none) whose ``id`` is unique per
row and unrelated to the row's position, so every exactly-once and position property is checked
by id.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import urllib.parse
from typing import Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from sparkdl.data.dataset import DatasetInfo, inspect_dataset
from sparkdl.data.inputs import LABEL_KEY, POSITION_KEY, Image
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers import chunk_rows, reader_from_name
from sparkdl.data.selection import holdout_mask, pass_row_groups, shard_rows
from sparkdl.data.spec import DataSpec
from sparkdl.errors import DataError

#: The readers held to the contract. A new reader joins by adding its name here.
READERS = ["arrow", pytest.param("petastorm", marks=pytest.mark.petastorm)]

#: Row-group sizes per file: 8 row groups, 164 rows (an empty row group, a one-row one, and a
#: file without row groups).
ROW_GROUPS = [[50, 7, 23], [31, 0], [], [12, 1, 40]]
NUM_ROWS = sum(map(sum, ROW_GROUPS))
NUM_ROW_GROUPS = sum(map(len, ROW_GROUPS))
#: 1-3 ranks share row groups; 9 ranks (more than the row groups) fall back to row striding.
WORLD_SIZES = [1, 2, 3, NUM_ROW_GROUPS + 1]
#: Every row's ``bucket`` is ``position // BUCKET``: sorted, so filters on it skip row groups.
BUCKET = 20

#: Model inputs read by most tests: the id as int64, the feature as float32, the label.
NAMED = InputPlan.from_inputs({"id": "id", "x": "x"}, "label")
#: With an (undecoded) image input the plan is expensive, and chunks carry each row's position.
POSITIONED = InputPlan.from_inputs({"id": "id", "blob": Image("blob", size=(1, 1))}, "label")

#: A DNF filter (an OR of ANDs) and an expression; both read a column that is not an input.
DNF = [[("label", "==", 1), ("x", "<", 125000.0)], [("bucket", ">=", 7)]]
EXPRESSION = (pc.field("bucket") >= 3) & (pc.field("bucket") < 5) & (pc.field("label") != 0)
#: The same filters on the columns of :func:`by_position`, to compute the expectations.
MATCHES = {
    "dnf": lambda c: ((c["label"] == 1) & (c["x"] < 125000.0)) | (c["bucket"] >= 7),
    "expression": lambda c: (c["bucket"] >= 3) & (c["bucket"] < 5) & (c["label"] != 0),
}
FILTERS = {"dnf": DNF, "expression": EXPRESSION}


@pytest.fixture(params=READERS)
def reader_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    """Files ``part-<i>.parquet`` of :data:`ROW_GROUPS`: ``id`` (int64, unique, shuffled),
    ``x = id / 4`` (float64), ``label = id % 3`` (int64), ``blob = b"<id>"`` (binary) and
    ``bucket = position // BUCKET`` (int32, used only by filters)."""
    root = tmp_path_factory.mktemp("reader-contract")
    ids = np.random.default_rng(0).choice(1_000_000, size=NUM_ROWS, replace=False).astype(np.int64)
    schema = pa.schema(
        [("id", pa.int64()), ("x", pa.float64()), ("label", pa.int64()), ("blob", pa.binary()), ("bucket", pa.int32())]
    )
    position = 0
    for index, sizes in enumerate(ROW_GROUPS):
        with pq.ParquetWriter(str(root / f"part-{index}.parquet"), schema) as writer:
            for size in sizes:
                rows = ids[position : position + size]
                positions = np.arange(position, position + size)
                columns = {
                    "id": rows,
                    "x": rows / 4.0,
                    "label": rows % 3,
                    "blob": [b"%d" % i for i in rows],
                    "bucket": positions // BUCKET,
                }
                writer.write_table(pa.table(columns, schema=schema))  # one row group per write, empty ones included
                position += size
    return str(root)


def by_position(info: DatasetInfo) -> Dict[str, np.ndarray]:
    """Every column of the dataset's files in ``info.files`` order: index ``p`` is the row at
    position ``p``. Read with plain pyarrow, and checked against the row counts ``info`` has."""
    tables = []
    for file in info.files:
        handle = pq.ParquetFile(urllib.parse.urlparse(file.url).path)
        assert (
            tuple(handle.metadata.row_group(g).num_rows for g in range(handle.metadata.num_row_groups))
            == file.row_groups
        )
        tables.append(handle.read())
    table = pa.concat_tables(tables)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def read(
    reader_name: str, info: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int = 0
) -> List[Dict[str, np.ndarray]]:
    """One whole pass of a rank, checking that every chunk is what ``InputPlan.extract`` makes:
    the plan's keys, non-empty, row-aligned (each row's columns are that row's)."""
    with contextlib.closing(
        reader_from_name(reader_name).read_pass(info, spec, rank, world_size, pass_index)
    ) as stream:
        chunks = list(stream)
    keys = {"id", LABEL_KEY} | ({"x"} if info.plan is NAMED else {"blob", POSITION_KEY})
    for chunk in chunks:
        assert set(chunk) == keys
        rows = chunk_rows(chunk)
        assert rows > 0 and all(len(values) == rows for values in chunk.values())
        ids = chunk["id"]
        assert ids.dtype == np.int64 and chunk[LABEL_KEY].dtype == np.int64
        np.testing.assert_array_equal(chunk[LABEL_KEY], ids % 3)
        if "x" in chunk:
            assert chunk["x"].dtype == np.float32
            np.testing.assert_array_equal(chunk["x"], (ids / 4.0).astype(np.float32))
    return chunks


def ids_read(chunks) -> List[int]:
    return [int(i) for chunk in chunks for i in chunk["id"]]


def expected_positions(
    info: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int = 0, keep=None
) -> np.ndarray:
    """The positions rank ``rank`` reads in one pass, in reading order, by the selection rules:
    its row groups in :func:`pass_row_groups` order, each row group's rows in file order; with
    more ranks than row groups, the rows whose position is ``rank`` modulo the world size.
    ``keep`` (a mask by position) stands for the filter and hold-out."""
    rows = info.row_group_rows
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    order = pass_row_groups(info.num_row_groups, rank, world_size, spec.seed + pass_index, spec.shuffle)
    positions = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in order] + [np.zeros(0, np.int64)])
    if info.num_row_groups < world_size:
        positions = positions[positions % world_size == rank]
    if keep is not None:
        positions = positions[keep[positions]]
    return positions


def assert_exactly_once(per_rank: List[List[int]], expected_ids) -> None:
    everything = [i for ids in per_rank for i in ids]
    duplicated = [i for i, n in collections.Counter(everything).items() if n > 1]
    assert not duplicated, f"rows read more than once in a pass: {duplicated[:10]}"
    assert sorted(everything) == sorted(int(i) for i in expected_ids)


def test_the_dataset_is_what_the_contract_assumes(path):
    info = inspect_dataset(path, NAMED)
    assert (info.num_rows, info.num_row_groups) == (NUM_ROWS, NUM_ROW_GROUPS)
    assert info.row_group_rows == [n for sizes in ROW_GROUPS for n in sizes] and 0 in info.row_group_rows
    assert () in [file.row_groups for file in info.files]
    assert NUM_ROW_GROUPS < WORLD_SIZES[-1]
    columns = by_position(info)
    assert len(set(columns["id"].tolist())) == NUM_ROWS
    assert not np.array_equal(np.sort(columns["id"]), columns["id"])  # ids say nothing of positions


# ---- 1. one pass: every row exactly once, each rank its row groups --------------------------


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "unshuffled"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_pass_reads_every_row_exactly_once_each_rank_its_row_groups_in_order(
    path, reader_name, world_size, shuffle
):
    info = inspect_dataset(path, NAMED)
    ids = by_position(info)["id"]
    spec = DataSpec(batch_size=8, seed=4, shuffle=shuffle)
    per_rank = []
    for rank in range(world_size):
        got = ids_read(read(reader_name, info, spec, rank, world_size))
        assert got == ids[expected_positions(info, spec, rank, world_size)].tolist(), f"rank {rank} of {world_size}"
        assert len(got) == shard_rows(info, world_size)[rank]  # what the driver counts steps from
        per_rank.append(got)
    assert_exactly_once(per_rank, ids)


# ---- 2. deterministic passes ----------------------------------------------------------------


@pytest.mark.parametrize("world_size, rank", [(1, 0), (2, 1), (WORLD_SIZES[-1], 4)])
def test_a_pass_is_a_function_of_seed_rank_and_pass_index(path, reader_name, world_size, rank):
    info = inspect_dataset(path, NAMED)
    spec = DataSpec(batch_size=8, seed=7)
    first = read(reader_name, info, spec, rank, world_size, pass_index=3)
    again = read(reader_name, info, spec, rank, world_size, pass_index=3)
    assert len(first) == len(again)
    for a, b in zip(first, again):
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # Another pass (or seed) shuffles the row groups anew: the same rows in another order.
    orders = [pass_row_groups(info.num_row_groups, rank, world_size, seed, True) for seed in (7 + 3, 7 + 4, 8 + 3)]
    assert orders[0] != orders[1] and orders[0] != orders[2]  # the rules do reorder these passes
    other_pass = ids_read(read(reader_name, info, spec, rank, world_size, pass_index=4))
    other_seed = ids_read(read(reader_name, info, DataSpec(batch_size=8, seed=8), rank, world_size, pass_index=3))
    assert other_pass != ids_read(first) and sorted(other_pass) == sorted(ids_read(first))
    assert other_seed != ids_read(first) and sorted(other_seed) == sorted(ids_read(first))
    # Without shuffling every pass reads the same rows in the same order.
    unshuffled = DataSpec(batch_size=8, seed=7, shuffle=False)
    unshuffled_passes = [ids_read(read(reader_name, info, unshuffled, rank, world_size, p)) for p in (0, 5)]
    assert unshuffled_passes[0] == unshuffled_passes[1]


def test_chunks_is_pass_0_then_pass_1_then_pass_2(path, reader_name):
    info = inspect_dataset(path, NAMED)
    spec = DataSpec(batch_size=8, seed=6)
    passes = [ids_read(read(reader_name, info, spec, 1, 2, pass_index)) for pass_index in range(3)]
    assert passes[0] != passes[1] != passes[2]  # shuffled anew: a stream of pass 0 again would show
    wanted = sum(map(len, passes))
    got: List[int] = []
    with contextlib.closing(reader_from_name(reader_name).chunks(info, spec, 1, 2)) as stream:
        for chunk in stream:
            got += chunk["id"].tolist()
            if len(got) >= wanted:
                break
    assert got[:wanted] == passes[0] + passes[1] + passes[2]


# ---- 3. filters -----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, WORLD_SIZES[-1]])
@pytest.mark.parametrize("form", sorted(FILTERS))
def test_filters_keep_only_matching_rows_each_exactly_once(path, reader_name, form, world_size):
    filters = FILTERS[form]
    info = inspect_dataset(path, NAMED, filters=filters)
    columns = by_position(info)
    matching = MATCHES[form](columns)
    assert 0 < matching.sum() < NUM_ROWS
    spec = DataSpec(batch_size=8, seed=2, filters=filters)
    per_rank = []
    for rank in range(world_size):
        got = ids_read(read(reader_name, info, spec, rank, world_size))
        # The rank's unfiltered rows, in their order, less the ones the filter rejects.
        assert got == columns["id"][expected_positions(info, spec, rank, world_size, keep=matching)].tolist(), (
            f"rank {rank}"
        )
        assert len(got) == shard_rows(info, world_size, filters=filters)[rank]
        per_rank.append(got)
    assert_exactly_once(per_rank, columns["id"][matching])


# ---- 4. the validation hold-out -------------------------------------------------------------


def test_the_holdout_and_training_parts_partition_the_rows_whatever_the_seed(path, reader_name):
    info = inspect_dataset(path, NAMED)
    ids = by_position(info)["id"]
    held = holdout_mask(np.arange(NUM_ROWS), 0.3)
    assert 0.15 * NUM_ROWS < held.sum() < 0.45 * NUM_ROWS

    def part(name, world_size, seed):
        spec = DataSpec(batch_size=8, seed=seed, holdout=0.3, part=name)
        per_rank = []
        for rank in range(world_size):
            got = ids_read(read(reader_name, info, spec, rank, world_size))
            keep = held if name == "holdout" else ~held
            assert got == ids[expected_positions(info, spec, rank, world_size, keep=keep)].tolist(), (
                f"{name}, rank {rank} of {world_size}"
            )
            assert len(got) == shard_rows(info, world_size, 0.3, name)[rank]
            per_rank.append(got)
        assert_exactly_once(per_rank, ids[held if name == "holdout" else ~held])
        return sorted(i for ids_ in per_rank for i in ids_)

    holdout, train = part("holdout", 2, seed=0), part("train", 2, seed=0)
    assert not set(holdout) & set(train) and sorted(holdout + train) == sorted(ids.tolist())
    # The hold-out is a function of the rows' positions only: not of the seed or the ranks.
    assert part("holdout", 2, seed=5) == holdout
    assert part("holdout", WORLD_SIZES[-1], seed=9) == holdout and part("train", 3, seed=9) == train


# ---- 5. positions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_size, options",
    [
        (2, {}),
        (WORLD_SIZES[-1], {}),
        (3, {"holdout": 0.3, "filters": EXPRESSION}),
        (1, {"holdout": 0.3, "part": "holdout", "filters": DNF}),
    ],
    ids=["row-groups", "striding", "filtered-train", "filtered-holdout"],
)
def test_every_row_comes_with_its_position_in_the_dataset(path, reader_name, world_size, options):
    """An expensive plan (one that decodes per row) gets each row's position with it, so that a
    row failing after the shuffle can be named; the position is the row's index in the dataset."""
    info = inspect_dataset(path, POSITIONED, filters=options.get("filters"))
    columns = by_position(info)
    spec = DataSpec(batch_size=8, seed=1, **options)
    rows = 0
    for rank in range(world_size):
        chunks = read(reader_name, info, spec, rank, world_size)
        for chunk in chunks:
            positions = chunk[POSITION_KEY]
            assert positions.dtype.kind == "i"
            np.testing.assert_array_equal(columns["id"][positions], chunk["id"])
            assert [bytes(b) for b in chunk["blob"]] == [b"%d" % i for i in chunk["id"]]
        rows += sum(chunk_rows(c) for c in chunks)
    assert rows == sum(shard_rows(info, world_size, spec.holdout, spec.part, spec.filters)) > 0


# ---- 6. closing early -----------------------------------------------------------------------


def _files_open_under(directory: str) -> List[str]:
    """The dataset files this process holds open. Counting every fd of the process would also count
    sockets and pipes that the Spark session of earlier tests opens and closes in the background."""
    root = os.path.realpath(directory)
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith(root + os.sep):
            held.append(target)
    return sorted(held)


@pytest.mark.parametrize("method", ["read_pass", "chunks"])
def test_closing_after_one_chunk_releases_threads_and_files(path, reader_name, method):
    info = inspect_dataset(path, NAMED)
    spec = DataSpec(batch_size=8, seed=3, prefetch_row_groups=3)
    reader = reader_from_name(reader_name)
    read(reader_name, info, spec, 0, 1)  # imports and one-off pools before the baseline
    threads = set(threading.enumerate())
    files = _files_open_under(path) if os.path.isdir("/proc/self/fd") else None
    stream = reader.read_pass(info, spec, 0, 1, 0) if method == "read_pass" else reader.chunks(info, spec, 0, 1)
    assert chunk_rows(next(stream)) > 0
    stream.close()
    started = [t for t in threading.enumerate() if t not in threads]
    for thread in started:
        thread.join(timeout=10)  # a bounded wait for threads told to stop
    assert not [t.name for t in started if t.is_alive()], "threads left running after close()"
    if files is not None:
        assert _files_open_under(path) == files, "dataset files left open after close()"


# ---- 7. check() and empty shards ------------------------------------------------------------


def test_check_accepts_a_dense_plan(path, reader_name):
    reader = reader_from_name(reader_name)
    assert reader.check(inspect_dataset(path, ["x", "id"], "label")) is None
    assert reader.check(inspect_dataset(path, NAMED)) is None


@contextlib.contextmanager
def _fails_within(seconds: float):
    """Turns a stream that never yields (endless empty passes) into a failure, not a hang."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise AssertionError(f"no chunk and no error within {seconds} s: chunks() spins on an empty shard")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_chunks_fails_naming_the_rank_whose_shard_yields_no_rows(path, reader_name):
    filters = [("bucket", "<", 2)]  # positions 0..39: all in row group 0, which is rank 0's
    info = inspect_dataset(path, NAMED, filters=filters)
    assert shard_rows(info, 2, filters=filters) == [2 * BUCKET, 0]
    spec = DataSpec(batch_size=8, filters=filters)
    reader = reader_from_name(reader_name)
    with contextlib.closing(reader.chunks(info, spec, 0, 2)) as stream:
        chunk = next(stream)
        assert set(chunk["id"].tolist()) <= set(by_position(info)["id"][: 2 * BUCKET].tolist())
    with contextlib.closing(reader.chunks(info, spec, 1, 2)) as stream, _fails_within(30):
        with pytest.raises(DataError, match=r"rank 1 read no rows from its shard .* after filters"):
            next(stream)
    nothing = [("id", "<", 0)]
    info = inspect_dataset(path, NAMED, filters=nothing)
    with (
        contextlib.closing(reader.chunks(info, DataSpec(batch_size=8, filters=nothing), 0, 1)) as stream,
        _fails_within(30),
    ):
        with pytest.raises(DataError, match=r"rank 0 read no rows"):
            next(stream)
