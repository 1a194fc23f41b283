"""The native Arrow reader: a rank's shard straight from Parquet row groups into numpy.

``reader="arrow"``. It reads row groups with ``pyarrow.parquet.ParquetFile.read_row_group``
(pyarrow's current API, no legacy ``ParquetDataset``), only the columns it needs, and turns
them into arrays without per-row Python objects: a ``list<float>`` column becomes one
``[rows, width]`` view of its values buffer (``flatten()`` + reshape), checked for equal
lengths through its offsets. A background thread reads the next row groups while the current
ones are trained on (``DataSpec.prefetch_row_groups`` ahead, so memory stays bounded), across
the boundaries of passes too.

It follows the same rules as the Petastorm reader (:mod:`sparkdl.data.selection`): the same
row groups per rank, in the same order for the same seed, the same striding fallback, filter
and hold-out, and a fresh seeded pass each time; so both readers give identical batches.
Petastorm datasets whose Unischema stores fields with codecs (ndarrays as bytes) are decoded
with those codecs, as Petastorm's ``make_reader`` does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Deque, Iterable, Iterator, Optional

import pyarrow as pa

from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.inputs import POSITION_KEY
from sparkdl.data.open_files import OpenFiles
from sparkdl.data.readers.base import PASS_END, Chunk, DataReader, chunk_rows
from sparkdl.data.selection import RowSelector, pass_row_groups
from sparkdl.data.shard_cache import MISSING, ShardCache
from sparkdl.data.spec import DataSpec


class ArrowReader(DataReader):
    """Streams Parquet row groups with pyarrow; see the module docstring."""

    name = "arrow"
    reshardable = True
    description = "native pyarrow row groups, read ahead in a background thread (the default)"
    reads_tensor_bytes = True
    # A row group's chunk is a pure function of the row group, the rank and the spec.
    caches_row_groups = True

    def read_pass(
        self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int
    ) -> Iterator[Chunk]:
        for chunk in self.passes(dataset, spec, rank, world_size, [pass_index]):
            if chunk is not PASS_END:
                yield chunk

    def passes(
        self,
        dataset: DatasetInfo,
        spec: DataSpec,
        rank: int,
        world_size: int,
        pass_indexes: Iterable[int],
        cache: Optional[ShardCache] = None,
    ) -> Iterator[Chunk]:
        """The passes' row groups in order, each pass followed by ``PASS_END``, with
        ``spec.prefetch_row_groups`` row groups read ahead across the passes' boundaries too:
        the next pass's first row groups are read while this pass's last ones are trained on,
        so an epoch's first step does not wait for a read. With ``cache``, a row group it holds
        is not read again, and one it does not is kept after its read while the budget lasts."""
        selector = RowSelector(dataset, spec.holdout, spec.part, spec.filters, rank, world_size)
        files = OpenFiles(dataset)
        locations = dataset.row_group_location()
        rows = dataset.row_group_rows
        columns = dataset.columns + [c for c in dataset.filter_columns if c not in dataset.columns]
        infos = dataset.infos
        # With a cache, every chunk takes the form the cache keeps (images decoded here, not on
        # the decode threads), kept or not: the shuffle buffer mixes chunks of one form.
        convert = cache is not None and dataset.plan.converts_kept
        threads = spec.decode_thread_count() if convert else 1

        def load(group: int) -> Optional[Chunk]:
            if cache is None:
                return read(group)
            kept = cache.get(group)
            if kept is not MISSING:
                return kept
            started = time.perf_counter()
            chunk = read(group)
            if convert and chunk is not None:
                chunk = dataset.plan.keep(chunk, dataset.locate, threads)
            cache.put(group, chunk, time.perf_counter() - started)
            return chunk

        def read(group: int) -> Optional[Chunk]:
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
            chunk = dataset.plan.extract({c: table.column(c) for c in dataset.columns}, infos, source, positions)
            if spec.pass_marks:
                chunk.setdefault(POSITION_KEY, positions)
            return chunk

        # Every pass's row groups, then its end (None); a pass's order is drawn when reached.
        groups = (
            group
            for pass_index in pass_indexes
            for group in [
                *pass_row_groups(dataset.num_row_groups, rank, world_size, spec.seed + pass_index, spec.shuffle),
                None,
            ]
        )
        # One thread: reads run in order (a ParquetFile is not shared between threads) and
        # pyarrow decodes without the GIL, so reading overlaps the training thread.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparkdl-arrow-read")
        pending: Deque[Optional[concurrent.futures.Future]] = collections.deque()  # None: a pass's end
        reading = 0  # futures in pending: the one about to be consumed and those read ahead
        window = spec.prefetch_row_groups + 1
        try:
            while True:
                # A pass adds a row group and an end at least, so the length bound only binds
                # when passes are empty (the consumer then fails on the first end it takes).
                while reading < window and len(pending) < 2 * window:
                    group = next(groups, _EXHAUSTED)
                    if group is _EXHAUSTED:
                        break
                    pending.append(None if group is None else pool.submit(load, group))
                    reading += group is not None
                if not pending:
                    return
                future = pending.popleft()
                if future is None:
                    yield PASS_END
                    continue
                reading -= 1
                chunk = future.result()
                if chunk is not None and chunk_rows(chunk):
                    yield chunk
        finally:
            for future in pending:
                if future is not None:
                    future.cancel()
            pool.shutdown(wait=True)
            files.close()


_EXHAUSTED = object()  # the end of a finite pass_indexes (None already marks a pass's end)
