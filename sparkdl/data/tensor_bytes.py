"""Dense array columns stored as raw float32 bytes: the layout sparkdl writes for its readers.

When sparkdl materializes a DataFrame (:mod:`sparkdl.data.cache`) for a reader that reads it
(``DataReader.reads_tensor_bytes``), every array column a :class:`~sparkdl.data.inputs.Dense`
input reads is written as one ``binary`` value per row — the row's elements as little-endian
float32, what the model gets anyway — instead of Spark's Parquet ``LIST``. Decoding a ``LIST``
means decoding repetition and definition levels for every element; a binary column is one
length per row and one contiguous buffer, which the reader turns into a ``[rows, width]`` view
without a copy. Measured by ``benchmarks/data_readers.py --layouts``: see docs/data.md.

The columns are marked in the Spark schema Spark stores in every file's footer (field metadata
``sparkdl.tensor = "float32"``), so a dataset says itself how to read it. Petastorm reads the
column as what it is, ``binary``: its batch reader hands out one Python ``bytes`` per row, which
:func:`tensor_rows_from_values` joins into the same matrix (still far cheaper than Petastorm's
decoding of a ``LIST``), so both readers read one materialized copy.

Nulls keep their meaning: a null array is a null value (reported as such), a null element
becomes NaN (reported as "NaN or null"), as the list path reports them.
"""

from __future__ import annotations

import functools
import json
from typing import Dict, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl.errors import DataError

#: Field metadata key marking a packed column; its value is the element dtype.
METADATA_KEY = "sparkdl.tensor"
#: The one element type written (what Dense inputs become).
DTYPE = "float32"
_SPARK_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"


def pack_dataframe(df, columns: Sequence[str]):
    """``df`` with each array column in ``columns`` packed as float32 bytes and marked.

    A Spark job step (``mapInArrow``) the executors run while writing; every other column
    passes through untouched."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    packed = set(columns)
    schema = T.StructType(
        [
            T.StructField(field.name, T.BinaryType(), True) if field.name in packed else field
            for field in df.schema.fields
        ]
    )
    out = df.mapInArrow(functools.partial(_pack_batches, tuple(columns)), schema)
    return out.select(
        *[
            F.col(name).alias(name, metadata={METADATA_KEY: DTYPE}) if name in packed else F.col(name)
            for name in df.columns
        ]
    )


def _pack_batches(columns: Sequence[str], batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        arrays = [
            pack_array(batch.column(i)) if name in columns else batch.column(i)
            for i, name in enumerate(batch.schema.names)
        ]
        yield pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def pack_array(array: pa.Array) -> pa.Array:
    """A list array as a binary array of float32 bytes per row (nulls stay null rows; null
    elements become NaN)."""
    offsets = array.offsets.to_numpy()  # of this (possibly sliced) array's rows
    start, end = int(offsets[0]), int(offsets[-1])
    values = array.values.slice(start, end - start).cast(pa.float32())
    if values.null_count:
        values = pc.fill_null(values, float("nan"))
    flat = np.ascontiguousarray(values.to_numpy(zero_copy_only=False), dtype="<f4")
    byte_offsets = (offsets - start).astype(np.int64) * 4
    if byte_offsets[-1] > np.iinfo(np.int32).max:
        raise DataError(
            f"an Arrow batch of {len(array)} rows holds {byte_offsets[-1]:,} bytes of array values, over 2 GiB; "
            f"lower spark.sql.execution.arrow.maxRecordsPerBatch"
        )
    binary = pa.Array.from_buffers(
        pa.binary(), len(array), [None, pa.py_buffer(byte_offsets.astype(np.int32)), pa.py_buffer(flat)]
    )
    if array.null_count:
        binary = pc.if_else(array.is_null(), pa.scalar(None, pa.binary()), binary)
    return binary


def packed_columns(schema: pa.Schema) -> Dict[str, str]:
    """The packed columns of a dataset (name → element dtype), from the Spark schema its
    footers carry; empty for data sparkdl did not write."""
    metadata = schema.metadata or {}
    text = metadata.get(_SPARK_SCHEMA_KEY)
    if not text:
        return {}
    try:
        fields = json.loads(text).get("fields", [])
    except (ValueError, AttributeError):
        return {}
    out = {}
    for field in fields:
        dtype = (field.get("metadata") or {}).get(METADATA_KEY) if isinstance(field, dict) else None
        if dtype == DTYPE and field.get("type") == "binary":
            out[field["name"]] = dtype
    return out


def tensor_rows(array: pa.Array, name: str, role: str, source: str) -> np.ndarray:
    """A packed column as a ``[rows, width]`` float32 view of its bytes (no copy), checked:
    no null rows, every row the same width."""
    if array.null_count:
        raise DataError(f"{role} column {name!r} has {array.null_count} null values in {source}")
    rows = len(array)
    # The offsets buffer itself (BinaryArray.offsets is missing from older pyarrow), from this
    # (possibly sliced) array's first row.
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32, count=rows + 1, offset=array.offset * 4)
    width = row_width(offsets // 4, name, role, source)
    flat = np.frombuffer(array.buffers()[2], dtype="<f4", count=rows * width, offset=int(offsets[0]))
    return flat.reshape(rows, width)


def tensor_rows_from_values(values: np.ndarray, name: str, role: str, source: str) -> np.ndarray:
    """A packed column handed out as one Python ``bytes`` per row (Petastorm's batch reader
    converts columns through pandas) as a ``[rows, width]`` float32 array: one join of the rows'
    bytes, checked like :func:`tensor_rows`."""
    nulls = sum(1 for value in values if value is None)
    if nulls:
        raise DataError(f"{role} column {name!r} has {nulls} null values in {source}")
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=len(values)), out=offsets[1:])
    width = row_width(offsets // 4, name, role, source)
    return np.frombuffer(b"".join(values), dtype="<f4").reshape(len(values), width)


def row_width(offsets: np.ndarray, name: str, role: str, source: str) -> int:
    """The elements per row of a column with these row offsets, which must be the same for every
    row and not zero (dense inputs are matrices)."""
    rows = len(offsets) - 1
    lengths = np.diff(offsets)
    width = int(lengths[0]) if rows else 0
    if rows and (lengths != width).any():
        raise DataError(
            f"{role} column {name!r} holds arrays of different lengths in {source} "
            f"(from {int(lengths.min())} to {int(lengths.max())}); every row must have the same number of elements"
            f" (use sparkdl.Sequence for variable-length token ids)"
        )
    if rows and width == 0:
        raise DataError(f"{role} column {name!r} holds empty arrays in {source}")
    return width


def spark_footer_metadata(schema: pa.Schema, packed: Sequence[str]) -> Dict[bytes, bytes]:
    """Footer metadata marking ``packed`` as Spark would, for packed data written without Spark
    (tests, benchmarks): the schema's own metadata plus a Spark schema of its plain columns."""
    names = {
        pa.int64(): "long",
        pa.int32(): "integer",
        pa.float32(): "float",
        pa.float64(): "double",
        pa.binary(): "binary",
        pa.string(): "string",
        pa.bool_(): "boolean",
    }
    fields = [
        {
            "name": field.name,
            "type": names.get(field.type, "binary"),
            "nullable": True,
            "metadata": {METADATA_KEY: DTYPE} if field.name in packed else {},
        }
        for field in schema
    ]
    return {**(schema.metadata or {}), _SPARK_SCHEMA_KEY: json.dumps({"type": "struct", "fields": fields}).encode()}
