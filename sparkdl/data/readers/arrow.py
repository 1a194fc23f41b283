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
from typing import TYPE_CHECKING, Deque, Iterator, Optional

import pyarrow as pa

from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.readers.base import Chunk, DataReader, chunk_rows
from sparkdl.data.selection import OpenFiles, RowSelector, pass_row_groups

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl.data.batching import DataSpec


class ArrowReader(DataReader):
    """Streams Parquet row groups with pyarrow; see the module docstring."""

    name = "arrow"
    description = "native pyarrow row groups, read ahead in a background thread (the default)"
    reads_tensor_bytes = True

    def read_pass(self, dataset: DatasetInfo, spec: "DataSpec", rank: int, world_size: int, pass_index: int) -> Iterator[Chunk]:
        selector = RowSelector(dataset, spec.holdout, spec.part, spec.filters, rank, world_size)
        order = pass_row_groups(dataset.num_row_groups, rank, world_size, spec.seed + pass_index, spec.shuffle)
        files = OpenFiles(dataset)
        locations = dataset.row_group_location()
        rows = dataset.row_group_rows
        columns = dataset.columns + [c for c in dataset.filter_columns if c not in dataset.columns]
        infos = dataset.infos

        def load(group: int) -> Optional[Chunk]:
            file_index, row_group = locations[group]
            if rows[group] == 0:
                return None
            if selector.expression is not None and not files.may_match(file_index, row_group, selector.expression):
                return None  # the row group's statistics rule the filter out: not even read
            table = files.read(file_index, row_group, columns)
            positions = selector.positions(group)
            filter_table = table.select(list(dataset.filter_columns)) if selector.expression is not None else None
            keep = selector.keep(positions, filter_table)
            if keep is not None:
                if not keep.any():
                    return None
                table = table.filter(pa.array(keep))
                positions = positions[keep]
            source = dataset.origin or f"row group {row_group} of file {files.urls[file_index]!r}"
            return dataset.plan.extract({c: table.column(c) for c in dataset.columns}, infos, source, positions)

        # One thread: reads run in order (a ParquetFile is not shared between threads) and
        # pyarrow decodes without the GIL, so reading overlaps the training thread.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-arrow-read")
        pending: Deque[concurrent.futures.Future] = collections.deque()
        upcoming = iter(order)
        try:
            while True:
                # The one about to be consumed, and prefetch_row_groups more read while it is.
                while len(pending) < spec.prefetch_row_groups + 1:
                    group = next(upcoming, None)
                    if group is None:
                        break
                    pending.append(pool.submit(load, group))
                if not pending:
                    return
                chunk = pending.popleft().result()
                if chunk is not None and chunk_rows(chunk):
                    yield chunk
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True)
            files.close()
