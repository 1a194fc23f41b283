"""Delta tables as production writes them: partition columns, column mapping, deletion vectors.

No Spark here. delta-rs writes the tables; deletion vectors are committed per the Delta protocol
(tests/delta_protocol.py, tests/delta_tables.py: no installable tool writes them). sparkdl
resolves and reads them as a task would, and every test compares the rows it reads with what
delta-rs's own reader (its DataFusion scan, which reads deletion vectors and column mapping
itself) says the table holds, and with the rows the test meant to keep. Training on such a
table through the cluster is tests/integration/test_connectors.py.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake

import sparkdl
from sparkdl import connectors
from sparkdl._driver.prepare_data import prepare_data, prepare_dataset
from sparkdl._driver.settings import DataSettings
from sparkdl.connectors import delta_log
from sparkdl.data import cache
from sparkdl.data.dataset import EmptyDatasetError, ParquetFiles, inspect_dataset
from sparkdl.data.inputs import LABEL_KEY, Column
from sparkdl.data.open_files import OpenFiles
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers import reader_from_name
from sparkdl.data.selection import shard_rows
from sparkdl.data.spec import DataSpec
from sparkdl.errors import DataError
from tests.delta_protocol import active_files, delete_rows, enable_deletion_vectors, z85
from tests.delta_tables import production_table, rows_table, table_rows

#: Model inputs that read partition columns (label, shard: typed by the table's schema) and
#: renamed ones; ``day`` (strings) is read too where no transform_fn is required.
COLUMNS = {"features": "features", "id": Column("id"), "shard": Column("shard")}


def plan(day: bool = True) -> InputPlan:
    return InputPlan.from_inputs({**COLUMNS, **({"day": Column("day")} if day else {})}, "label")


def read_rows(info, world_size=1, **spec):
    """(id, label, shard, day) of every row the ranks' Arrow readers hand out in one pass, per
    rank (day None when the plan does not read it)."""
    per_rank = []
    for rank in range(world_size):
        rows = []
        stream = reader_from_name("arrow").read_pass(
            info, DataSpec(batch_size=8, shuffle=False, **spec), rank, world_size, 0
        )
        for chunk in stream:
            assert np.array_equal(chunk["features"][:, 0], chunk["id"]) and np.array_equal(
                chunk["features"][:, 1], -chunk["id"]
            )
            days = list(chunk["day"]) if "day" in chunk else [None] * len(chunk["id"])
            rows += zip(chunk["id"].tolist(), chunk[LABEL_KEY].tolist(), chunk["shard"].tolist(), days)
        per_rank.append(rows)
    return per_rank


def truth(table, keep=lambda row: True, day: bool = True):
    """(id, label, shard, day) of the rows delta-rs reads, those ``keep`` keeps."""
    return sorted((*row[:3], row[3] if day else None) for row in table_rows(table.path) if keep(row))


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return production_table(str(tmp_path_factory.mktemp("delta") / "clicks"))


def test_delta_rs_reads_the_deletion_vectors_the_tests_write(tmp_path):
    """tests/delta_protocol.py against the protocol's own example and against delta-rs: an array
    container, a bitmap container (over 4096 rows) and a second 16-bit key, in a file and inline;
    then sparkdl leaves exactly those rows out, on 3 ranks."""
    # PROTOCOL.md's example of a descriptor: prefix "ab", UUID d2c639aa-8816-431a-aaf6-d3fe2512ff61.
    assert "ab" + z85(uuid.UUID("d2c639aa-8816-431a-aaf6-d3fe2512ff61").bytes) == "ab^-aqEH.-t@S}K{vb[*k^"
    path = str(tmp_path / "big")
    write_deltalake(path, pa.table({"id": np.arange(70_000)}))
    enable_deletion_vectors(path)
    (name,) = active_files(path)
    deleted = set(range(0, 5000)) | {66_000, 69_999}  # a bitmap container, and an array one under key 1
    delete_rows(path, {name: sorted(deleted)}, prefix="dv")
    (vector,) = pa.table(DeltaTable(path).deletion_vectors()).to_pylist()
    assert set(np.flatnonzero(~np.asarray(vector["selection_vector"], dtype=bool))) == deleted
    delete_rows(path, {name: [3, 7, 65_536]}, inline=True)
    (vector,) = pa.table(DeltaTable(path).deletion_vectors()).to_pylist()
    assert set(np.flatnonzero(~np.asarray(vector["selection_vector"], dtype=bool))) == {3, 7, 65_536}
    info = prepare_dataset(connectors.DeltaSource(path), InputPlan.from_inputs({"id": Column("id")}, None), 3)
    ids = [
        i
        for rank in range(3)
        for c in reader_from_name("arrow").read_pass(info, DataSpec(8, shuffle=False), rank, 3, 0)
        for i in c["id"]
    ]
    assert info.num_rows == 70_000 - 3 and sorted(ids) == sorted(set(range(70_000)) - {3, 7, 65_536})


def test_partitions_column_mapping_and_deletion_vectors_are_read_in_place(table):
    assert set(id for id, *_ in table_rows(table.path)) == table.live, "delta-rs reads other rows than the test wrote"
    resolved = connectors.DeltaSource(table.path).resolve(None, ["features", "id", "label"])
    assert isinstance(resolved, ParquetFiles) and all(f.startswith(f"file://{table.path}/") for f in resolved.files)
    assert resolved.layout.changes(["features", "label"]) == [
        "renamed column(s) features",
        "partition column(s) label",
        f"{len(table.deleted)} deleted rows",
    ]
    info = inspect_dataset(resolved, plan())
    assert info.num_rows == len(table.live) and info.num_row_groups > len(info.files) > 20
    for world_size in (1, 2, 5):
        per_rank = read_rows(info, world_size)
        assert sorted(row for rows in per_rank for row in rows) == truth(table)
        assert shard_rows(info, world_size) == [len(rows) for rows in per_rank]


def test_a_rank_count_above_the_row_groups_strides_over_live_rows(tmp_path):
    path = str(tmp_path / "one")
    write_deltalake(path, rows_table(np.arange(30)), partition_by=["label"])
    enable_deletion_vectors(path)
    delete_rows(path, {name: [0, 5] for name in active_files(path)})
    info = prepare_dataset(connectors.DeltaSource(path), plan(day=False), num_workers=3)
    assert info.num_row_groups == 2 and info.num_rows == 26
    per_rank = read_rows(info, 3)
    assert sorted(row[0] for rows in per_rank for row in rows) == sorted(set(range(30)) - {0, 10, 1, 11})
    assert shard_rows(info, 3) == [len(rows) for rows in per_rank]


@pytest.mark.parametrize(
    "filters, keep",
    [
        ([("day", "=", "a b/c%d")], lambda r: r[3] == "a b/c%d"),
        (pc.field("region").is_null(), lambda r: r[4] is None),
        ((pc.field("shard") == 2) & (pc.field("id") > 200), lambda r: r[2] == 2 and r[0] > 200),
        (
            [[("label", "=", 1), ("region", "=", "eu")], [("id", "<", 10)]],
            lambda r: (r[1] == 1 and r[4] == "eu") or r[0] < 10,
        ),
    ],
)
def test_filters_on_partition_and_renamed_columns(table, filters, keep):
    info = inspect_dataset(connectors.DeltaSource(table.path).resolve(None, []), plan(), filters=filters)
    per_rank = read_rows(info, 2, filters=filters)
    assert sorted(row for rows in per_rank for row in rows) == truth(table, keep)
    assert shard_rows(info, 2, filters=filters) == [len(rows) for rows in per_rank]


def test_a_filter_on_partition_columns_skips_whole_files_from_the_log(table):
    info = inspect_dataset(connectors.DeltaSource(table.path).resolve(None, []), plan(), filters=[("shard", "=", 1)])
    files = OpenFiles(info)
    shard = info.layout.partitions.index("shard")
    try:
        skipped = [not files.may_match(i, 0, pc.field("shard") == 1) for i in range(len(info.files))]
    finally:
        files.close()
    assert skipped == [values[shard] != 1 for values in info.layout.partition_values] and any(skipped)


def test_statistics_of_another_column_never_skip_row_groups_and_field_ids_are_checked():
    """Column mapping turned on for an existing table keeps the old names as physical names: a
    column renamed a -> b is stored as "a", and a new column "a" as "col-1". The statistics
    stored under "a" are b's: a filter on the table's "a" must not be pushed down to them. In id
    mode, a file whose "a" carries another field id is another column: refused, named."""
    from sparkdl.data.table_layout import TableLayout

    layout = TableLayout(columns=(("b", "a"), ("a", "col-1")), field_ids=(("b", 1), ("a", 2)))
    physical = pa.schema(
        [pa.field("a", pa.int64(), metadata={b"PARQUET:field_id": b"1"}), pa.field("col-1", pa.int64())]
    )
    assert layout.table_schema(physical).names == ["b", "a"]
    assert layout.pushdown(0, physical) is None
    assert TableLayout(columns=(("x", "col-9"),)).pushdown(0, pa.schema([("col-9", pa.int64())])) is not None
    layout.check_file(physical, ["b", "a"], "f.parquet")
    swapped = pa.schema([pa.field("a", pa.int64(), metadata={b"PARQUET:field_id": b"2"})])
    with pytest.raises(DataError, match="file 'f.parquet' stores field id 2 under the physical name 'a' of column 'b'"):
        layout.check_file(swapped, ["b"], "f.parquet")


def test_column_mapping_by_id_and_a_mode_the_protocol_does_not_enable(tmp_path):
    by_id = production_table(str(tmp_path / "by_id"), mapping="id")
    info = prepare_dataset(connectors.DeltaSource(by_id.path), plan(day=False), num_workers=2)
    assert dict(info.layout.field_ids)["id"] > 0
    assert sorted(r for rows in read_rows(info, 2) for r in rows) == truth(by_id, day=False)
    # delta-rs asked for column mapping and deletion vectors together writes the mode into the
    # table's configuration but not the columnMapping feature into its protocol: not in effect,
    # the files use the table's names (and delta-rs reads them so).
    path = str(tmp_path / "unmapped")
    config = {"delta.columnMapping.mode": "name", "delta.enableDeletionVectors": "true"}
    write_deltalake(path, rows_table(np.arange(50)), partition_by=["label"], configuration=config)
    assert "columnMapping" not in (DeltaTable(path).protocol().reader_features or ())
    info = prepare_dataset(connectors.DeltaSource(path), plan(day=False), num_workers=1)
    assert info.layout.columns == () and sorted(read_rows(info)[0]) == sorted((*r[:3], None) for r in table_rows(path))


def test_training_validation_and_resume_positions_leave_deleted_rows_out(table):
    from sparkdl._runtime.validation import validation_source
    from sparkdl.data.batching import validation_batches
    from sparkdl.data.reshard import position_pass

    dataset, spec, reader, steps = prepare_data(
        connectors.DeltaSource(table.path),
        DataSettings(inputs=COLUMNS, label_col="label", batch_size=10, validation=0.2, reader="arrow"),
        num_workers=2,
    )
    training = shard_rows(dataset, 2, 0.2, "train")
    assert steps == sum(training) // 20
    trained = [r[0] for rows in read_rows(dataset, 2, holdout=0.2) for r in rows]
    validated = [
        int(i)
        for rank in range(2)
        for batch in validation_batches(reader, *validation_source(dataset, spec), rank, 2)
        for i in batch[0]["id"]
    ]
    assert len(trained) == sum(training) and sorted(trained + validated) == sorted(table.live)
    deleted = set(dataset.layout.deleted_positions([sum(f.row_groups) for f in dataset.files]).tolist())
    for rank in range(2):
        positions = np.concatenate(
            [c["\x00position"] for c in position_pass(dataset, DataSpec(10, shuffle=True), rank, 2, 0, None)]
        )
        assert not set(positions.tolist()) & deleted


def test_the_fingerprint_follows_the_deleted_rows(tmp_path):
    """A resume replays positions only on the same data: a later delete on the same files is other data."""
    path = str(tmp_path / "t")
    write_deltalake(path, rows_table(np.arange(40)))
    enable_deletion_vectors(path)
    (name,) = active_files(path)
    delete_rows(path, {name: [1]})
    delete_rows(path, {name: [1, 2]})

    def fingerprint(version):
        return prepare_dataset(connectors.DeltaSource(path, version=version), plan(day=False), 1).fingerprint

    assert fingerprint(2) == fingerprint(2) != fingerprint(3) != fingerprint(1)


def test_the_shard_cache_keeps_only_live_rows(table):
    from sparkdl.data.readers.base import PASS_END
    from sparkdl.data.shard_cache import ShardCache

    info = inspect_dataset(connectors.DeltaSource(table.path).resolve(None, []), plan())
    cache_ = ShardCache(1 << 30, 0, info.name)
    passes = [[]]
    for chunk in reader_from_name("arrow").passes(info, DataSpec(8, shuffle=True), 0, 1, [0, 1], cache_):
        if chunk is PASS_END:
            passes.append([])
        else:
            passes[-1] += chunk["id"].tolist()
    assert sorted(passes[0]) == sorted(passes[1]) == sorted(table.live)


def test_materialize_always_copies_the_live_rows_once(table, tmp_path):
    """materialize='always' with no Spark session: sparkdl copies the version's live rows (read
    with the log's layout) under cache_dir, once, as plain Parquet of even row groups."""
    copies = str(tmp_path / "copies")
    source = connectors.DeltaSource(table.path, materialize="always", cache_dir=copies)
    copy = source.resolve(None, ["features"])
    assert copy.layout is None and all(f.startswith(f"file://{copies}/") for f in copy.files)
    assert "copied by sparkdl, with the table's log" in copy.description
    assert copy.url in cache.cached_urls() and source.resolve(None, ["features"]).url == copy.url
    info = prepare_dataset(source, plan(day=False), num_workers=3)
    assert sorted(r for rows in read_rows(info, 3) for r in rows) == truth(table, day=False)
    assert len(set(info.row_group_rows)) <= 2 and info.num_row_groups % 16 == 0  # even row groups


