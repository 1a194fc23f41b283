"""Batching, shuffling and column conversion, with an in-memory reader (no Spark)."""

import itertools
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl.data.batching import batches
from sparkdl.data.columns import ColumnInfo
from sparkdl.data.dataset import DatasetInfo, inspect_dataset
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers import Chunk, DataReader
from sparkdl.data.spec import DataSpec
from sparkdl.errors import DataError

PLAN = InputPlan.from_feature_cols(["x"], "y")
INFOS = {"x": ColumnInfo("x", "float", ()), "y": ColumnInfo("y", "int", ())}
DATASET = DatasetInfo("memory://", 100, 4, False, PLAN, tuple(INFOS.values()))


def to_arrays(columns, label, infos, label_info, source):
    """(features, labels) of numpy columns, through the feature_cols plan's first step."""
    plan = InputPlan.from_feature_cols([i.name for i in infos], label_info.name if label_info else None)
    named = {i.name: c for i, c in zip(infos, columns)}
    if label_info is not None:
        named[label_info.name] = label
    arrays = plan.extract(named, {i.name: i for i in list(infos) + ([label_info] if label_info else [])}, source)
    return plan.finish(arrays, None, lambda position: source)


class _Chunks(DataReader):
    """Endless chunks of ids of uneven sizes, as row groups arrive."""

    def __init__(self):
        self.closed = False

    def read_pass(self, dataset, spec, rank, world_size, pass_index) -> Iterator[Chunk]:
        raise AssertionError("batches() reads chunks()")

    def chunks(self, dataset, spec, rank, world_size) -> Iterator[Chunk]:
        try:
            while True:
                for start, size in ((0, 37), (37, 5), (42, 58)):
                    ids = np.arange(start, start + size, dtype=np.float32)
                    yield PLAN.extract({"x": ids, "y": ids.astype(np.int64)}, INFOS, "test")
        finally:
            self.closed = True


def _take(spec, n):
    reader = _Chunks()
    stream = batches(reader, DATASET, spec, rank=0, world_size=1)
    out = [next(stream) for _ in range(n)]
    stream.close()
    assert reader.closed, "closing the batch stream must close the reader"
    return out


def test_batches_have_exactly_batch_size_rows_and_keep_features_with_labels():
    for features, labels in _take(DataSpec(batch_size=16, shuffle=True, seed=1), 20):
        assert features.shape == (16, 1) and labels.shape == (16,)
        np.testing.assert_array_equal(features[:, 0].astype(np.int64), labels)


def test_without_shuffle_rows_stream_in_order_across_passes():
    ids = np.concatenate([f[:, 0] for f, _ in _take(DataSpec(batch_size=30, shuffle=False), 10)])
    np.testing.assert_array_equal(ids, np.arange(300) % 100)


def test_shuffle_is_seeded_bounded_and_loses_no_rows():
    spec = DataSpec(batch_size=10, shuffle=True, seed=5, shuffle_buffer_batches=2)
    first = np.concatenate([f[:, 0] for f, _ in _take(spec, 30)])
    again = np.concatenate([f[:, 0] for f, _ in _take(spec, 30)])
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, np.arange(300) % 100)
    # 300 rows from 3 passes over 100 ids: shuffling across a bounded buffer keeps counts near 3.
    counts = np.bincount(first.astype(int), minlength=100)
    assert counts.min() >= 2 and counts.max() <= 4


def test_to_arrays_concatenates_columns_in_order():
    a = np.array([1.0, 2.0])
    vec = np.array([np.array([10.0, 11.0]), np.array([20.0, 21.0])], dtype=object)
    info = (ColumnInfo("a", "float", ()), ColumnInfo("vec", "float", (None,)))
    features, labels = to_arrays([a, vec], np.array([1, 0]), info, INFOS["y"], "test")
    np.testing.assert_array_equal(features, [[1, 10, 11], [2, 20, 21]])
    assert features.dtype == np.float32 and labels.dtype == np.int64


def test_one_tensor_column_keeps_its_shape():
    images = np.zeros((3, 2, 4, 4), dtype=np.float64)
    features, _ = to_arrays([images], None, (ColumnInfo("img", "float", (2, 4, 4)),), None, "test")
    assert features.shape == (3, 2, 4, 4) and features.dtype == np.float32


