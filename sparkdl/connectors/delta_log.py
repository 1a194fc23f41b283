"""A Delta table version's files and what its log says about them, read through delta-rs.

The log names a version's Parquet files and, beside them, what their Parquet alone does not say:
each file's partition values (typed by the table's schema, nulls included), the physical names of
its columns under column mapping, and the rows its deletion vector deletes. :func:`in_place` turns
that into the file list and :class:`~sparkdl.data.table_layout.TableLayout` the readers read in
place, or says why this table version cannot be read that way.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import numpy as np
import pyarrow as pa

from sparkdl.data.dataset import ParquetFiles
from sparkdl.data.table_layout import TableLayout, deleted_bytes
from sparkdl.errors import DataError
from sparkdl.filesystem import normalize_url

#: Reader features whose meaning sparkdl reads in place (column mapping, deletion vectors) or
#: that do not change which rows and values the files hold (column types the inputs check
#: anyway; log formats delta-rs reads). A table with another one is read by Spark or copied.
IN_PLACE_FEATURES = frozenset(
    {
        "columnMapping",
        "deletionVectors",
        "timestampNtz",
        "v2Checkpoint",
        "vacuumProtocolCheck",
        "variantType",
        "variantType-preview",
    }
)
#: Deleted rows sent to every task (4 bytes each) beyond which the table version is copied.
MAX_DELETED_ROWS = 1 << 24
_PHYSICAL = "delta.columnMapping.physicalName"
_FIELD_ID = "delta.columnMapping.id"


class NotInPlace(Exception):
    """This table version cannot be read in place; the message says why."""


def in_place(table: Any, columns: List[str], description: str) -> ParquetFiles:
    """The files of ``table`` (a loaded ``deltalake.DeltaTable``) to read in place, in a fixed
    order (sorted: the log's order depends on how it was replayed, sharding wants a fixed one).

    Raises:
        NotInPlace: a reader feature sparkdl does not read in place, a needed nested column
            whose fields column mapping renames, deletion vectors this deltalake cannot hand
            out, or more deleted rows than ``MAX_DELETED_ROWS``.
        DataError: the version has no data files.
    """
    features = set(table.protocol().reader_features or ())
    unknown = sorted(features - IN_PLACE_FEATURES)
    if unknown:
        raise NotInPlace(f"its reader feature(s) {', '.join(unknown)} are not read in place")
    root = normalize_url(table.table_uri).rstrip("/")
    actions = pa.table(table.get_add_actions(flatten=False))
    urls = [_file_url(root, path) for path in actions.column("path").to_pylist()]
    if not urls:
        raise DataError(f"{description} has no data files")
    columns_mapped, field_ids = _column_mapping(table, columns)
    partition_schema, values = _partition_values(table, actions)
    deleted = _deleted_rows(table, urls) if "deletionVectors" in features else {}
    order = sorted(range(len(urls)), key=lambda i: urls[i])
    layout = TableLayout(
        columns=columns_mapped,
        field_ids=field_ids,
        partition_schema=partition_schema,
        partition_values=tuple(values[i] for i in order) if len(partition_schema) else (),
        deleted=tuple(deleted.get(urls[i], b"") for i in order) if deleted else (),
    )
    plain = not columns_mapped and not len(partition_schema) and not deleted
    return ParquetFiles(
        url=root,
        files=tuple(urls[i] for i in order),
        description=description,
        layout=None if plain else layout,
    )


def _file_url(root: str, path: str) -> str:
    """A file's URL from its ``add.path``: a URI-encoded path relative to the table's root, or an
    absolute URI (a shallow clone's). It stays encoded, as sparkdl's file URLs are."""
    if "://" in path or path.startswith("file:/"):
        return normalize_url(path)
    return f"{root}/{path}"


def _column_mapping(table: Any, needed: List[str]) -> Tuple[Tuple[Tuple[str, str], ...], Tuple[Tuple[str, int], ...]]:
    """(table name, physical name) of every column, and their field ids under mode ``id``;
    empty without column mapping."""
    mode = _mapping_mode(table)
    if mode not in ("name", "id"):
        return (), ()
    fields = json.loads(table.schema().to_json())["fields"]
    for field in fields:
        if field["name"] in needed and _renames_nested(field["type"]):
            raise NotInPlace(
                f"column mapping renames the fields inside column {field['name']!r}, which sparkdl reads in place only "
                f"for top-level columns"
            )
    columns = tuple((f["name"], f.get("metadata", {}).get(_PHYSICAL, f["name"])) for f in fields)
    ids = tuple((f["name"], int(f["metadata"][_FIELD_ID])) for f in fields if _FIELD_ID in f.get("metadata", {}))
    return columns, ids if mode == "id" else ()


def _mapping_mode(table: Any) -> str:
    """The column mapping mode in effect: the table's ``delta.columnMapping.mode``, where the
    protocol enables the feature (reader version 2, or 3 with ``columnMapping`` among its reader
    features). A mode set without it is not in effect: the files use the table's names (delta-rs
    writes such tables when asked for column mapping and deletion vectors together)."""
    protocol = table.protocol()
    enabled = protocol.min_reader_version == 2 or (
        protocol.min_reader_version >= 3 and "columnMapping" in (protocol.reader_features or ())
    )
    return (table.metadata().configuration or {}).get("delta.columnMapping.mode", "none") if enabled else "none"


def _renames_nested(data_type: Any) -> bool:
    """Whether a Delta schema type holds struct fields whose physical names differ."""
    if not isinstance(data_type, dict):
        return False
    if data_type.get("type") == "struct":
        return any(
            f.get("metadata", {}).get(_PHYSICAL, f["name"]) != f["name"] or _renames_nested(f["type"])
            for f in data_type["fields"]
        )
    return any(_renames_nested(data_type.get(key)) for key in ("elementType", "keyType", "valueType"))


def _partition_values(table: Any, actions: pa.Table) -> Tuple[pa.Schema, List[Tuple[Any, ...]]]:
    """The partition columns (typed as delta-rs types them by the table's schema) and each
    file's values of them (None for null), in the add actions' order."""
    names = list(table.metadata().partition_columns)
    if not names:
        return pa.schema([]), []
    struct_name = next((n for n in ("partition", "partition_values") if n in actions.column_names), None)
    if struct_name is None:  # pragma: no cover - a deltalake that lists no partition values
        raise NotInPlace("this deltalake does not list the files' partition values")
    struct = actions.column(struct_name).combine_chunks()
    fields = {struct.type.field(i).name: i for i in range(struct.type.num_fields)}
    missing = [n for n in names if n not in fields]
    if missing:  # pragma: no cover - delta-rs lists every partition column
        raise NotInPlace(f"delta-rs lists no values of partition column(s) {', '.join(missing)}")
    schema = pa.schema([pa.field(n, struct.type.field(fields[n]).type) for n in names])
    columns = [struct.field(fields[n]).to_pylist() for n in names]
    return schema, list(zip(*columns))


def _deleted_rows(table: Any, urls: List[str]) -> Dict[str, bytes]:
    """Each file's deleted row indexes (:attr:`TableLayout.deleted` form), from the deletion
    vectors delta-rs reads, by file URL."""
    if not hasattr(table, "deletion_vectors"):
        import deltalake

        raise NotInPlace(
            f"reading its deletion vectors in place needs deltalake>=1.4.2 (this is {deltalake.__version__})"
        )
    try:
        batches = [pa.record_batch(batch) for batch in table.deletion_vectors()]
    except Exception as exc:  # noqa: BLE001 - delta-rs's errors: a vector it cannot read or that does not fit
        raise NotInPlace(f"delta-rs cannot read its deletion vectors: {exc}") from exc
    known = set(urls)
    deleted: Dict[str, bytes] = {}
    total = 0
    for batch in batches:
        paths = batch.column("filepath").to_pylist()
        vectors = batch.column("selection_vector")
        for row, path in enumerate(paths):
            url = normalize_url(path)
            if url not in known:
                raise DataError(f"delta-rs gave a deletion vector for {path!r}, which is not a file of this version")
            keep = np.asarray(vectors[row].values.to_numpy(zero_copy_only=False), dtype=bool)
            rows = np.flatnonzero(~keep)
            total += len(rows)
            if total > MAX_DELETED_ROWS:
                raise NotInPlace(f"it has more than {MAX_DELETED_ROWS} deleted rows, too many to send to every task")
            if len(rows):
                deleted[url] = deleted_bytes(rows)
    return deleted
