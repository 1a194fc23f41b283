"""sparkdl.inference.parts on real Parquet files: stable part ids, row groups packed into parts
and big files split, Spark's listing rules, hive partitions, and clear errors."""

from __future__ import annotations

import datetime
import os
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl.errors import DataError
from sparkdl.inference.parts import data_fingerprint, list_parts, part_schema, read_part


def _write(path, ids, row_group_size=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = pa.table({"id": pa.array(ids, pa.int64()), "x": pa.array([float(i) for i in ids], pa.float64())})
    pq.write_table(table, path, row_group_size=row_group_size)


def _ids(parts, columns=None, batch_rows=1000):
    return [i for part in parts for b in read_part(part, columns, batch_rows) for i in b.column("id").to_pylist()]


def test_the_same_data_gives_the_same_parts_and_every_row_once(tmp_path):
    _write(str(tmp_path / "b.parquet"), list(range(100, 160)), row_group_size=10)
    _write(str(tmp_path / "a.parquet"), list(range(0, 100)), row_group_size=10)
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".a.parquet.crc").write_text("not parquet")
    _write(str(tmp_path / "_temporary" / "0" / "c.parquet"), [999])
    first = list_parts(None, str(tmp_path), target_rows=35)
    again = list_parts(None, "file://" + str(tmp_path), target_rows=35)
    assert first == again
    # a.parquet: 10 groups of 10 rows in parts of at most 35 rows: 3+3+3+1 groups; b.parquet: 3+3.
    assert [(p.path, p.row_groups, p.rows) for p in first] == [
        ("a.parquet", (0, 1, 2), 30),
        ("a.parquet", (3, 4, 5), 30),
        ("a.parquet", (6, 7, 8), 30),
        ("a.parquet", (9,), 10),
        ("b.parquet", (0, 1, 2), 30),
        ("b.parquet", (3, 4, 5), 30),
    ]
    assert len({p.part_id for p in first}) == len(first)
    assert [p.part_id for p in first] == sorted(p.part_id for p in first)  # names keep the data's order
    assert _ids(first, batch_rows=7) == list(range(160))
    assert pickle.loads(pickle.dumps(first)) == first


def test_part_ids_depend_on_the_file_and_its_row_groups_not_on_where_the_dataset_lives(tmp_path):
    for root in ("one", "two"):
        _write(str(tmp_path / root / "a.parquet"), list(range(20)), row_group_size=5)
    one, two = list_parts(None, str(tmp_path / "one"), target_rows=10), list_parts(None, str(tmp_path / "two"))
    moved = list_parts(None, str(tmp_path / "two"), target_rows=10)
    assert [p.part_id for p in one] == [p.part_id for p in moved]
    assert data_fingerprint(one) == data_fingerprint(moved)
    assert data_fingerprint(one) != data_fingerprint(two)  # other parts: another job's ids
    _write(str(tmp_path / "two" / "a.parquet"), list(range(21)), row_group_size=5)
    assert data_fingerprint(list_parts(None, str(tmp_path / "two"), target_rows=10)) != data_fingerprint(one)


def test_small_row_groups_pack_by_bytes_and_a_big_row_group_is_a_part_alone(tmp_path):
    _write(str(tmp_path / "a.parquet"), list(range(1000)), row_group_size=100)
    parts = list_parts(None, str(tmp_path), target_bytes=1)
    assert [p.row_groups for p in parts] == [(g,) for g in range(10)]
    assert [p.row_groups for p in list_parts(None, str(tmp_path))] == [tuple(range(10))]