def test_ragged_arrays_and_nan_are_named():
    ragged = np.array([np.zeros(2), np.zeros(3)], dtype=object)
    with pytest.raises(DataError, match="feature column 'vec' holds arrays of different lengths"):
        to_arrays([ragged], None, (ColumnInfo("vec", "float", (None,)),), None, "test")
    with pytest.raises(DataError, match="feature column\\(s\\) a contain NaN or null values in test"):
        to_arrays([np.array([1.0, np.nan])], None, (ColumnInfo("a", "float", ()),), None, "test")


def test_inspect_dataset_reads_only_metadata_and_checks_columns(tmp_path):
    table = pa.table(
        {"x": pa.array([[1.0, 2.0]] * 10, type=pa.list_(pa.float32())), "name": ["a"] * 10, "y": list(range(10))}
    )
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=3)
    info = inspect_dataset(str(tmp_path), ["x"], "y")
    assert (info.num_rows, info.num_row_groups, info.is_petastorm) == (10, 4, False)
    assert info.url == f"file://{tmp_path}"
    assert info.infos["x"].shape == (None,) and info.infos["y"].kind == "int"
    with pytest.raises(DataError, match="feature column 'name' has type string, which is not numeric"):
        inspect_dataset(str(tmp_path), ["name"], "y")
    with pytest.raises(DataError, match="label column 'z' is not in dataset .*its columns are: x, name, y"):
        inspect_dataset(str(tmp_path), ["x"], "z")


def test_the_shuffle_buffer_takes_the_rows_of_several_chunks_as_if_concatenated_then_permuted():
    """The shuffle buffer writes each pending chunk's rows straight to their shuffled places
    (no concatenated copy first): the rows must be exactly those of concatenating, then taking
    the seeded permutation, for every column type a chunk holds."""
    from sparkdl.data.batching import cut_stream

    rng = np.random.default_rng(3)
    sizes = [5, 37, 1, 20]
    chunks = []
    start = 0
    for size in sizes:
        ids = np.arange(start, start + size)
        chunks.append(
            {
                "dense": rng.standard_normal((size, 3, 2)).astype(np.float32),
                "id": ids,
                "tokens": np.array([np.arange(i % 4) for i in ids] + [None], dtype=object)[:size],  # ragged: objects
                "name": np.array([f"r{'x' * (i % 5)}{i}" for i in ids]),  # strings of growing width
            }
        )
        start += size
    spec = DataSpec(batch_size=7, seed=11, shuffle_buffer_batches=4)
    cut = list(cut_stream(iter(chunks), spec, rank=1))
    # The reference: concatenate what is pending whenever 28 rows are, permute with the same generator.
    reference_rng = np.random.default_rng(spec.seed + 1)
    concatenated = {key: np.concatenate([c[key] for c in chunks]) for key in chunks[0]}
    # The buffer fills at 42 rows (5 + 37), cuts 6 batches of 7, then has 0 + 1 + 20 = 21 < 28 left.
    order = reference_rng.permutation(42)
    expected = {key: values[:42][order] for key, values in concatenated.items()}
    assert len(cut) == 6
    for index, batch in enumerate(cut):
        rows = slice(7 * index, 7 * index + 7)
        np.testing.assert_array_equal(batch["dense"], expected["dense"][rows])
        np.testing.assert_array_equal(batch["id"], expected["id"][rows])
        assert [list(t) for t in batch["tokens"]] == [list(t) for t in expected["tokens"][rows]]
        assert batch["name"].tolist() == expected["name"][rows].tolist()


def test_the_shuffle_buffer_never_mixes_rows_of_two_passes():
    """A pass's end empties the buffer: its last rows open the next batch, ahead of the next
    pass's. Chunks without positions (a reader that does not tell them) get this much."""
    from sparkdl.data.batching import cut_stream
    from sparkdl.data.readers.base import PASS_END

    def source():
        while True:
            for start, size in ((0, 37), (37, 5), (42, 58)):
                yield {"id": np.arange(start, start + size)}
            yield PASS_END

    spec = DataSpec(batch_size=30, seed=4, shuffle_buffer_batches=2)
    rows = np.concatenate([b["id"] for b in itertools.islice(cut_stream(source(), spec, rank=0), 20)])
    for start in range(0, 600, 100):
        assert sorted(rows[start : start + 100].tolist()) == list(range(100))  # each pass, whole, in its place
    assert not np.array_equal(rows[:100], rows[100:200])
