"""Driver-side view of the training data: where it is, what it holds, and whether it is usable.

Everything here runs on the driver and touches only Parquet footers (row counts, schemas), never
rows, so it is cheap even for large datasets. The result, :class:`DatasetInfo`, is small and
picklable and travels to the tasks, which stream the rows themselves.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
import warnings
from typing import List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from sparkdl.errors import DataError


@dataclasses.dataclass(frozen=True)
class ColumnInfo:
    name: str
    #: "float" or "int" (numpy kind of the values).
    kind: str
    #: Shape of one value: () for scalars, (n,) for arrays whose length is only known per row
    #: (``None`` inside), or a fixed shape for Petastorm tensor fields.
    shape: Tuple[Optional[int], ...]


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A validated Parquet or Petastorm dataset, as the tasks need to know it."""

    url: str
    num_rows: int
    num_row_groups: int
    #: True when the dataset carries a Petastorm Unischema (read with ``make_reader``).
    is_petastorm: bool
    features: Tuple[ColumnInfo, ...]
    label: Optional[ColumnInfo]

    @property
    def columns(self) -> List[str]:
        return [c.name for c in self.features] + ([self.label.name] if self.label else [])


def normalize_url(url_or_path: str) -> str:
    """Plain paths become ``file://`` URLs (Petastorm needs a scheme); URLs pass unchanged."""
    if not isinstance(url_or_path, str) or not url_or_path:
        raise DataError(f"dataset URL must be a non-empty string, got {url_or_path!r}")
    if urllib.parse.urlparse(url_or_path).scheme in ("", "file") and not url_or_path.startswith("file://"):
        return "file://" + os.path.abspath(url_or_path)
    return url_or_path


def _filesystem(url: str) -> Tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(url)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad URLs
        raise DataError(f"cannot open a filesystem for dataset URL {url!r}: {exc}") from exc


def inspect_dataset(url: str, feature_cols: Sequence[str], label_col: Optional[str]) -> DatasetInfo:
    """Validates a dataset against the columns to train on, reading only metadata.

    Raises:
        DataError: the path does not exist, a file is unreadable, a column is missing or not
            numeric, or the dataset has no rows. The message names the path, file or column.
    """
    url = normalize_url(url)
    fs, path = _filesystem(url)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"no dataset at {url!r}: the path does not exist")
    try:
        dataset = pads.dataset(path, filesystem=fs, format="parquet")
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read the Parquet dataset at {url!r}: {exc}") from exc

    num_rows = 0
    num_row_groups = 0
    for fragment in dataset.get_fragments():
        try:
            metadata = fragment.metadata
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"unreadable Parquet file {fragment.path!r} in dataset {url!r}: {exc}") from exc
        num_rows += metadata.num_rows
        num_row_groups += metadata.num_row_groups
    if num_row_groups == 0:
        raise DataError(f"dataset {url!r} holds no Parquet files")
    if num_rows == 0:
        raise DataError(f"dataset {url!r} is empty: its Parquet files hold 0 rows")

    unischema = _petastorm_schema(url, fs, path)
    if unischema is not None:
        features = tuple(_unischema_column(unischema, c, "feature") for c in feature_cols)
        label = _unischema_column(unischema, label_col, "label") if label_col else None
    else:
        features = tuple(_arrow_column(dataset.schema, c, "feature", url) for c in feature_cols)
        label = _arrow_column(dataset.schema, label_col, "label", url) if label_col else None
    return DatasetInfo(url, num_rows, num_row_groups, unischema is not None, features, label)


def _numeric_kind(arrow_type: pa.DataType) -> Optional[str]:
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return "float"
    if pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
        return "int"
    return None


def _arrow_column(schema: pa.Schema, name: str, role: str, url: str) -> ColumnInfo:
    index = schema.get_field_index(name)
    if index < 0:
        raise DataError(
            f"{role} column {name!r} is not in dataset {url!r}; its columns are: {', '.join(schema.names)}"
        )
    arrow_type = schema.field(index).type
    if pa.types.is_fixed_size_list(arrow_type):
        # Petastorm 0.12's schema inference silently drops fixed-size list columns.
        raise DataError(
            f"{role} column {name!r} has type {arrow_type}; the Petastorm reader cannot read fixed-size lists: "
            f"write it as list<{arrow_type.value_type}> (e.g. pyarrow.list_(pyarrow.float32()))"
        )
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        kind = _numeric_kind(arrow_type.value_type)
        size = arrow_type.list_size if pa.types.is_fixed_size_list(arrow_type) else None
        shape: Tuple[Optional[int], ...] = (size,)
    else:
        kind = _numeric_kind(arrow_type)
        shape = ()
    if kind is None:
        raise DataError(
            f"{role} column {name!r} has type {arrow_type}, which is not numeric; "
            f"{role}s must be numbers or arrays of numbers"
        )
    return ColumnInfo(name, kind, shape)


def _petastorm_schema(url: str, fs: pafs.FileSystem, path: str):
    """The dataset's Unischema, or None for plain Parquet.

    Petastorm's ``materialize_dataset`` stores the Unischema in ``_common_metadata``; checking
    for that key first keeps plain datasets off Petastorm's slower legacy-pyarrow path.
    """
    import pyarrow.parquet as pq

    marker = f"{path.rstrip('/')}/_common_metadata"
    if fs.get_file_info(marker).type != pafs.FileType.File:
        return None
    with fs.open_input_file(marker) as handle:
        metadata = pq.read_schema(handle).metadata or {}
    if not any(key.startswith(b"dataset-toolkit.unischema") for key in metadata):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Petastorm's legacy pyarrow calls warn on every use
        from petastorm.etl.dataset_metadata import get_schema_from_dataset_url

        return get_schema_from_dataset_url(url)


def _unischema_column(unischema, name: str, role: str) -> ColumnInfo:
    import numpy as np

    field = unischema.fields.get(name)
    if field is None:
        raise DataError(
            f"{role} column {name!r} is not in the Petastorm schema {unischema._name!r}; "
            f"its fields are: {', '.join(unischema.fields)}"
        )
    dtype = np.dtype(field.numpy_dtype)
    if dtype.kind not in "fiub":
        raise DataError(f"{role} column {name!r} has dtype {dtype}, which is not numeric")
    return ColumnInfo(name, "float" if dtype.kind == "f" else "int", tuple(field.shape))
