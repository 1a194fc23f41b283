"""Driver-side view of the training data: where it is, what it holds, and whether it is usable.

Everything here runs on the driver and touches only Parquet footers (row counts, schemas), never
rows, so it is cheap even for large datasets. The result, :class:`DatasetInfo`, is small and
picklable and travels to the tasks, which stream the rows themselves.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import pyarrow as pa
import pyarrow.fs as pafs

from sparkdl.data.columns import ColumnInfo
from sparkdl.data.petastorm_schema import petastorm_schema, unischema_column
from sparkdl.data.plan import InputPlan
from sparkdl.data.table_layout import TableLayout
from sparkdl.data.tensor_bytes import packed_columns
from sparkdl.errors import DataError
from sparkdl.filesystem import child_url, file_paths, normalize_url, open_url


class EmptyDatasetError(DataError):
    """The dataset holds no rows (or no Parquet files at all)."""


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One Parquet file of a dataset: its URL, the row count of each of its row groups, and their
    uncompressed bytes of the columns the run reads (the shard cache's estimate; empty when unknown)."""

    url: str
    row_groups: Tuple[int, ...]
    row_group_bytes: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ParquetFiles:
    """Parquet to train on, as a connector resolves it: a directory URL, or explicit files.

    Args:
        url: the dataset's directory URL (or, with ``files``, a URL naming the source in messages).
        files: file URLs to read, in this order; empty means every Parquet file under ``url``.
        description: what this is (``"Delta table s3://... version 3"``), for messages.
        layout: what the table says about ``files`` beyond their Parquet (renamed columns,
            partition values, deleted rows: :mod:`sparkdl.data.table_layout`); None: nothing.
    """

    url: str
    files: Tuple[str, ...] = ()
    description: str = ""
    layout: Optional[TableLayout] = None

    def __post_init__(self) -> None:
        if self.layout is not None and not self.files:
            raise ValueError("a table layout describes explicit files: pass files= with it")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A validated Parquet or Petastorm dataset, as the tasks need to know it."""

    url: str
    num_rows: int
    num_row_groups: int
    #: True when the dataset carries a Petastorm Unischema (read with ``make_reader``).
    is_petastorm: bool
    #: How batches are built from the columns (model inputs and label).
    plan: InputPlan
    #: Every column the plan reads, by name.
    column_info: Tuple[ColumnInfo, ...]
    #: The Parquet files in reading order (Petastorm's: sorted paths, or a connector's list),
    #: with their row groups' row counts: the global row-group index that decides a row
    #: group's rank, and every row's position, come from this list.
    files: Tuple[FileInfo, ...] = ()
    #: True when the files were given explicitly (a connector's list) instead of listed from ``url``.
    explicit_files: bool = False
    #: Columns the row filter reads (which may include feature and label columns).
    filter_columns: Tuple[str, ...] = ()
    #: What the user passed when the files are sparkdl's own copy of it ("the DataFrame"):
    #: messages then name it instead of the copy's internal path. Empty for data read in place.
    origin: str = ""
    #: Renamed columns, partition values and deleted rows of a table's files
    #: (:mod:`sparkdl.data.table_layout`); None for plain Parquet. ``num_rows`` counts the rows
    #: that are not deleted; positions index every row of the files.
    layout: Optional[TableLayout] = None

    @property
    def columns(self) -> List[str]:
        return self.plan.columns

    @property
    def infos(self) -> Dict[str, ColumnInfo]:
        return {c.name: c for c in self.column_info}

    def locate(self, position: Optional[int]) -> str:
        """Where the row at ``position`` (in the dataset's file order) is: row, row group, file."""
        found = self._find(position)
        if self.origin:
            return f"row {position} of {self.origin}" if found else self.origin
        return f"row {found[0]} of row group {found[1]} of file {found[2]!r}" if found else f"dataset {self.url!r}"

    def row_group_of(self, position: int) -> str:
        """The row group and file that hold the row at ``position``."""
        found = self._find(position)
        if self.origin:
            return self.origin
        return f"row group {found[1]} of file {found[2]!r}" if found else f"dataset {self.url!r}"

    @property
    def name(self) -> str:
        """The dataset in the user's terms: what they passed, or its URL."""
        return self.origin or f"dataset {self.url!r}"

    def _find(self, position: Optional[int]) -> Optional[Tuple[int, int, str]]:
        if position is None:
            return None
        start = 0
        for file in self.files:
            for group, rows in enumerate(file.row_groups):
                if position < start + rows:
                    return position - start, group, file.url
                start += rows
        return None

    @property
    def fingerprint(self) -> str:
        """Which rows the stream's positions index: the files in reading order (named relative to
        the dataset's URL, so a moved copy still matches) and their row groups' row counts. A
        checkpoint records it; a resume on data with another fingerprint does not replay the
        old positions (sparkdl._runtime.resume). A DataFrame materialized again has new file names
        (Spark's write job id is in them), so its copy never matches an earlier one: Spark does
        not promise the same rows in the same order twice."""
        digest = hashlib.sha256()
        base = self.url.rstrip("/") + "/"
        for file in self.files:
            name = file.url[len(base) :] if file.url.startswith(base) else file.url
            digest.update(f"{name}\0{','.join(map(str, file.row_groups))}\n".encode())
        if not self.files:
            digest.update(f"{self.url}\0{self.num_rows}\0{self.num_row_groups}".encode())
        if self.layout is not None:
            digest.update(self.layout.fingerprint())
        return digest.hexdigest()[:20]

    @property
    def row_group_bytes(self) -> List[int]:
        """Every row group's uncompressed bytes of the columns the run reads (less those the shard
        cache keeps in another form: :meth:`InputPlan.kept_row_bytes`), in global order; empty
        when a file's footers were not read for it (a dataset described by hand)."""
        if not self.files or any(len(f.row_group_bytes) != len(f.row_groups) for f in self.files):
            return []
        return [size for f in self.files for size in f.row_group_bytes]

    @property
    def row_group_rows(self) -> List[int]:
        """Row count of every row group, in global row-group order."""
        return [rows for f in self.files for rows in f.row_groups]

    def row_group_location(self) -> List[Tuple[int, int]]:
        """(file index, row group index within the file) of every global row group."""
        return [(i, g) for i, f in enumerate(self.files) for g in range(len(f.row_groups))]


Filters = Any  # pyarrow's DNF list of (column, op, value) tuples, or a pyarrow.compute.Expression


def inspect_dataset(
    data: Union[str, ParquetFiles],
    feature_cols: Union[Sequence[str], "InputPlan"],
    label_col: Optional[str] = None,
    filters: Filters = None,
) -> DatasetInfo:
    """Validates a dataset against the columns to train on, reading only metadata.

    Args:
        data: a dataset URL or path (a directory of Parquet files, or one file), or the
            :class:`ParquetFiles` a connector resolved.
        feature_cols: feature columns (with ``label_col``), or the run's
            :class:`~sparkdl.data.plan.InputPlan`.
        label_col: label column, or None (ignored with a plan).
        filters: the row filter the readers will apply; its columns are checked too.

    Raises:
        DataError: the path does not exist, a file is unreadable, a column is missing or of a
            type its input cannot use, files disagree on a column's type, a column holds nulls
            (from the footers' statistics), the filter names an unknown column, or the dataset
            has no rows. The message names the path, file, column and input.
    """
    import pyarrow.dataset as pads  # here, not at the top: it imports pandas, which tasks never need

    plan = feature_cols if isinstance(feature_cols, InputPlan) else InputPlan.from_feature_cols(feature_cols, label_col)
    explicit = isinstance(data, ParquetFiles) and bool(data.files)
    layout = data.layout if isinstance(data, ParquetFiles) else None
    url = normalize_url(data.url if isinstance(data, ParquetFiles) else data)
    if explicit:
        file_urls = [normalize_url(f) for f in data.files]
        _, fs, _ = open_url(file_urls[0], "dataset URL")
        paths = file_paths(fs, file_urls)
        try:
            dataset = pads.dataset(paths, filesystem=fs, format="parquet")
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read the Parquet files of {url!r}: {exc}") from exc
        fragments = list(dataset.get_fragments())
    else:
        _, fs, path = open_url(url, "dataset URL")
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"no dataset at {url!r}: the path does not exist")
        try:
            dataset = pads.dataset(path, filesystem=fs, format="parquet")
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read the Parquet dataset at {url!r}: {exc}") from exc
        # Petastorm (pyarrow's legacy ParquetDataset) reads files sorted by path, directory by
        # directory; both readers use this order, so row group i is the same row group for both.
        fragments = sorted(dataset.get_fragments(), key=lambda f: f.path.split("/"))
        file_urls = [child_url(url, path, f.path) for f in fragments]

    roles = plan.null_roles()
    column_roles = {c: roles.get(c, "input") for c in plan.columns}
    for key, spec in plan.inputs:
        for column in spec.source_columns():
            column_roles[column] = plan.role(key)
    if plan.label_column:
        column_roles[plan.label_column] = "label"
    unischema = petastorm_schema(url, fs, path) if not explicit else None
    # A table's columns: the files' renamed to the table's names, and its partition columns.
    schema = layout.table_schema(dataset.schema) if layout is not None else dataset.schema
    if unischema is not None:
        infos = {c: unischema_column(unischema, c, column_roles[c]) for c in plan.columns}
    else:
        packed = packed_columns(dataset.schema)
        infos = {c: describe_column(schema, c, column_roles[c], url, packed) for c in plan.columns}
    plan.check(infos, f"dataset {url!r}")
    filter_cols = referenced_columns(filters, schema, url) if filters is not None else ()
    checked = list(plan.columns) + [c for c in filter_cols if c not in plan.columns]

    files: List[FileInfo] = []
    reference: Optional[Tuple[str, pa.Schema]] = None
    # The plan's columns by the names the files store them under (under column mapping only
    # those count: another stored name may be another column's table name).
    stored = {layout.physical(c): c for c in plan.columns} if layout is not None and layout.columns else None
    kept = set(plan.columns) - plan.kept_row_bytes()[0]
    for index, (fragment, file_url) in enumerate(zip(fragments, file_urls)):
        try:
            metadata = fragment.metadata
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"unreadable Parquet file {fragment.path!r} in dataset {url!r}: {exc}") from exc
        file_schema = metadata.schema.to_arrow_schema()
        if layout is not None:
            layout.check_file(file_schema, checked, file_url)
            file_schema = layout.table_schema(file_schema)
        if reference is None:
            reference = (file_url, file_schema)
        else:
            _check_same_types(checked, reference, (file_url, file_schema), url)
        if filters is None:
            # Nulls in a filtered-out row are harmless, so this check needs no filter.
            _check_no_nulls(metadata, roles, file_url, stored)
            if layout is not None:
                layout.check_partitions_not_null(index, roles, file_url)
        files.append(
            FileInfo(
                file_url,
                tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)),
                # Columns the shard cache keeps converted (images as pixels) are counted from their
                # rows instead (sparkdl.data.shard_cache.rank_bytes).
                _row_group_bytes(metadata, {p for p, c in (stored or {c: c for c in kept}).items() if c in kept}),
            )
        )
    num_rows = sum(sum(f.row_groups) for f in files)
    num_row_groups = sum(len(f.row_groups) for f in files)
    if layout is not None:
        layout.check_files([sum(f.row_groups) for f in files], file_urls, f"dataset {url!r}")
        num_rows -= layout.deleted_count
    if num_row_groups == 0:
        raise EmptyDatasetError(f"dataset {url!r} holds no Parquet files")
    if num_rows == 0:
        deleted = " that are not deleted" if layout is not None and layout.deleted_count else ""
        raise EmptyDatasetError(f"dataset {url!r} is empty: its Parquet files hold 0 rows{deleted}")
    return DatasetInfo(
        url,
        num_rows,
        num_row_groups,
        unischema is not None,
        plan,
        tuple(infos[c] for c in plan.columns),
        files=tuple(files),
        explicit_files=explicit,
        filter_columns=tuple(filter_cols),
        layout=layout,
    )


