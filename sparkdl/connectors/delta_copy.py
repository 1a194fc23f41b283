"""Delta tables sparkdl does not read in place: through the session's own Delta reader when it
has one (delta-spark, Databricks), else copied once into sparkdl's cache.

The Spark read is a DataFrame, materialized like any other. A copy is Parquet written under
``spark.sparkdl.cacheDir`` (or the temp dir), once per table version and driver, as row groups
of equal rows (the shard unit), from one of two sources:

* the files with the log's layout, when sparkdl can read them but is asked not to in place
  (``materialize='always'``: for a reader that reads files only as they are stored);
* delta-rs's own reader (its DataFusion scan), when sparkdl cannot interpret the log (a reader
  feature it does not read in place). DataFusion hands strings out as view types, which only
  pyarrow 16 and later can import.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pyarrow as pa

from sparkdl.data import cache
from sparkdl.data.dataset import EmptyDatasetError, ParquetFiles
from sparkdl.data.table_layout import TableLayout
from sparkdl.errors import DataError
from sparkdl.filesystem import file_paths, filesystem_and_path

#: The fewest row groups a copy is written as (so up to 16 ranks read whole row groups; a
#: number of ranks that divides it gets exactly even shards).
MIN_ROW_GROUPS = 16
#: Row groups per file of a copy.
GROUPS_PER_FILE = 16

Rows = Tuple[int, Iterator[pa.Table]]  # a row count, and the rows in pieces


def spark_read(spark: Any, path: str, options: Dict[str, str]) -> Tuple[Optional[Any], str]:
    """The table as a DataFrame through the session's Delta reader (``options``: its time travel,
    ``versionAsOf`` or ``timestampAsOf``), or None and why not (the session has no Delta
    reader, or it failed on this table)."""
    if spark is None:
        return None, "there is no Spark session"
    try:
        frame = spark.read.format("delta").options(**options).load(path)
        _ = frame.schema  # analysis: a session without Delta fails here at the latest
    except Exception as exc:  # noqa: BLE001 - AnalysisException, Py4J and Connect errors alike
        text = str(exc).strip()
        if "DATA_SOURCE_NOT_FOUND" in text or "Failed to find the data source" in text:
            return None, "the Spark session has no Delta reader (delta-spark is not configured)"
        return None, f"Spark's Delta reader failed: {text.splitlines()[0] if text else type(exc).__name__}"
    return frame, ""


def copy_table(
    table: Any, files: Optional[ParquetFiles], key: str, description: str, cache_dir: Optional[str], spark: Any
) -> ParquetFiles:
    """The table version copied to Parquet in sparkdl's cache, once per ``key``: from ``files``
    (the version's files and layout) when given, else through delta-rs's reader of ``table``
    (a loaded ``deltalake.DeltaTable``).

    Raises:
        EmptyDatasetError: the version holds no rows.
        DataError: delta-rs cannot read the table, or pyarrow cannot import what it reads.
    """
    by = "sparkdl, with the table's log" if files is not None else "delta-rs"

    def write(target: str) -> None:
        total, pieces = _layout_rows(files) if files is not None else _delta_rs_rows(table, description)
        if total == 0:
            raise EmptyDatasetError(f"{description} has no rows: there is nothing to train on")
        _write(total, pieces, target, description)

    url = cache.keyed_copy(key, write, cache_dir, spark)
    import pyarrow.fs as pafs

    fs, root = filesystem_and_path(url)
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name.endswith(".parquet"))
    return ParquetFiles(
        url=url,
        files=tuple(f"{url}/{name}" for name in names),
        description=f"{description} (copied by {by} to {url})",
    )


def _write(total: int, pieces: Iterator[pa.Table], url: str, description: str) -> None:
    """Writes ``total`` rows as Parquet files of ``GROUPS_PER_FILE`` row groups of equal rows."""
    import pyarrow.parquet as pq

    pieces = iter(pieces)
    pending = next(pieces, None)
    if pending is None:
        raise DataError(f"read no rows of {description} where it counted {total}")
    sizes = _row_group_sizes(total, pending)
    fs, root = filesystem_and_path(url)
    fs.create_dir(root, recursive=True)
    writer, written = None, 0
    try:
        for piece in itertools.chain([None], pieces):
            if piece is not None:
                pending = pa.concat_tables([pending, piece])
            while written < len(sizes) and pending.num_rows >= sizes[written]:
                if written % GROUPS_PER_FILE == 0:
                    if writer is not None:
                        writer.close()
                    path = f"{root}/part-{written // GROUPS_PER_FILE:05d}.parquet"
                    writer = pq.ParquetWriter(fs.open_output_stream(path), pending.schema, compression="snappy")
                group = pending.slice(0, sizes[written]).combine_chunks()
                writer.write_table(group, row_group_size=sizes[written])
                pending, written = pending.slice(sizes[written]), written + 1
    finally:
        if writer is not None:
            writer.close()
    if written != len(sizes) or pending.num_rows:
        raise DataError(
            f"read {sum(sizes[:written]) + pending.num_rows} rows of {description} where it counted {total}"
        )


def _row_group_sizes(total: int, sample: pa.Table) -> List[int]:
    """Rows of each row group of a copy of ``total`` rows like ``sample``'s: a multiple of
    ``MIN_ROW_GROUPS`` groups (at least that many, about ``ROW_GROUP_BYTES`` each), a row apart."""
    row_bytes = max(1, sample.nbytes // max(1, sample.num_rows))
    groups = MIN_ROW_GROUPS * math.ceil(max(1, total * row_bytes / cache.ROW_GROUP_BYTES) / MIN_ROW_GROUPS)
    groups = min(total, groups)
    return [total // groups + (1 if g < total % groups else 0) for g in range(groups)]


def _layout_rows(files: ParquetFiles) -> Rows:
    """Every live row of the files, all the table's columns, row group by row group (one file
    open at a time)."""
    import pyarrow.parquet as pq

    layout = files.layout or TableLayout()
    fs, _ = filesystem_and_path(files.files[0])
    paths = file_paths(fs, files.files)

    def rows_in(path: str) -> int:
        with fs.open_input_file(path) as handle:
            return pq.read_metadata(handle).num_rows

    total = sum(rows_in(path) for path in paths) - layout.deleted_count

    def pieces() -> Iterator[pa.Table]:
        for index, path in enumerate(paths):
            with pq.ParquetFile(fs.open_input_file(path)) as handle:
                columns = layout.table_schema(handle.schema_arrow).names
                layout.check_file(handle.schema_arrow, columns, files.files[index])
                first = 0
                for group in range(handle.metadata.num_row_groups):
                    rows = handle.metadata.row_group(group).num_rows
                    piece = layout.read(handle, index, group, columns)
                    live = layout.live_rows(index, first, rows)
                    first += rows
                    yield piece if live is None else piece.filter(pa.array(live))

    return total, pieces()


def _delta_rs_rows(table: Any, description: str) -> Rows:
    """The version's row count and rows as delta-rs's DataFusion reader reads them."""
    try:
        from deltalake import QueryBuilder

        def query(sql: str) -> Any:
            return QueryBuilder().register("t", table).execute(sql)

        total = pa.table(query("SELECT COUNT(*) AS n FROM t")).column("n")[0].as_py()
        reader = query("SELECT * FROM t")
    except ImportError as exc:  # pragma: no cover - deltalake < 1.0
        raise DataError(f"copying {description} needs deltalake>=1.0 (its QueryBuilder): {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - delta-rs raises its own errors for tables it cannot read
        raise DataError(f"delta-rs cannot read {description}: {exc}") from exc

    def pieces() -> Iterator[pa.Table]:
        for batch in reader:
            try:
                piece = pa.Table.from_batches([pa.record_batch(batch)])
            except pa.ArrowInvalid as exc:
                raise DataError(
                    f"pyarrow {pa.__version__} cannot import what delta-rs reads from {description} ({exc}: DataFusion "
                    f"hands strings out as view types, which pyarrow imports from version 16)"
                ) from exc
            # Plain strings and binaries: sparkdl's readers and older pyarrows know those.
            yield piece.cast(pa.schema([_plain(field) for field in piece.schema]))

    return int(total), pieces()


def _plain(field: pa.Field) -> pa.Field:
    kind = str(field.type)
    plain = {"string_view": pa.string(), "binary_view": pa.binary()}.get(kind, field.type)
    return pa.field(field.name, plain, field.nullable)