def test_a_table_sparkdl_does_not_read_in_place_is_copied_by_delta_rs(tmp_path, monkeypatch):
    """More deleted rows than sparkdl sends to every task: delta-rs's own reader copies the
    version (DataFusion's view types need pyarrow 16 to import; older ones get the reason)."""
    table = production_table(str(tmp_path / "t"))
    monkeypatch.setattr(delta_log, "MAX_DELETED_ROWS", 5)
    with pytest.raises(
        DataError, match="cannot be read in place \\(it has more than 5 deleted rows.*materialize='never'"
    ):
        connectors.DeltaSource(table.path, materialize="never").resolve(None, [])
    source = connectors.DeltaSource(table.path, cache_dir=str(tmp_path / "copies"))
    if int(pa.__version__.split(".")[0]) < 16:
        with pytest.raises(DataError, match="cannot import what delta-rs reads .*view types.*more than 5 deleted rows"):
            source.resolve(None, [])
        return
    copy = source.resolve(None, [])
    assert copy.layout is None and "copied by delta-rs" in copy.description
    info = inspect_dataset(copy, plan())
    assert sorted(r for rows in read_rows(info, 2) for r in rows) == truth(table)


def test_a_non_finite_value_is_found_in_a_live_row_by_its_table_name(tmp_path):
    """After a NaN loss: the NaN of a deleted row is not the cause, the live one is named by
    the table's column name and its row in the file."""
    from sparkdl.data.nonfinite import describe_non_finite

    path = str(tmp_path / "nan")
    data = rows_table(np.arange(20))
    values = np.stack([np.arange(20), -np.arange(20)], 1).astype(np.float32)
    values[3, 0] = values[7, 1] = np.nan
    data = data.set_column(0, "features", pa.array(list(values), type=pa.list_(pa.float32())))
    write_deltalake(path, data, configuration={"delta.columnMapping.mode": "name"})
    enable_deletion_vectors(path)
    delete_rows(path, {name: [3] for name in active_files(path)})
    info = inspect_dataset(connectors.DeltaSource(path).resolve(None, []), ["features"], "label")
    assert describe_non_finite(info).startswith("column 'features' holds NaN at row 7 of row group 0 of file ")


