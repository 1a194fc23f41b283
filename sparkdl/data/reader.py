"""Task-side data path: a rank's shard of the dataset as an endless stream of fixed-size batches.

Sharding and balance rules (the same for every reader):

* The shard unit is the Parquet row group: rank ``r`` of ``n`` reads row groups ``r, r+n, ...``
  (Petastorm's ``cur_shard``/``shard_count``). A dataset with fewer row groups than ranks falls
  back to row striding: every rank reads every row group and keeps rows ``r, r+n, ...``.
* Each rank's reader cycles over its shard forever (a fresh Petastorm reader per pass, seeded
  ``seed + pass``); an epoch is a fixed number of steps computed
  on the driver (:func:`steps_per_epoch`), identical on every rank, so no rank runs out first and
  blocks the others in a collective. Rows past the last full step of an epoch are not dropped:
  the stream simply goes on, and they open the next epoch. A rank with a smaller shard wraps
  around sooner, so its rows may appear once more per epoch than a larger shard's.
* With ``shuffle`` on, row-group order is shuffled each pass and rows are mixed in a bounded
  in-memory buffer (``shuffle_buffer_batches`` batches), seeded per rank: reproducible, never the
  whole dataset in memory.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import warnings
from typing import ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import numpy as np

from sparkdl.data.dataset import ColumnInfo, DatasetInfo
from sparkdl.errors import ConfigError, DataError

Chunk = Tuple[np.ndarray, Optional[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """How a task turns its shard into batches.

    Args:
        batch_size: rows per batch on each rank.
        shuffle: shuffle row-group order and rows (seeded).
        seed: base seed; rank ``r`` uses ``seed + r`` for its row shuffle.
        shuffle_buffer_batches: rows are shuffled within a buffer of this many batches.
        reader_threads: Petastorm decoding threads per task. One keeps the order of row groups,
            and so the whole run, reproducible for a fixed seed; more read faster but in an
            order that varies between runs.
    """

    batch_size: int
    shuffle: bool = True
    seed: int = 0
    shuffle_buffer_batches: int = 8
    reader_threads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size!r} must be a positive integer")
        if self.shuffle_buffer_batches < 1:
            raise ConfigError(f"shuffle_buffer_batches={self.shuffle_buffer_batches!r} must be >= 1")
        if self.reader_threads < 1:
            raise ConfigError(f"reader_threads={self.reader_threads!r} must be >= 1")


def steps_per_epoch(num_rows: int, batch_size: int, world_size: int) -> int:
    """Steps every rank runs per epoch: one pass over the rows, split evenly, full batches only."""
    steps = num_rows // (batch_size * world_size)
    if steps < 1:
        raise ConfigError(
            f"the dataset has {num_rows} rows, fewer than num_workers * batch_size = "
            f"{world_size} * {batch_size} = {world_size * batch_size}: lower batch_size or num_workers"
        )
    return steps


_READERS: Dict[str, Type["DataReader"]] = {}


class DataReader(abc.ABC):
    """Plug-in point for turning a shard of Parquet into numpy chunks of any size."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _READERS[cls.name] = cls

    @abc.abstractmethod
    def chunks(self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int) -> Iterator[Chunk]:
        """Endless (features, labels) chunks of this rank's shard. Must close its resources when
        the generator is closed."""


def reader_from_name(name: str) -> DataReader:
    try:
        return _READERS[name]()
    except KeyError:
        raise ConfigError(f"reader={name!r} is unknown; valid: {', '.join(sorted(_READERS))}") from None


