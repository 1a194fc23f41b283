"""The native Arrow reader: a rank's shard straight from Parquet row groups into numpy.

``reader="arrow"``. It reads row groups with ``pyarrow.parquet.ParquetFile.read_row_group``
(pyarrow's current API, no legacy ``ParquetDataset``), only the columns it needs, and turns
them into arrays without per-row Python objects: a ``list<float>`` column becomes one
``[rows, width]`` view of its values buffer (``flatten()`` + reshape), checked for equal
lengths through its offsets. A background thread reads the next row groups while the current
ones are trained on (``DataSpec.prefetch_row_groups`` ahead, so memory stays bounded).

It follows the same rules as the Petastorm reader (:mod:`sparkdl.data.selection`): the same
row groups per rank, in the same order for the same seed, the same striding fallback, filter
and hold-out, and a fresh seeded pass each time; so both readers give identical batches.
Petastorm datasets whose Unischema stores fields with codecs (ndarrays as bytes) are decoded
with those codecs, as Petastorm's ``make_reader`` does.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Deque, Iterator, Optional

import numpy as np
import pyarrow as pa

from sparkdl.data.dataset import ColumnInfo, DatasetInfo
from sparkdl.data.reader import Chunk, DataReader, DataSpec, to_arrays
from sparkdl.data.selection import OpenFiles, RowSelector, pass_row_groups
from sparkdl.errors import DataError


class ArrowReader(DataReader):
    """Streams Parquet row groups with pyarrow; see the module docstring."""

    name = "arrow"

    def read_pass(self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int) -> Iterator[Chunk]:
        selector = RowSelector(dataset, spec.holdout, spec.part, spec.filters, rank, world_size)
        order = pass_row_groups(dataset.num_row_groups, rank, world_size, spec.seed + pass_index, spec.shuffle)
        files = OpenFiles(dataset)
        locations = dataset.row_group_location()
        rows = dataset.row_group_rows
        columns = dataset.columns + [c for c in dataset.filter_columns if c not in dataset.columns]

        def load(group: int) -> Optional[Chunk]:
            file_index, row_group = locations[group]
            if rows[group] == 0:
                return None
            if selector.expression is not None and not files.may_match(file_index, row_group, selector.expression):
                return None  # the row group's statistics rule the filter out: not even read
            table = files.read(file_index, row_group, columns)
            positions = selector.positions(group) if selector.needs_positions else None
            filter_table = table.select(list(dataset.filter_columns)) if selector.expression is not None else None
            keep = selector.keep(positions, filter_table)
            if keep is not None:
                if not keep.any():
                    return None
                table = table.filter(pa.array(keep))
            return table_to_chunk(table, dataset, f"row group {row_group} of file {files.urls[file_index]!r}")

        # One thread: reads run in order (a ParquetFile is not shared between threads) and
        # pyarrow decodes without the GIL, so reading overlaps the training thread.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-arrow-read")
        pending: Deque[concurrent.futures.Future] = collections.deque()
        upcoming = iter(order)
        try:
            while True:
                while len(pending) < spec.prefetch_row_groups:
                    group = next(upcoming, None)
                    if group is None:
                        break
                    pending.append(pool.submit(load, group))
                if not pending:
                    return
                chunk = pending.popleft().result()
                if chunk is not None and len(chunk[0]):
                    yield chunk
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True)
            files.close()


def table_to_chunk(table: pa.Table, dataset: DatasetInfo, source: str) -> Chunk:
    """(features, labels) from a table of the dataset's columns, as :func:`to_arrays` makes them."""
    columns = [column_to_numpy(table.column(info.name), info, "feature", source) for info in dataset.features]
    label = column_to_numpy(table.column(dataset.label.name), dataset.label, "label", source) if dataset.label else None
    return to_arrays(columns, label, dataset.features, dataset.label, source)


def column_to_numpy(column: pa.ChunkedArray, info: ColumnInfo, role: str, source: str) -> np.ndarray:
    """A column as one numpy array: scalars as a vector, equal-length lists as a matrix (a view
    of the values buffer when possible), codec fields decoded with their codec."""
    if column.null_count:
        raise DataError(f"{role} column {info.name!r} has {column.null_count} null values in {source}")
    if info.codec_field is not None:
        field = info.codec_field
        return np.stack([field.codec.decode(field, value) for value in column.to_pylist()])
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        return _list_matrix(array, info, role, source)
    # Decimals come out as objects, which to_arrays converts on its slow path.
    return array.to_numpy(zero_copy_only=False)


def _list_matrix(array: pa.Array, info: ColumnInfo, role: str, source: str) -> np.ndarray:
    rows = len(array)
    offsets = array.offsets.to_numpy()
    lengths = np.diff(offsets)
    width = int(lengths[0]) if rows else 0
    if rows and (lengths != width).any():
        raise DataError(
            f"{role} column {info.name!r} holds arrays of different lengths in {source} "
            f"(from {int(lengths.min())} to {int(lengths.max())}); every row must have the same number of elements"
        )
    if rows and width == 0:
        raise DataError(f"{role} column {info.name!r} holds empty arrays in {source}")
    values = array.flatten()
    if values.null_count:
        raise DataError(f"{role} column {info.name!r} has {values.null_count} null elements in {source}")
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        raise DataError(f"{role} column {info.name!r} holds nested arrays in {source}; store one flat array per row")
    return values.to_numpy(zero_copy_only=False).reshape(rows, width)