def test_bad_input_is_named(table, tmp_path):
    with pytest.raises(DataError, match="no Delta table at"):
        connectors.DeltaSource(str(tmp_path / "missing")).resolve()
    with pytest.raises(DataError, match="cannot load Delta table .*version 99"):
        connectors.DeltaSource(table.path, version=99).resolve()
    with pytest.raises(DataError, match="has no version at timestamp 2001-01-01T00:00:00Z: its first is from 20"):
        connectors.DeltaSource(table.path, timestamp="2001-01-01T00:00:00Z").resolve()
    with pytest.raises(sparkdl.ConfigError, match="materialize='sometimes' must be one of"):
        connectors.DeltaSource(table.path, materialize="sometimes")
    # A missing column is named with the table's columns, not the files' physical names.
    with pytest.raises(
        DataError,
        match="feature column 'nope' is not in dataset .*columns are: features, id, label, shard, day, region",
    ):
        prepare_dataset(connectors.DeltaSource(table.path), ["features", "nope"], 2, label_col="label")

    empty = str(tmp_path / "empty")
    write_deltalake(empty, rows_table(np.arange(0)))
    with pytest.raises(DataError, match="Delta table .*empty version 0 has no data files|is empty"):
        prepare_dataset(connectors.DeltaSource(empty), plan(day=False), 2)
    write_deltalake(empty, rows_table(np.arange(4)), mode="append")
    enable_deletion_vectors(empty)
    delete_rows(empty, {name: range(4) for name in active_files(empty)})
    with pytest.raises(EmptyDatasetError, match="0 rows that are not deleted"):
        prepare_dataset(connectors.DeltaSource(empty), plan(day=False), 2)