def batches(reader: DataReader, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int) -> Iterator[Chunk]:
    """Endless batches of exactly ``spec.batch_size`` rows from this rank's shard."""
    rng = np.random.default_rng(spec.seed + rank)
    target = spec.batch_size * (spec.shuffle_buffer_batches if spec.shuffle else 1)
    pending: List[Chunk] = []
    pending_rows = 0
    source = reader.chunks(dataset, spec, rank, world_size)
    try:
        for chunk in source:
            pending.append(chunk)
            pending_rows += len(chunk[0])
            if pending_rows < target:
                continue
            features = np.concatenate([c[0] for c in pending])
            labels = np.concatenate([c[1] for c in pending]) if pending[0][1] is not None else None
            if spec.shuffle:
                order = rng.permutation(len(features))
                features = features[order]
                labels = labels[order] if labels is not None else None
            full = (len(features) // spec.batch_size) * spec.batch_size
            for start in range(0, full, spec.batch_size):
                stop = start + spec.batch_size
                yield features[start:stop], (labels[start:stop] if labels is not None else None)
            pending = [(features[full:], labels[full:] if labels is not None else None)]
            pending_rows = len(features) - full
    finally:
        source.close()


def to_arrays(
    columns: List[np.ndarray],
    label: Optional[np.ndarray],
    features_info: Sequence[ColumnInfo],
    label_info: Optional[ColumnInfo],
    source: str,
) -> Chunk:
    """Feature columns concatenated in order into float32; labels as int64 or float32.

    One array feature column keeps its value shape (e.g. an image tensor); otherwise columns are
    flattened per row and concatenated into a [rows, features] matrix (a scalar column is one
    feature). ``source`` names the data in error messages.
    """
    arrays = [_dense(col, info) for col, info in zip(columns, features_info)]
    if len(arrays) == 1 and arrays[0].ndim > 1:
        features = arrays[0]
    else:
        features = np.concatenate([a.reshape(len(a), -1) for a in arrays], axis=1)
    features = np.ascontiguousarray(features, dtype=np.float32)
    if np.isnan(features).any():
        bad = [info.name for a, info in zip(arrays, features_info) if np.isnan(a.astype(np.float32)).any()]
        raise DataError(f"feature column(s) {', '.join(bad)} contain NaN or null values in {source}")
    if label is None or label_info is None:
        return features, None
    labels = _dense(label, label_info)
    labels = labels.astype(np.int64 if label_info.kind == "int" else np.float32, copy=False)
    return features, labels


def _dense(column: np.ndarray, info: ColumnInfo) -> np.ndarray:
    if column.dtype == object:
        try:
            column = np.stack(column)
        except (ValueError, TypeError) as exc:
            raise DataError(
                f"column {info.name!r} holds arrays of different lengths or null values; every row "
                f"must have the same number of elements ({exc})"
            ) from exc
        if column.dtype == object:
            try:
                column = column.astype(np.float64)
            except (ValueError, TypeError) as exc:
                raise DataError(f"column {info.name!r} holds null or non-numeric values") from exc
    if column.dtype.kind not in "fiub":
        raise DataError(f"column {info.name!r} has non-numeric values (dtype {column.dtype})")
    return column


class PetastormReader(DataReader):
    """Streams through Petastorm: ``make_batch_reader`` for plain Parquet, ``make_reader`` for
    Petastorm datasets with a Unischema (codecs such as images stored as ndarrays)."""

    name = "petastorm"

    def chunks(self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int) -> Iterator[Chunk]:
        striding = dataset.num_row_groups < world_size
        feature_names = [c.name for c in dataset.features]
        label_name = dataset.label.name if dataset.label else None
        source = f"dataset {dataset.url!r}"
        # One reader per pass with a pass-specific seed, rather than Petastorm's num_epochs=None:
        # its endless mode reorders row groups depending on timing, which made runs irreproducible.
        for pass_index in itertools.count():
            reader = self._open(dataset, spec, rank, world_size, striding, spec.seed + pass_index)
            position = 0
            rows = 0
            try:
                for item in _row_batches(reader, spec.batch_size) if dataset.is_petastorm else reader:
                    columns = [np.asarray(getattr(item, name)) for name in feature_names]
                    label = np.asarray(getattr(item, label_name)) if label_name else None
                    if striding:
                        keep = (np.arange(position, position + len(columns[0])) % world_size) == rank
                        position += len(columns[0])
                        columns = [c[keep] for c in columns]
                        label = label[keep] if label is not None else None
                        if not len(columns[0]):
                            continue
                    rows += len(columns[0])
                    yield to_arrays(columns, label, dataset.features, dataset.label, source)
            finally:
                reader.stop()
                reader.join()
            if rows == 0:
                raise DataError(f"rank {rank} read no rows from its shard of {source}")

    @staticmethod
    def _open(dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, striding: bool, seed: int):
        with warnings.catch_warnings():
            # Petastorm 0.12 calls pyarrow's legacy API, which warns on every call.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            from petastorm import make_batch_reader, make_reader

            factory = make_reader if dataset.is_petastorm else make_batch_reader
            return factory(
                dataset.url,
                schema_fields=dataset.columns,
                reader_pool_type="thread",
                # Row striding needs every rank to see rows in the same order: one thread.
                workers_count=1 if striding else spec.reader_threads,
                seed=seed,
                shuffle_row_groups=spec.shuffle,
                num_epochs=1,
                cur_shard=None if striding else rank,
                shard_count=None if striding else world_size,
            )


def _row_batches(reader, size: int):
    """Groups ``make_reader``'s rows into column-wise batches like ``make_batch_reader``'s."""
    rows = []
    for row in reader:
        rows.append(row)
        if len(rows) == size:
            yield _stack_rows(rows)
            rows = []
    if rows:
        yield _stack_rows(rows)


class _Columns:
    def __init__(self, columns: Dict[str, np.ndarray]) -> None:
        self.__dict__.update(columns)


def _stack_rows(rows) -> _Columns:
    fields = rows[0]._fields
    return _Columns({f: np.stack([getattr(r, f) for r in rows]) for f in fields})
