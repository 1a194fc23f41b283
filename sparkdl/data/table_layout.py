"""How a table's Parquet files map to its rows, where a table format says more than the files do.

A plain Parquet dataset's rows are its files' rows. A table format (Delta Lake) can say, per
file, three more things:

* **column mapping**: a column is stored under another, physical, name (``col-5f3a...``), so
  renaming a column does not rewrite the files;
* **partition values**: a column is not stored in the files at all; each file's one value of it
  is in the table's log;
* **deletion vectors**: some rows of a file are deleted, without rewriting it.

A connector that resolves such a table to files read in place describes this with a
:class:`TableLayout` (:class:`~sparkdl.data.dataset.ParquetFiles` carries it to
:func:`~sparkdl.data.dataset.inspect_dataset`, which checks the files against it and keeps it
in the :class:`~sparkdl.data.dataset.DatasetInfo`). Then:

* a row group is read through :meth:`TableLayout.read`: its physical columns renamed to the
  table's names, the partition columns added as constants, every row of it;
* deleted rows are left out by the row selection (:class:`~sparkdl.data.selection.RowSelector`),
  as rows a filter drops: a row's position still indexes the files' rows, so sharding by row
  groups, the validation hold-out, elastic resume and the shard cache work unchanged;
* a filter on partition columns skips whole files from the log's values (:meth:`pushdown`).

A dataset without a layout takes none of these paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from sparkdl.errors import DataError

#: The Parquet field metadata that holds a column's field id.
_FIELD_ID = b"PARQUET:field_id"


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """What a table says about its files beyond their Parquet, per file in the dataset's order.

    Args:
        columns: under column mapping, every stored column as (table name, physical name); the
            files' columns without a table name are dropped columns. Empty: files use the table's names.
        field_ids: under column mapping by id, the Parquet field id of each table column (checked
            against every file: sparkdl reads by physical name).
        partition_schema: the partition columns, typed as the table's schema types them.
        partition_values: per file, its value of each partition column (None for null).
        deleted: per file, its deleted row indexes (sorted ``uint32``, as bytes; empty: none).
    """

    columns: Tuple[Tuple[str, str], ...] = ()
    field_ids: Tuple[Tuple[str, int], ...] = ()
    partition_schema: pa.Schema = dataclasses.field(default_factory=lambda: pa.schema([]))
    partition_values: Tuple[Tuple[Any, ...], ...] = ()
    deleted: Tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if any(len(values) != len(self.partition_schema) for values in self.partition_values):
            raise ValueError("every file needs one value per partition column")

    def check_files(self, file_rows: Sequence[int], urls: Sequence[str], source: str) -> None:
        """Raises DataError unless the per-file parts describe these files (``file_rows`` rows
        each, from their footers): one part per file, deleted rows that exist."""
        for name, parts in (("partition_values", self.partition_values), ("deleted", self.deleted)):
            if parts and len(parts) != len(file_rows):
                raise DataError(
                    f"the table layout of {source} describes {len(parts)} files in {name}, not {len(file_rows)}"
                )
        for index, rows in enumerate(file_rows):
            deleted = self.deleted_rows(index)
            if len(deleted) and deleted[-1] >= rows:
                raise DataError(
                    f"the deletion vector of {urls[index]!r} deletes row {int(deleted[-1])}, but the file has {rows} rows "
                    f"(it is not the file the table's log describes)"
                )

    def changes(self, columns: Iterable[str]) -> List[str]:
        """What reading ``columns`` needs beyond the files as stored (empty: nothing)."""
        columns = list(columns)
        renamed = [c for c in columns if c not in self.partitions and self.physical(c) != c]
        partitions = [c for c in columns if c in self.partitions]
        return [
            text
            for text, on in (
                (f"renamed column(s) {', '.join(renamed)}", renamed),
                (f"partition column(s) {', '.join(partitions)}", partitions),
                (f"{self.deleted_count} deleted rows", self.deleted_count),
            )
            if on
        ]

    @property
    def partitions(self) -> List[str]:
        return list(self.partition_schema.names)

    def physical(self, name: str) -> str:
        """The name ``name`` is stored under in the files."""
        return dict(self.columns).get(name, name)

    def deleted_rows(self, index: int) -> np.ndarray:
        """File ``index``'s deleted row indexes, sorted."""
        if not self.deleted or not self.deleted[index]:
            return np.zeros(0, dtype=np.int64)
        return np.frombuffer(self.deleted[index], dtype="<u4").astype(np.int64)

    @property
    def deleted_count(self) -> int:
        return sum(len(rows) for rows in self.deleted) // 4

    def deleted_positions(self, file_rows: Sequence[int]) -> Optional[np.ndarray]:
        """Every deleted row's position in the dataset (files in order, ``file_rows`` rows each),
        sorted; None when no row is deleted."""
        if not self.deleted_count:
            return None
        starts = np.concatenate([[0], np.cumsum(file_rows)[:-1]]).astype(np.int64)
        return np.concatenate([starts[i] + self.deleted_rows(i) for i in range(len(file_rows))])

    def live_rows(self, index: int, first: int, count: int) -> Optional[np.ndarray]:
        """Which of file ``index``'s rows ``first .. first+count-1`` are not deleted (None: all)."""
        rows = self.deleted_rows(index)
        rows = rows[(rows >= first) & (rows < first + count)]
        if not len(rows):
            return None
        live = np.ones(count, dtype=bool)
        live[rows - first] = False
        return live

    def fingerprint(self) -> bytes:
        """The deleted rows, for the dataset's fingerprint: the same files with other deletions
        are other data."""
        return hashlib.sha256(b"\0".join(self.deleted)).digest() if self.deleted_count else b""

    def read(
        self, handle: Any, index: int, row_group: int, columns: Sequence[str], use_threads: bool = True
    ) -> pa.Table:
        """Row group ``row_group`` of file ``index`` (a ``pyarrow.parquet.ParquetFile``) as the
        table's ``columns``: stored ones by their physical names, partition ones as constants."""
        partitions = self.partitions
        stored = [c for c in columns if c not in partitions]
        table = handle.read_row_group(row_group, columns=[self.physical(c) for c in stored], use_threads=use_threads)
        rows = handle.metadata.row_group(row_group).num_rows
        arrays: Dict[str, Any] = dict(zip(stored, table.columns))
        for position, field in enumerate(self.partition_schema):
            if field.name in columns:
                value = pa.scalar(self.partition_values[index][position], type=field.type)
                arrays[field.name] = pa.repeat(value, rows)
        return pa.table([arrays[c] for c in columns], names=list(columns))

    def table_schema(self, physical: pa.Schema) -> pa.Schema:
        """A file's schema in the table's names, with the partition columns (the log's types)."""
        names = dict((p, n) for n, p in self.columns)
        partitions = set(self.partitions)
        fields = []
        for field in physical:
            name = names.get(field.name) if self.columns else field.name
            if name is not None and name not in partitions:
                fields.append(field.with_name(name))
        return pa.schema(fields + list(self.partition_schema))

    def check_file(self, physical: pa.Schema, columns: Iterable[str], file_url: str) -> None:
        """Raises DataError when a column mapped by id is stored under its physical name with
        another field id in this file (sparkdl reads by name: it would read another column)."""
        ids = dict(self.field_ids)
        for column in columns:
            if column not in ids or column in self.partitions:
                continue
            index = physical.get_field_index(self.physical(column))
            stored = (physical.field(index).metadata or {}).get(_FIELD_ID) if index >= 0 else None
            if stored is not None and int(stored) != ids[column]:
                raise DataError(
                    f"file {file_url!r} stores field id {int(stored)} under the physical name {self.physical(column)!r} "
                    f"of column {column!r}, whose field id is {ids[column]}: its columns are mapped by id in a way "
                    f"sparkdl does not read; read the table with a Spark session that has Delta and pass the DataFrame"
                )

    def check_partitions_not_null(self, index: int, roles: Dict[str, str], file_url: str) -> None:
        """Raises DataError when a column with a role (``roles``: column -> "feature"...) is a
        partition column whose value for file ``index``, so for its every row, is null."""
        values = dict(zip(self.partitions, self.partition_values[index])) if self.partition_values else {}
        for name in (c for c in roles if c in values and values[c] is None):
            raise DataError(
                f"{roles[name]} column {name!r} is null for every row of file {file_url!r} (its partition value in "
                f"the table's log); leave its rows out with filters=pyarrow.compute.field({name!r}).is_valid()"
            )

    def pushdown(self, index: int, physical: pa.Schema) -> Optional[Tuple[Any, pa.Schema]]:
        """What lets pyarrow skip file ``index``'s row groups by a filter in the table's names:
        its partition values as an expression, and the schema to bind the filter to. None when
        a table name is also another column's physical name in the file: the row groups'
        statistics would then be another column's, so nothing is skipped."""
        import pyarrow.compute as pc

        schema = self.table_schema(physical)
        if self.columns:
            own = {n for n, p in self.columns if n == p}
            if any(name in physical.names and name not in own for name in schema.names):
                return None
        expression = pc.scalar(True)
        for field, value in zip(self.partition_schema, self.partition_values[index] if self.partition_values else ()):
            column = pc.field(field.name)
            expression &= column.is_null() if value is None else column == pa.scalar(value, type=field.type)
        return expression, schema


def deleted_bytes(rows: Iterable[int]) -> bytes:
    """A file's deleted row indexes (within it) in :attr:`TableLayout.deleted`'s form."""
    rows = np.unique(np.asarray(list(rows) if not isinstance(rows, np.ndarray) else rows, dtype=np.int64))
    if len(rows) and (rows[0] < 0 or rows[-1] >= 1 << 32):
        raise ValueError(f"row indexes within a file are in [0, 2**32), got {int(rows[0])}..{int(rows[-1])}")
    return rows.astype("<u4").tobytes()
