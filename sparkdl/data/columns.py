"""Column values as numpy arrays: what a column holds (:class:`ColumnInfo`) and the conversions
behind the input specs' first step.

A chunk's columns arrive as pyarrow arrays (the Arrow reader), numpy arrays (the Petastorm
reader) or pandas Series/DataFrames (``TorchModel.transform``); every function here takes any of
them and returns row-aligned numpy arrays, raising :class:`~sparkdl.errors.DataError` that names
the role, the column and the source for nulls, ragged arrays and values of the wrong type. The
pixel helpers at the end work on decoded images (:class:`sparkdl.data.inputs.Image`).

Nothing here knows the specs, the plan or the dataset (:mod:`sparkdl.data.inputs`,
:mod:`sparkdl.data.plan`, :mod:`sparkdl.data.dataset`), which import it.
"""

from __future__ import annotations

import dataclasses
import typing as t

import numpy as np
import pyarrow as pa

from sparkdl.data.tensor_bytes import row_width, tensor_rows, tensor_rows_from_values
from sparkdl.errors import DataError

ColumnData = t.Any  # a pyarrow Array/ChunkedArray, a numpy array, or a pandas Series/DataFrame


@dataclasses.dataclass(frozen=True)
class ColumnInfo:
    """What one column holds, as the driver read it from the footers or the DataFrame's schema
    (:func:`sparkdl.data.dataset.inspect_dataset`); the input specs check and convert by it."""

    name: str
    #: What the values are: "float", "int" or "bool" (numbers; for arrays, of the elements),
    #: "binary", "string", "image_struct" (Spark's ``format("image")`` struct) or "other".
    kind: str
    #: Shape of one value: () for scalars, (n,) for arrays whose length is only known per row
    #: (``None`` inside), or a fixed shape for Petastorm tensor fields.
    shape: t.Tuple[t.Optional[int], ...]
    #: The Petastorm ``UnischemaField`` of a column stored with a codec (e.g. an ndarray as
    #: bytes), which readers other than Petastorm's decode with it; None for plain columns.
    codec_field: t.Any = dataclasses.field(default=None, compare=False, repr=False)
    #: The stored type, for messages (e.g. ``list<item: int64>``).
    type_name: str = dataclasses.field(default="", compare=False)
    #: Arrays stored as float32 bytes per row (:mod:`sparkdl.data.tensor_bytes`), the layout
    #: sparkdl writes for the Arrow reader.
    packed: bool = False


# ---- column conversions (pyarrow from the Arrow reader, numpy from Petastorm, pandas from
# ---- TorchModel.transform) ---------------------------------------------------------------------


def arrow_array(values: ColumnData) -> t.Optional[pa.Array]:
    """One pyarrow array of a pyarrow column; None for numpy and pandas columns."""
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if isinstance(values, pa.Array):
        return values
    return None


def numpy_values(values: ColumnData) -> np.ndarray:
    """A numpy or pandas column as a numpy array."""
    if hasattr(values, "to_numpy") and not isinstance(values, (pa.Array, pa.ChunkedArray, np.ndarray)):
        return values.to_numpy()  # pandas
    return np.asarray(values)


def numeric_values(values: ColumnData, info: ColumnInfo, role: str, source: str) -> np.ndarray:
    """A numeric column as one array: scalars as a vector, equal-length lists as a matrix (a view
    of the Arrow values buffer when possible), codec fields decoded with their codec."""
    array = arrow_array(values)
    if array is None and info.packed:
        return tensor_rows_from_values(numpy_values(values), info.name, role, source)
    if array is not None:
        if array.null_count:
            raise DataError(f"{role} column {info.name!r} has {array.null_count} null values in {source}")
        if info.packed:
            return tensor_rows(array, info.name, role, source)
        if info.codec_field is not None:
            field = info.codec_field
            return np.stack([field.codec.decode(field, value) for value in array.to_pylist()])
        if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
            return list_matrix(array, info, role, source)
        if pa.types.is_fixed_size_list(array.type):
            return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), array.type.list_size)
        column = array.to_numpy(zero_copy_only=False)
    else:
        column = numpy_values(values)
    if column.dtype == object:
        try:
            column = np.stack(column)
        except (ValueError, TypeError) as exc:
            raise DataError(
                f"{role} column {info.name!r} holds arrays of different lengths or null values in {source}; every row "
                f"must have the same number of elements ({exc})"
            ) from exc
        if column.dtype == object:
            try:
                column = column.astype(np.float64)
            except (ValueError, TypeError) as exc:
                raise DataError(f"{role} column {info.name!r} holds null or non-numeric values in {source}") from exc
    if column.dtype.kind not in "fiub":
        raise DataError(f"{role} column {info.name!r} has non-numeric values (dtype {column.dtype}) in {source}")
    return column


def list_matrix(array: pa.Array, info: ColumnInfo, role: str, source: str) -> np.ndarray:
    rows = len(array)
    width = row_width(array.offsets.to_numpy(), info.name, role, source)
    values = array.flatten()
    if values.null_count:
        raise DataError(f"{role} column {info.name!r} has {values.null_count} null elements in {source}")
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        raise DataError(f"{role} column {info.name!r} holds nested arrays in {source}; store one flat array per row")
    return values.to_numpy(zero_copy_only=False).reshape(rows, width)


