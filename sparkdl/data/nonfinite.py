"""Where a NaN or an infinity in the training data is, for the message of a non-finite loss.

Runs only after the loss went NaN/inf (never on the hot path): it reads the float columns the
run trains on, row group by row group, and stops at the first non-finite value, within a time
budget. A run on a DataFrame names the DataFrame's column (its copy's path means nothing to the
user); data read in place is named down to the file, row group and row.
"""

from __future__ import annotations

import time
from typing import List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.tensor_bytes import tensor_rows
from sparkdl.filesystem import file_paths, filesystem_and_path

#: A failing run should not spend long explaining itself.
SCAN_BUDGET_S = 30.0


def _float_columns(dataset: DatasetInfo) -> List[str]:
    return [info.name for info in dataset.column_info if info.kind == "float" and info.codec_field is None]


def _first_bad_row(column: pa.ChunkedArray) -> Optional[int]:
    array = column.combine_chunks()
    if pa.types.is_binary(array.type):  # float32 bytes per row (sparkdl.data.tensor_bytes)
        array = _unpacked(array)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        values = np.asarray(array.flatten().to_numpy(zero_copy_only=False), dtype=np.float64)
        bad = ~np.isfinite(values)
        if not bad.any():
            return None
        # The row whose list holds the first bad value.
        if pa.types.is_fixed_size_list(array.type):
            offsets = np.arange(len(array) + 1) * array.type.list_size
        else:
            offsets = np.asarray(array.offsets)
            offsets = offsets - offsets[0]  # a sliced array's offsets start where its slice does
        return int(np.searchsorted(offsets, int(np.argmax(bad)), side="right") - 1)
    values = np.asarray(pc.fill_null(array, 0).to_numpy(zero_copy_only=False), dtype=np.float64)
    bad = ~np.isfinite(values)
    return int(np.argmax(bad)) if bad.any() else None


def describe_non_finite(dataset: DatasetInfo, budget_s: float = SCAN_BUDGET_S) -> str:
    """A sentence saying where the first NaN/inf of the float columns is, or that none was found."""
    columns = _float_columns(dataset)
    if not columns or not dataset.files:
        return "the input columns hold no floats, so the data is not the cause: the model or the optimizer diverged"
    deadline = time.monotonic() + budget_s
    fs, _ = filesystem_and_path(dataset.files[0].url)
    paths = file_paths(fs, [f.url for f in dataset.files])
    layout = dataset.layout  # a table's files: renamed and partition columns, deleted rows
    for index, (file, path) in enumerate(zip(dataset.files, paths)):
        with pq.ParquetFile(fs.open_input_file(path)) as handle:
            first = 0  # the file's row where the row group starts
            for group, count in enumerate(file.row_groups):
                if layout is None:
                    table, rows = handle.read_row_group(group, columns=columns), np.arange(count)
                else:
                    table, rows = _live(layout, handle, index, group, first, count, columns)
                first += count
                for name in columns:
                    row = _first_bad_row(table.column(name))
                    if row is None:
                        continue
                    value = _value_name(table.column(name), row)
                    if dataset.origin:
                        return f"column {name!r} of {dataset.origin} holds {value} values: drop or fill them (e.g. df.na.fill, or filter with isnan) before training"
                    return f"column {name!r} holds {value} at row {rows[row]} of row group {group} of file {file.url!r}: drop or fill it before training"
                if time.monotonic() > deadline:
                    return f"no NaN or infinity in the first {budget_s:.0f} s of reading the float columns {columns}"
    return f"the float columns {columns} hold no NaN or infinity: the model or the optimizer diverged"


def _live(layout, handle, index: int, group: int, first: int, count: int, columns: List[str]):
    """A table's row group in its names, without its deleted rows (never trained on, so never
    the cause), and the rows' indexes in the row group."""
    table, rows = layout.read(handle, index, group, columns), np.arange(count)
    live = layout.live_rows(index, first, count)
    return (table, rows) if live is None else (table.filter(pa.array(live)), rows[live])


def _unpacked(array: pa.Array) -> pa.Array:
    """A packed column as a fixed-size list array of its rows (sparkdl writes equal widths)."""
    rows = tensor_rows(array, "", "input", "the dataset")
    return pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])


def _value_name(column: pa.ChunkedArray, row: int) -> str:
    if pa.types.is_binary(column.type):
        column = pa.chunked_array([_unpacked(column.combine_chunks())])
    value = column[row].as_py()
    values = np.asarray(value if isinstance(value, list) else [value], dtype=np.float64)
    return "NaN" if np.isnan(values).any() else "infinite"
