"""The input of a predict job as stable parts that the tasks read themselves (as training reads
its shards): no Spark scan, so a part is the same rows in every run and a rerun can tell which
parts an earlier run already wrote.

A part is a run of consecutive row groups of one Parquet file, up to about
:data:`TARGET_BYTES` (on disk) or :data:`TARGET_ROWS`: a big file splits into several parts, a
small file is one part (the job packs several small parts into one task). Its ``part_id`` comes
from the file's path relative to the dataset's root and the row-group range, after an ordinal
that keeps the parts (and the files named after them) in the dataset's order.

Hive-style partition directories (``root/year=2024/day=01/part-0.parquet``) are supported as
Spark reads them: each ``key=value`` becomes a column after the file's columns, typed as Spark
infers it (int, bigint, double, date, else string; ``__HIVE_DEFAULT_PARTITION__`` is null).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import os
import re
import urllib.parse
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sparkdl.errors import DataError
from sparkdl.filesystem import child_url, is_url, open_url

#: About how much Parquet (compressed, as stored) one part holds: Spark's maxPartitionBytes.
TARGET_BYTES = 128 * 1024 * 1024
#: At most about this many rows in one part (whole row groups: one bigger group is one part).
TARGET_ROWS = 1_000_000
#: Rows in one record batch that :func:`read_part` yields.
DEFAULT_BATCH_ROWS = 8192

_NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
_PARTITION_TYPES = {"int32": pa.int32(), "int64": pa.int64(), "double": pa.float64(), "date32": pa.date32()}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclasses.dataclass(frozen=True)
class InputPart:
    """Consecutive row groups of one Parquet file: what one part of a predict job reads.

    Attributes:
        part_id: stable name of the part (the same data gives the same ids in every run).
        url: the file's URL (it keeps the dataset URL's scheme, host and query), for messages.
        row_groups: the file's row groups this part reads, in order.
        rows: how many rows they hold.
        path: the file's path relative to the dataset's root (its name for a single file).
        file_bytes: the file's size.
        partitions: ``(column, type, value)`` of each ``key=value`` directory above the file:
            the value as written (unquoted), None for a null; the type is ``int32``, ``int64``,
            ``double``, ``date32`` or ``string``, the same for every part of a dataset.
        root_url: the dataset's URL; the file is opened as ``path`` under it (a file URL would
            turn a directory named ``k=a%2Fb``, as Spark escapes ``a/b``, into ``k=a/b``).
    """

    part_id: str
    url: str
    row_groups: Tuple[int, ...]
    rows: int
    path: str = ""
    file_bytes: int = 0
    partitions: Tuple[Tuple[str, str, Optional[str]], ...] = ()
    root_url: str = ""


@dataclasses.dataclass(frozen=True)
class _File:
    path: str
    relative: str
    size: int


def list_parts(
    spark: Any, data: str, target_bytes: int = TARGET_BYTES, target_rows: int = TARGET_ROWS
) -> List[InputPart]:
    """The parts of a Parquet dataset, reading only file listings and footers (on the driver).

    Args:
        spark: the session, to resolve a catalog table name (None: ``data`` must be a path).
        data: a Parquet file or directory (path or URL), or a table in the session's catalog
            that is stored as Parquet. Names starting with ``_`` or ``.`` are not data, as for
            Spark (``_SUCCESS``, ``.crc`` files, ``_temporary/``).
        target_bytes: about how many stored bytes one part holds.
        target_rows: about how many rows one part holds.

    Returns:
        The parts in the dataset's order (files sorted by path, row groups in file order). A
        dataset whose files hold no rows gives one empty part, which still has the columns.

    Raises:
        DataError: nothing at ``data``, no Parquet files, a file that is not Parquet, files
            whose columns differ, a Delta table or a catalog table that is not Parquet,
            inconsistent partition directories. The message names the file or table.
    """
    url = resolve_data(spark, data)
    url, fs, root = open_url(url, "data")
    files = _data_files(fs, root, url)
    footers = _read_footers(fs, files, url)
    _check_same_columns(files, footers, url)
    partitions = _partition_values(files, footers[0].schema.to_arrow_schema(), url)
    parts: List[InputPart] = []
    for file, footer in zip(files, footers):
        for groups, rows in _group_row_groups(footer, target_bytes, target_rows):
            if not rows and (parts or file is not files[-1]):
                continue  # an empty file adds nothing, unless the whole dataset is empty
            first, last = (groups[0], groups[-1]) if groups else (0, -1)
            digest = hashlib.sha256(f"{file.relative}\0{first}-{last}".encode()).hexdigest()[:12]
            parts.append(
                InputPart(
                    part_id=f"{len(parts):05d}-{digest}",
                    url=child_url(url, root, file.path),
                    row_groups=groups,
                    rows=rows,
                    path=file.relative,
                    file_bytes=file.size,
                    partitions=partitions[file.relative],
                    root_url=url,
                )
            )
    return parts


def read_part(
    part: InputPart, columns: Optional[Sequence[str]] = None, batch_rows: int = DEFAULT_BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """The rows of ``part`` as record batches of at most ``batch_rows`` rows, in file order
    (on an executor: the file is opened there through :func:`sparkdl.filesystem.open_url`).

    Args:
        part: the part to read.
        columns: the columns to read, in this order (None: all, partition columns last).
        batch_rows: at most this many rows per batch.
    """
    names = [name for name, _, _ in part.partitions]
    file_columns = None if columns is None else [c for c in columns if c not in names]
    fs, path = _open(part)
    if not part.row_groups:
        return
    with fs.open_input_file(path) as handle:
        reader = pq.ParquetFile(handle)
        for batch in reader.iter_batches(batch_rows, row_groups=list(part.row_groups), columns=file_columns):
            arrays = dict(zip(batch.schema.names, batch.columns))
            for name, type_name, value in part.partitions:
                arrays[name] = pa.array([_typed(value, type_name)] * batch.num_rows, _arrow_type(type_name))
            order = list(columns) if columns is not None else list(arrays)
            yield pa.RecordBatch.from_arrays([arrays[c] for c in order], names=order)


def part_schema(part: InputPart) -> pa.Schema:
    """The columns :func:`read_part` yields for ``part`` (every part of a dataset has the same)."""
    fs, path = _open(part)
    with fs.open_input_file(path) as handle:
        schema = pq.read_schema(handle)
    for name, type_name, _ in part.partitions:
        schema = schema.append(pa.field(name, _arrow_type(type_name)))
    return schema


def _open(part: InputPart) -> Tuple[pafs.FileSystem, str]:
    """The filesystem and path of the part's file."""
    if not part.root_url or part.root_url == part.url:
        return open_url(part.url, "input part")[1:]
    _, fs, root = open_url(part.root_url, "data")
    return fs, f"{root.rstrip('/')}/{part.path}"