def _row_group_bytes(metadata: Any, columns: Set[str]) -> Tuple[int, ...]:
    """Each row group's uncompressed bytes of ``columns`` (nested columns by their top name)."""
    wanted = [i for i in range(metadata.num_columns) if metadata.schema.column(i).path.split(".")[0] in columns]
    return tuple(
        sum(metadata.row_group(g).column(i).total_uncompressed_size for i in wanted)
        for g in range(metadata.num_row_groups)
    )


def _type_key(arrow_type: pa.DataType) -> str:
    """A type's identity for the cross-file check; list element names (Spark's ``element``,
    pyarrow's ``item``) do not matter."""
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return f"list<{_type_key(arrow_type.value_type)}>"
    return str(arrow_type)


def _check_same_types(
    columns: Sequence[str], reference: Tuple[str, pa.Schema], other: Tuple[str, pa.Schema], url: str
) -> None:
    (ref_file, ref_schema), (file, schema) = reference, other
    for name in columns:
        index = schema.get_field_index(name)
        if index < 0:
            raise DataError(
                f"schema mismatch in dataset {url!r}: column {name!r} is missing from file {file!r} "
                f"but present in {ref_file!r}; every file must have the columns to train on"
            )
        expected = ref_schema.field(name).type
        actual = schema.field(index).type
        if _type_key(expected) != _type_key(actual):
            raise DataError(
                f"schema mismatch in dataset {url!r}: column {name!r} is {actual} in file {file!r} but "
                f"{expected} in {ref_file!r}; every file must store a column with the same type"
            )