def object_values(values: ColumnData, role: str, column: str, source: str) -> np.ndarray:
    array = arrow_array(values)
    if array is not None:
        if array.null_count:
            raise DataError(f"{role} column {column!r} has {array.null_count} null values in {source}")
        return array.to_numpy(zero_copy_only=False)
    out = numpy_values(values)
    if any(v is None for v in out):
        raise DataError(f"{role} column {column!r} has null values in {source}")
    return out


def binary_values(values: ColumnData, role: str, column: str, source: str) -> np.ndarray:
    items = object_values(values, role, column, source)
    if items.dtype != object:  # a 2-D uint8 stack (Petastorm's stacked ndarrays)
        items = object_rows(items)
    return items


def object_rows(items: t.Sequence[t.Any]) -> np.ndarray:
    """A 1-D object array of ``items`` (numpy would stack equal-shaped arrays into one)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def codec_images(values: ColumnData, info: ColumnInfo, role: str, column: str, source: str) -> np.ndarray:
    """A Petastorm image field: compressed (PNG/JPEG) bytes are decoded like any image bytes;
    ndarray-codec bytes with the codec; the Petastorm reader hands decoded arrays already."""
    array = arrow_array(values)
    if array is None:
        items = numpy_values(values)
        return items if items.dtype == object else object_rows(items)
    if array.null_count:
        raise DataError(f"{role} column {column!r} has {array.null_count} null values in {source}")
    field = info.codec_field
    from petastorm.codecs import CompressedImageCodec

    raw = array.to_numpy(zero_copy_only=False)
    if isinstance(field.codec, CompressedImageCodec):
        return raw
    return object_rows([field.codec.decode(field, value) for value in raw])


def spark_image_structs(values: ColumnData, role: str, column: str, source: str) -> np.ndarray:
    """Spark's image struct (OpenCV layout: rows of BGR(A) bytes, ``height x width x nChannels``)
    as RGB(A) uint8 arrays."""
    array = arrow_array(values)
    if array is not None:
        if array.null_count:
            raise DataError(f"{role} column {column!r} has {array.null_count} null images in {source}")
        fields = {
            name: array.field(name).to_numpy(zero_copy_only=False)
            for name in ("height", "width", "nChannels", "data", "origin")
        }
    else:  # pandas: a struct column of a pandas UDF arrives as a DataFrame
        frame = values
        fields = {name: frame[name].to_numpy() for name in ("height", "width", "nChannels", "data", "origin")}
    out = np.empty(len(fields["data"]), dtype=object)
    for i in range(len(out)):
        height, width, channels = int(fields["height"][i]), int(fields["width"][i]), int(fields["nChannels"][i])
        data = fields["data"][i]
        if data is None or height <= 0 or width <= 0 or len(data) != height * width * channels:
            raise DataError(
                f"{role} column {column!r} holds an image Spark could not decode (origin {fields['origin'][i]!r}) in {source}; "
                f"drop such rows, e.g. spark.read.format('image').option('dropInvalid', True)"
            )
        image = np.frombuffer(data, dtype=np.uint8).reshape(height, width, channels)
        if channels >= 3:
            image = image[:, :, [2, 1, 0] + ([3] if channels == 4 else [])]
        out[i] = image
    return out


def padded_sequences(
    values: ColumnData, max_length: int, pad_value: int, role: str, column: str, source: str
) -> t.Tuple[np.ndarray, np.ndarray]:
    """``[rows, max_length]`` int64 padded with ``pad_value`` (rows truncated to max_length)
    and each row's length after truncation."""
    array = arrow_array(values)
    if array is not None:
        if array.null_count:
            raise DataError(
                f"{role} column {column!r} has {array.null_count} null arrays in {source} (empty arrays are fine)"
            )
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
            raise DataError(
                f"{role} column {column!r} has type {array.type} in {source}; sparkdl.Sequence needs arrays of integers"
            )
        flat = array.flatten()
        if not pa.types.is_integer(flat.type):
            raise DataError(
                f"{role} column {column!r} holds {flat.type} values in {source}; sparkdl.Sequence needs integers (token ids)"
            )
        if flat.null_count:
            raise DataError(f"{role} column {column!r} has {flat.null_count} null elements in {source}")
        offsets = array.offsets.to_numpy().astype(np.int64)
        starts = offsets[:-1] - offsets[0]
        lengths = np.minimum(np.diff(offsets), max_length)
        values_np = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        rows = len(array)
        padded = np.full((rows, max_length), pad_value, dtype=np.int64)
        mask = np.arange(max_length)[None, :] < lengths[:, None]
        index = (starts[:, None] + np.arange(max_length)[None, :])[mask]
        padded[mask] = values_np[index]
        return padded, lengths.astype(np.int64)
    rows_data = numpy_values(values)
    padded = np.full((len(rows_data), max_length), pad_value, dtype=np.int64)
    lengths = np.zeros(len(rows_data), dtype=np.int64)
    for i, row in enumerate(rows_data):
        if row is None:
            raise DataError(f"{role} column {column!r} has null arrays in {source} (empty arrays are fine)")
        row = np.asarray(row)
        if row.size and row.dtype.kind not in "iu":
            raise DataError(
                f"{role} column {column!r} holds {row.dtype} values in {source}; sparkdl.Sequence needs integers (token ids)"
            )
        n = min(len(row), max_length)
        padded[i, :n] = row[:n]
        lengths[i] = n
    return padded, lengths