def data_fingerprint(parts: Sequence[InputPart]) -> str:
    """Which data the parts are: each part's id, file (path relative to the root, size) and row
    groups and rows. A job resumed onto data with another fingerprint would mix two datasets."""
    digest = hashlib.sha256()
    for part in parts:
        groups = ",".join(map(str, part.row_groups))
        digest.update(f"{part.part_id}\0{part.path}\0{part.file_bytes}\0{groups}\0{part.rows}\n".encode())
    return digest.hexdigest()[:20]


def resolve_data(spark: Any, data: str) -> str:
    """The Parquet location of ``data``: a path or URL as it is, a catalog table's location.

    A name with no ``/`` that is no local file or directory is looked up as a table."""
    if not isinstance(data, str) or not data:
        raise DataError(f"data must be a Parquet path or URL or a table name, got {data!r}")
    if is_url(data) or "/" in data or os.sep in data or os.path.exists(data):
        return data
    if spark is None or not spark.catalog.tableExists(data):
        raise DataError(f"no Parquet file or directory at {data!r}, and no table {data!r} in the Spark catalog")
    from sparkdl.connectors.spark_table import SparkTable

    details = SparkTable(data).describe(spark)
    provider, kind = details.get("Provider", "").lower(), details.get("Type", "").upper()
    hive_parquet = provider == "hive" and "parquet" in details.get("Serde Library", "").lower()
    if kind not in ("MANAGED", "EXTERNAL") or not details.get("Location"):
        raise DataError(
            f"table {data!r} is a {kind.lower() or 'view'} with no files of its own: predict reads a table's "
            f"Parquet files in place; write it as a Parquet table, or pass a DataFrame to TorchModel.transform"
        )
    if provider != "parquet" and not hive_parquet:
        raise DataError(
            f"table {data!r} is stored as {provider or 'an unknown format'}, not Parquet: predict reads a table's "
            f"Parquet files in place; pass spark.table({data!r}) to TorchModel.transform instead"
        )
    return details["Location"]


def _data_files(fs: pafs.FileSystem, root: str, url: str) -> List[_File]:
    """The data files under ``root`` (or the file itself), sorted by path as Spark lists them."""
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"no Parquet file or directory at {url!r}")
    if info.type == pafs.FileType.File:
        return [_File(root, root.rstrip("/").rsplit("/", 1)[-1], info.size)]
    if fs.get_file_info(f"{root.rstrip('/')}/_delta_log").type == pafs.FileType.Directory:
        raise DataError(
            f"{url!r} is a Delta table: its directory also holds Parquet files the table no longer has. "
            f"Pass spark.read.format('delta').load(...) to TorchModel.transform instead"
        )
    prefix = root.rstrip("/") + "/"
    files = []
    for found in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        relative = found.path[len(prefix) :] if found.path.startswith(prefix) else found.path
        if found.type == pafs.FileType.File and not any(n.startswith(("_", ".")) for n in relative.split("/")):
            files.append(_File(found.path, relative, found.size))
    if not files:
        raise DataError(f"{url!r} holds no Parquet files")
    return sorted(files, key=lambda f: f.relative.split("/"))


