"""Real Delta tables with the features production tables have, for the Delta tests.

:func:`production_table` writes, with delta-rs, a table partitioned by typed columns (an int, a
long, a string whose values need escaping in paths, a string with nulls), with column mapping
(physical column names ``col-<uuid>``), files of several row groups, then enables deletion
vectors and deletes rows in two commits (:mod:`tests.delta_protocol`): a file's rows across its
row groups, a whole file's rows, a vector inline in the log, one in a prefixed directory, and a
second delete that grows an earlier vector.

:func:`table_rows` is what the table holds according to delta-rs's own DataFusion scan, which
reads the deletion vectors and the column mapping itself: the reference the tests compare
sparkdl's rows with. The tests also check it against the rows they meant to delete.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Set, Tuple

import deltalake
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# delta-rs hands deletion vectors out (DeltaTable.deletion_vectors) from 1.4.2 on.
if tuple(int(p) for p in deltalake.__version__.split(".")[:3]) < (1, 4, 2):
    raise ImportError(
        f"the Delta tests need deltalake>=1.4.2 (scripts/stacks/*.txt pin it), not {deltalake.__version__}"
    )

from deltalake import DeltaTable, QueryBuilder, WriterProperties, write_deltalake  # noqa: E402

from tests.delta_protocol import active_files, delete_rows, enable_deletion_vectors

#: (id, label, shard, day, region): what a row of a production table is, partition values included.
Row = Tuple[int, int, int, str, object]
PARTITIONS = ["label", "shard", "day", "region"]
#: The values of ``day``: characters a partition directory must escape (space, colon, slash, percent).
DAYS = ["2024-05-01 10:00", "a b/c%d"]


def rows_table(ids: np.ndarray) -> pa.Table:
    """Rows ``ids``: ``features`` = [id, -id] (float32), ``id``, and the partition columns
    ``label`` = id % 2 (long), ``shard`` = id % 3 (int), ``day`` (strings a path must escape)
    and ``region`` ("eu" or null)."""
    ids = np.asarray(ids, dtype=np.int64)
    return pa.table(
        {
            "features": pa.array(list(np.stack([ids, -ids], 1).astype(np.float32)), type=pa.list_(pa.float32())),
            "id": ids,
            "label": ids % 2,
            "shard": pa.array(ids % 3, pa.int32()),
            "day": pa.array(np.array(DAYS)[(ids // 2) % 2]),
            "region": pa.array([None if i % 5 == 0 else "eu" for i in ids], pa.string()),
        }
    )


@dataclasses.dataclass
class ProductionTable:
    path: str
    written: Set[int]
    deleted: Set[int]

    @property
    def live(self) -> Set[int]:
        return self.written - self.deleted


def production_table(path: str, mapping: str = "name") -> ProductionTable:
    """See the module docstring; ``mapping``: the column mapping mode (``name``, ``id``, ``none``)."""
    properties = WriterProperties(max_row_group_size=8)
    configuration = {"delta.columnMapping.mode": mapping} if mapping != "none" else None
    write_deltalake(
        path,
        rows_table(np.arange(400)),
        partition_by=PARTITIONS,
        configuration=configuration,
        writer_properties=properties,
    )
    write_deltalake(
        path, rows_table(np.arange(1000, 1100)), mode="append", partition_by=PARTITIONS, writer_properties=properties
    )
    enable_deletion_vectors(path)
    files = file_ids(path)
    big = sorted((p for p, ids in files.items() if len(ids) > 10), key=lambda p: (-len(files[p]), p))
    first = {
        big[0]: list(range(2, len(files[big[0]]), 3)),  # across every row group of the file
        big[1]: list(range(len(files[big[1]]))),  # the whole file
        big[2]: [0, 9],
    }
    delete_rows(path, first, prefix="dv")
    delete_rows(path, {big[3]: [4]}, inline=True)
    delete_rows(path, {big[2]: [0, 9, 1, len(files[big[2]]) - 1]})  # grows the earlier vector
    deleted = {
        files[p][r]
        for p, rows in {**first, big[3]: [4], big[2]: [0, 9, 1, len(files[big[2]]) - 1]}.items()
        for r in rows
    }
    written = set(range(400)) | set(range(1000, 1100))
    return ProductionTable(path, written, deleted)


def file_ids(path: str) -> Dict[str, List[int]]:
    """The ``id`` of every row of every active file, in file order, by the file's log path
    (read from the Parquet under the id column's physical name)."""
    schema = json.loads(DeltaTable(path).schema().to_json())
    physical = next(f for f in schema["fields"] if f["name"] == "id")["metadata"].get(
        "delta.columnMapping.physicalName", "id"
    )
    out = {}
    for log_path in active_files(path):
        local = os.path.join(path, *[_unquote(part) for part in log_path.split("/")])
        out[log_path] = pq.read_table(local, columns=[physical]).column(0).to_pylist()
    return out


def _unquote(part: str) -> str:
    import urllib.parse

    return urllib.parse.unquote(part)


def table_rows(path: str, version: Optional[int] = None) -> List[Row]:
    """Every row of the table version as delta-rs's DataFusion scan reads it, sorted. The strings
    come back as codes: DataFusion hands strings out as view types, which pyarrow 14 (the
    Petastorm stack's) cannot import."""
    days = {code: day for code, day in enumerate(DAYS)}
    cases = " ".join(f"WHEN '{day}' THEN {code}" for code, day in days.items())
    query = f"SELECT id, label, shard, CASE day {cases} END AS day, region IS NULL AS no_region FROM t"
    data = pa.table(QueryBuilder().register("t", DeltaTable(path, version=version)).execute(query)).to_pydict()
    return sorted(
        (i, label, shard, days[day], None if no_region else "eu")
        for i, label, shard, day, no_region in zip(
            data["id"], data["label"], data["shard"], data["day"], data["no_region"]
        )
    )