def test_a_null_partition_value_of_a_needed_column_is_named(tmp_path):
    path = str(tmp_path / "nulls")
    data = rows_table(np.arange(20)).set_column(3, "shard", pa.array([None] * 5 + [1] * 15, pa.int32()))
    write_deltalake(path, data, partition_by=["shard"])
    with pytest.raises(
        DataError, match="input 'shard' column 'shard' is null for every row of file .*shard=__HIVE_DEFAULT_PARTITION__"
    ):
        prepare_dataset(connectors.DeltaSource(path), plan(day=False), 1)
    info = prepare_dataset(connectors.DeltaSource(path), plan(day=False), 1, filters=pc.field("shard").is_valid())
    assert sorted(r[0] for r in read_rows(info, filters=pc.field("shard").is_valid())[0]) == list(range(5, 20))


def _with_reader_feature(path: str, feature: str) -> str:
    write_deltalake(path, rows_table(np.arange(10)))
    protocol = {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": [feature], "writerFeatures": [feature]}
    with open(os.path.join(path, "_delta_log", f"{1:020d}.json"), "x") as handle:
        handle.write(json.dumps({"protocol": protocol}) + "\n")
    return path


def test_a_table_nothing_here_can_read_is_refused_naming_each_reason(tmp_path):
    # typeWidening: delta-rs loads the log, sparkdl does not read it in place, delta-rs's reader refuses it.
    widened = _with_reader_feature(str(tmp_path / "widened"), "typeWidening")
    with pytest.raises(DataError) as failure:
        connectors.DeltaSource(widened, cache_dir=str(tmp_path / "c")).resolve(None, ["features"])
    assert all(
        reason in str(failure.value)
        for reason in ("delta-rs cannot read", "typeWidening are not read in place", "there is no Spark session")
    )
    assert not list((tmp_path / "c").rglob("copy-*")), "a failed copy was left behind"
    # A feature delta-rs does not know: it cannot even load the log.
    future = _with_reader_feature(str(tmp_path / "future"), "fancyNewFeature")
    with pytest.raises(DataError, match="cannot load Delta table .*fancyNewFeature.*Spark: there is no Spark session"):
        connectors.DeltaSource(future).resolve(None, ["features"])


@pytest.mark.petastorm
def test_petastorm_refuses_what_only_the_log_describes_and_reads_the_rest(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, rows_table(np.arange(40)), partition_by=["label"])
    reader = reader_from_name("petastorm")
    needs_label = prepare_dataset(connectors.DeltaSource(path), ["features"], 2, label_col="label")
    with pytest.raises(sparkdl.ConfigError, match="partition column\\(s\\) label, which only its log describes"):
        reader.check(needs_label)
    plain = prepare_dataset(connectors.DeltaSource(path), ["features"], 2, label_col="id")
    reader.check(plain)
    ids = sorted(
        int(i)
        for rank in range(2)
        for c in reader.read_pass(plain, DataSpec(8, shuffle=False), rank, 2, 0)
        for i in c[LABEL_KEY]
    )
    assert ids == list(range(40))
    copied = prepare_dataset(
        connectors.DeltaSource(path, materialize="always", cache_dir=str(tmp_path / "c")),
        ["features"],
        2,
        label_col="label",
    )
    reader.check(copied)
    shutil.rmtree(tmp_path / "c", ignore_errors=True)