def test_one_file_columns_and_empty_files(tmp_path):
    _write(str(tmp_path / "d" / "a.parquet"), [])
    _write(str(tmp_path / "d" / "b.parquet"), [1, 2, 3])
    parts = list_parts(None, str(tmp_path / "d"))
    assert [p.path for p in parts] == ["b.parquet"]  # an empty file is no part
    single = list_parts(None, str(tmp_path / "d" / "b.parquet"))
    assert [(p.path, p.rows) for p in single] == [("b.parquet", 3)]
    batch = next(read_part(single[0], columns=["x", "id"]))
    assert batch.schema.names == ["x", "id"] and batch.column("x").to_pylist() == [1.0, 2.0, 3.0]
    empty = list_parts(None, str(tmp_path / "d" / "a.parquet"))
    assert [p.rows for p in empty] == [0] and list(read_part(empty[0])) == []
    assert part_schema(empty[0]).names == ["id", "x"]


def test_hive_partition_directories_become_typed_columns(tmp_path):
    _write(str(tmp_path / "year=2024" / "day=2024-01-02" / "k=a%2Fb" / "f.parquet"), [1, 2])
    _write(str(tmp_path / "year=2025" / "day=2025-03-04" / "k=__HIVE_DEFAULT_PARTITION__" / "f.parquet"), [3])
    parts = list_parts(None, str(tmp_path))
    batches = [b for p in parts for b in read_part(p)]
    table = pa.Table.from_batches(batches)
    assert table.schema == part_schema(parts[0])
    assert table.schema.names == ["id", "x", "year", "day", "k"]
    assert table.schema.field("year").type == pa.int32() and table.schema.field("day").type == pa.date32()
    assert table.column("k").to_pylist() == ["a/b", "a/b", None]
    assert table.column("day").to_pylist()[2] == datetime.date(2025, 3, 4)
    only = next(read_part(parts[0], columns=["k", "id"]))
    assert only.schema.names == ["k", "id"] and only.column("id").to_pylist() == [1, 2]


@pytest.mark.parametrize(
    "layout, message",
    [
        ({"x=1/a.parquet": [1], "b.parquet": [2]}, "not under the same partition directories"),
        ({"id=1/a.parquet": [1]}, "also columns of its files"),
        ({"_delta_log/0.json": None, "a.parquet": [1]}, "is a Delta table"),
        ({"a.parquet": [1], "b.txt": "hello"}, "'b.txt' in .* is not a readable Parquet file"),
        ({"_SUCCESS": ""}, "holds no Parquet files"),
    ],
)
def test_datasets_it_cannot_read_are_refused_by_name(tmp_path, layout, message):
    for name, content in layout.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, list):
            _write(str(path), content)
        else:
            path.write_text(content or "")
    with pytest.raises(DataError, match=message):
        list_parts(None, str(tmp_path))


def test_files_with_other_columns_and_missing_data_are_refused(tmp_path):
    _write(str(tmp_path / "a.parquet"), [1])
    pq.write_table(pa.table({"id": pa.array([1], pa.int32())}), str(tmp_path / "b.parquet"))
    with pytest.raises(DataError, match="'b.parquet' has \\(id int32\\)"):
        list_parts(None, str(tmp_path))
    with pytest.raises(DataError, match="no Parquet file or directory at"):
        list_parts(None, str(tmp_path / "missing"))
    with pytest.raises(DataError, match="no table 'no_such_table' in the Spark catalog"):
        list_parts(None, "no_such_table")


def test_a_dataset_on_an_fsspec_filesystem(tmp_path):
    """memory:// (fsspec, wrapped as a pyarrow filesystem) lists and reads as a local path does."""
    import fsspec

    _write(str(tmp_path / "p=1" / "a.parquet"), list(range(10)), row_group_size=4)
    memory = fsspec.filesystem("memory")
    memory.put(str(tmp_path / "p=1" / "a.parquet"), "/parts-test/p=1/a.parquet")
    try:
        parts = list_parts(None, "memory://parts-test", target_rows=4)
        assert [p.url for p in parts] == ["memory://parts-test/p=1/a.parquet"] * 3
        assert _ids(parts) == list(range(10))
        assert {b.column("p").to_pylist()[0] for p in parts for b in read_part(p)} == {1}
    finally:
        memory.rm("/parts-test", recursive=True)