def _read_footers(fs: pafs.FileSystem, files: Sequence[_File], url: str) -> List[pq.FileMetaData]:
    """Every file's footer, read by a few threads (an object store answers each in a round trip)."""

    def footer(file: _File) -> pq.FileMetaData:
        try:
            with fs.open_input_file(file.path) as handle:
                return pq.read_metadata(handle)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{file.relative!r} in {url!r} is not a readable Parquet file: {exc}") from exc

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        return list(pool.map(footer, files))


def _check_same_columns(files: Sequence[_File], footers: Sequence[pq.FileMetaData], url: str) -> None:
    """Every file has the first one's columns and types (Spark would silently read one file's)."""
    first = footers[0].schema.to_arrow_schema()
    for file, footer in zip(files[1:], footers[1:]):
        schema = footer.schema.to_arrow_schema()
        if [(f.name, f.type) for f in schema] != [(f.name, f.type) for f in first]:
            raise DataError(
                f"the files of {url!r} do not have the same columns: {files[0].relative!r} has "
                f"{_describe(first)}, {file.relative!r} has {_describe(schema)}; rewrite them with one schema"
            )


def _describe(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name} {f.type}" for f in schema) + ")"


def _group_row_groups(
    footer: pq.FileMetaData, target_bytes: int, target_rows: int
) -> Iterator[Tuple[Tuple[int, ...], int]]:
    """(row groups, rows) of each part of one file: consecutive row groups until the next one
    would pass either target. A file with no row groups gives one empty part."""
    groups: List[int] = []
    rows = size = 0
    for index in range(footer.num_row_groups):
        group = footer.row_group(index)
        stored = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        if groups and (size + stored > target_bytes or rows + group.num_rows > target_rows):
            yield tuple(groups), rows
            groups, rows, size = [], 0, 0
        groups.append(index)
        rows, size = rows + group.num_rows, size + stored
    if groups or footer.num_row_groups == 0:
        yield tuple(groups), rows


def _partition_values(
    files: Sequence[_File], schema: pa.Schema, url: str
) -> Dict[str, Tuple[Tuple[str, str, Optional[str]], ...]]:
    """Each file's partition columns from its ``key=value`` directories, typed over all files."""
    found: Dict[str, List[Tuple[str, Optional[str]]]] = {}
    for file in files:
        pairs = [d.split("=", 1) for d in file.relative.split("/")[:-1] if "=" in d]
        found[file.relative] = [
            (urllib.parse.unquote(k), None if v == _NULL_PARTITION else urllib.parse.unquote(v)) for k, v in pairs
        ]
    keys = [k for k, _ in found[files[0].relative]]
    for file in files:
        if [k for k, _ in found[file.relative]] != keys:
            raise DataError(
                f"the files of {url!r} are not under the same partition directories: {files[0].relative!r} "
                f"and {file.relative!r} (Spark refuses such a layout too); give one partition's directory, "
                f"or move the files"
            )
    clash = sorted(set(keys) & set(schema.names))
    if clash:
        raise DataError(f"partition column(s) {clash} of {url!r} are also columns of its files; rename one of them")
    types = {k: _infer_type([dict(found[f.relative])[k] for f in files]) for k in keys}
    return {name: tuple((k, types[k], v) for k, v in pairs) for name, pairs in found.items()}


def _infer_type(values: Sequence[Optional[str]]) -> str:
    """Spark's partition type inference, narrowed: int, bigint, double, date, else string."""
    present = [v for v in values if v is not None]
    for type_name, accepts in (
        ("int32", lambda v: re.fullmatch(r"[-+]?\d+", v) and -(2**31) <= int(v) < 2**31),
        ("int64", lambda v: re.fullmatch(r"[-+]?\d+", v) and -(2**63) <= int(v) < 2**63),
        ("double", _is_float),
        ("date32", lambda v: _DATE.match(v) and _is_date(v)),
    ):
        if present and all(accepts(v) for v in present):
            return type_name
    return "string"


def _is_float(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _is_date(value: str) -> bool:
    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        return False
    return True


def _arrow_type(type_name: str) -> pa.DataType:
    return _PARTITION_TYPES.get(type_name, pa.string())


def _typed(value: Optional[str], type_name: str) -> Any:
    if value is None or type_name == "string":
        return value
    if type_name in ("int32", "int64"):
        return int(value)
    if type_name == "double":
        return float(value)
    return datetime.date.fromisoformat(value)