def _check_no_nulls(
    metadata: Any, roles: Dict[str, str], file_url: str, stored: Optional[Dict[str, str]] = None
) -> None:
    """Null counts from the footer's column statistics (no rows are read). For a list column the
    leaf's count also includes null and empty arrays, which are just as unusable. ``stored``:
    under column mapping, the columns by the names the file stores them under."""
    for g in range(metadata.num_row_groups):
        row_group = metadata.row_group(g)
        for j in range(row_group.num_columns):
            column = row_group.column(j)
            parts = column.path_in_schema.split(".")
            name = stored.get(parts[0]) if stored is not None else parts[0]
            role = roles.get(name) if name is not None else None
            if role is None or column.statistics is None or not column.statistics.has_null_count:
                continue
            nulls = column.statistics.null_count
            if nulls:
                what = "null values, null arrays or empty arrays" if len(parts) > 1 else "null values"
                raise DataError(
                    f"{role} column {name!r} has {nulls} {what} in file {file_url!r} (row group {g}); "
                    f"drop or fill them before training (e.g. df.na.drop(subset=[{name!r}]), or filters=)"
                )


def to_expression(filters: Filters):
    """A ``pyarrow.compute.Expression`` from pyarrow's DNF filters or an expression."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if isinstance(filters, pc.Expression):
        return filters
    try:
        return pq.filters_to_expression(filters)
    except (TypeError, ValueError, pa.ArrowInvalid) as exc:
        raise DataError(
            f"filters={filters!r} is neither a pyarrow.compute expression nor pyarrow's DNF form "
            f"(a list of (column, op, value) tuples, or a list of such lists): {exc}"
        ) from exc


def referenced_columns(filters: Filters, schema: pa.Schema, url: str) -> Tuple[str, ...]:
    """The dataset columns a filter reads. pyarrow 14 does not list an expression's fields, so
    each column is left out in turn: the ones the expression cannot bind without are its own."""
    expression = to_expression(filters)

    import pyarrow.dataset as pads

    def binds(fields: List[pa.Field]) -> Optional[Exception]:
        try:
            pads.dataset(pa.schema(fields).empty_table()).to_table(filter=expression)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, TypeError) as exc:
            return exc
        return None

    fields = list(schema)
    error = binds(fields)
    if error is not None:
        raise DataError(
            f"filters {expression} cannot be applied to dataset {url!r} (columns: {', '.join(schema.names)}): {error}"
        )
    return tuple(f.name for i, f in enumerate(fields) if binds(fields[:i] + fields[i + 1 :]) is not None)


def _value_kind(arrow_type: pa.DataType) -> str:
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return "float"
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_boolean(arrow_type):
        return "int"
    if (
        pa.types.is_binary(arrow_type)
        or pa.types.is_large_binary(arrow_type)
        or pa.types.is_fixed_size_binary(arrow_type)
    ):
        return "binary"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_struct(arrow_type) and {"height", "width", "nChannels", "data"} <= {f.name for f in arrow_type}:
        return "image_struct"
    return "other"


def describe_column(
    schema: pa.Schema, name: str, role: str, url: str, packed: Optional[Dict[str, str]] = None
) -> ColumnInfo:
    """What a column of an Arrow schema holds; its input spec decides whether that is usable.
    ``packed``: the dataset's float32-bytes columns (:func:`~sparkdl.data.tensor_bytes.packed_columns`)."""
    index = schema.get_field_index(name)
    if index < 0:
        raise DataError(f"{role} column {name!r} is not in dataset {url!r}; its columns are: {', '.join(schema.names)}")
    arrow_type = schema.field(index).type
    if packed and name in packed and pa.types.is_binary(arrow_type):
        return ColumnInfo(name, "float", (None,), type_name=f"array<{packed[name]}> (as bytes)", packed=True)
    if pa.types.is_fixed_size_list(arrow_type):
        # Petastorm 0.12's schema inference silently drops fixed-size list columns.
        raise DataError(
            f"{role} column {name!r} has type {arrow_type}; the Petastorm reader cannot read fixed-size lists: "
            f"write it as list<{arrow_type.value_type}> (e.g. pyarrow.list_(pyarrow.float32()))"
        )
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        kind = _value_kind(arrow_type.value_type)
        kind = kind if kind in ("float", "int") else "other"
        shape: Tuple[Optional[int], ...] = (None,)
    else:
        kind = _value_kind(arrow_type)
        shape = ()
    return ColumnInfo(name, kind, shape, type_name=str(arrow_type))
