"""The native Arrow reader: a rank's shard straight from Parquet row groups into numpy.

``reader="arrow"``. It reads row groups with ``pyarrow.parquet.ParquetFile.read_row_group``
(pyarrow's current API, no legacy ``ParquetDataset``), only the columns it needs, and turns
them into arrays without per-row Python objects: a ``list<float>`` column becomes one
``[rows, width]`` view of its values buffer (``flatten()`` + reshape), checked for equal
lengths through its offsets. Background threads read the next row groups while the current
ones are trained on (``DataSpec.read_ahead()`` ahead, so memory stays bounded), across the
boundaries of passes too: up to ``DataSpec.decode_thread_count()`` row groups are read and
decoded at once (pyarrow decodes without the GIL, so a task's reads scale with its cores), each
thread with its own open files, and handed out in the pass's order whichever finishes first.

It follows the same rules as the Petastorm reader (:mod:`sparkdl.data.selection`): the same
row groups per rank, in the same order for the same seed, the same striding fallback, filter
and hold-out, and a fresh seeded pass each time; so both readers give identical batches.
Petastorm datasets whose Unischema stores fields with codecs (ndarrays as bytes) are decoded
with those codecs, as Petastorm's ``make_reader`` does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Callable, Deque, Dict, Iterable, Iterator, List, Optional

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
        ``spec.read_ahead()`` row groups read ahead across the passes' boundaries too: the
        next pass's first row groups are read while this pass's last ones are trained on, so an
        epoch's first step does not wait for a read. Up to ``spec.decode_thread_count()`` of
        them are read at once. With ``cache``, a row group it holds is not read again, and one
        it does not is kept after its read while the budget lasts."""
        selector = RowSelector(dataset, spec.holdout, spec.part, spec.filters, rank, world_size)
        window = in_flight(dataset, spec)
        workers = min(spec.decode_thread_count(), window)
        opened: List[OpenFiles] = []
        opened_lock = threading.Lock()
        local = threading.local()

        def open_files() -> OpenFiles:
            # A ParquetFile is not shared between threads: each reading thread opens its own.
            files = getattr(local, "files", None)
            if files is None:
                files = local.files = OpenFiles(dataset, use_threads=False)
                with opened_lock:
                    opened.append(files)
            return files

        locations = dataset.row_group_location()
        rows = dataset.row_group_rows
        columns = dataset.columns + [c for c in dataset.filter_columns if c not in dataset.columns]
        infos = dataset.infos
        # With a cache, every chunk takes the form the cache keeps (images decoded here, not on
        # the decode threads), kept or not: the shuffle buffer mixes chunks of one form.
        convert = cache is not None and dataset.plan.converts_kept
        # The row groups read at once share the decode threads (image decoding within one).
        threads = max(1, spec.decode_thread_count() // workers) if convert else 1

        def keep_or_read(group: int) -> Optional[Chunk]:
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
            files = open_files()
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
        load = read if cache is None else _OneLoadAtATime(keep_or_read)
        # pyarrow decodes without the GIL, so the reads overlap each other and the training
        # thread; futures are taken in submission order, so the chunks keep the pass's order.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sparkdl-arrow-read")
        pending: Deque[Optional[concurrent.futures.Future]] = collections.deque()  # None: a pass's end
        reading = 0  # futures in pending: the one about to be consumed and those read ahead
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
            for files in opened:
                files.close()


#: What the row groups read ahead may take decoded, when ``prefetch_row_groups`` is not set: one
#: per decode thread, unless that many of the dataset's largest would take more than this.
READ_AHEAD_BYTES = 512 << 20


def in_flight(dataset: DatasetInfo, spec: DataSpec) -> int:
    """Row groups read or being read at a time: the one about to be consumed and those read
    ahead (``spec.read_ahead()``, within :data:`READ_AHEAD_BYTES` by the footers' sizes unless
    ``prefetch_row_groups`` says how many)."""
    ahead = spec.read_ahead()
    if spec.prefetch_row_groups is None and dataset.row_group_bytes:
        largest = max(1, max(dataset.row_group_bytes))
        ahead = min(ahead, max(2, READ_AHEAD_BYTES // largest))
    return ahead + 1


class _OneLoadAtATime:
    """``load(group)``, run once at a time per row group: a thread that reaches a row group
    another thread is still loading (the read-ahead reaches the next pass's first row groups while
    this pass's last ones are read) waits for that load instead of reading it again, so that a
    cached row group is read, and its images decoded, once."""

    def __init__(self, load: Callable[[int], Optional[Chunk]]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._running: Dict[int, "concurrent.futures.Future[Optional[Chunk]]"] = {}

    def __call__(self, group: int) -> Optional[Chunk]:
        with self._lock:
            running = self._running.get(group)
            first = running is None
            if first:
                running = self._running[group] = concurrent.futures.Future()
        if not first:
            return running.result()
        try:
            chunk = self._load(group)
        except BaseException as exc:
            running.set_exception(exc)
            raise
        else:
            running.set_result(chunk)
            return chunk
        finally:
            with self._lock:
                del self._running[group]


_EXHAUSTED = object()  # the end of a finite pass_indexes (None already marks a pass's end)
