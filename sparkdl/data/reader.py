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
* Which row groups and rows a rank reads (order, filters, the validation hold-out) is decided in
  :mod:`sparkdl.data.selection`, identically for every reader: the Petastorm and Arrow readers
  give the same batches for the same seed.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import warnings
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import numpy as np
import pyarrow as pa

from sparkdl.data.dataset import ColumnInfo, DatasetInfo
from sparkdl.errors import ConfigError, DataError

Chunk = Tuple[np.ndarray, Optional[np.ndarray]]
#: ``transform_fn(features, labels) -> (features, labels)``: numpy in, numpy out, same row count.
TransformFn = Callable[[np.ndarray, Optional[np.ndarray]], Tuple[np.ndarray, Optional[np.ndarray]]]
#: ``metric(output, label) -> scalar``: the mean over a batch's rows (a tensor or a number).
MetricFn = Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class ValidationSpec:
    """What the per-epoch validation pass reads and computes.

    Args:
        dataset: a separate validation dataset; None reads the rows ``DataSpec.holdout`` holds
            out of the training data.
        metrics: ``(name, fn)`` pairs; each ``fn(output, label)`` is a batch mean, reported as
            ``val_<name>`` averaged over every validation row of every rank.
    """

    dataset: Optional[DatasetInfo] = None
    metrics: Tuple[Tuple[str, MetricFn], ...] = ()


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
        filters: rows to keep: pyarrow's DNF list of ``(column, op, value)`` tuples or a
            ``pyarrow.compute`` expression; row groups whose statistics rule it out are skipped.
        transform_fn: ``(features, labels) -> (features, labels)`` on numpy arrays, applied to
            every batch on the executor (in the prefetch thread); must keep the row count.
        holdout: fraction of rows held out of training for validation (by row position).
        part: ``"train"`` reads the rows not held out, ``"holdout"`` only the held-out ones.
        validation: the validation pass, or None for none.
        prefetch_row_groups: row groups the Arrow reader reads ahead in the background.
    """

    batch_size: int
    shuffle: bool = True
    seed: int = 0
    shuffle_buffer_batches: int = 8
    reader_threads: int = 1
    filters: Any = None
    transform_fn: Optional[TransformFn] = None
    holdout: float = 0.0
    part: str = "train"
    validation: Optional[ValidationSpec] = None
    prefetch_row_groups: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size!r} must be a positive integer")
        if self.shuffle_buffer_batches < 1:
            raise ConfigError(f"shuffle_buffer_batches={self.shuffle_buffer_batches!r} must be >= 1")
        if self.reader_threads < 1:
            raise ConfigError(f"reader_threads={self.reader_threads!r} must be >= 1")
        if not 0.0 <= self.holdout < 1.0:
            raise ConfigError(f"holdout={self.holdout!r} must be a fraction in [0, 1)")
        if self.part not in ("train", "holdout"):
            raise ConfigError(f"part={self.part!r} must be 'train' or 'holdout'")
        if self.transform_fn is not None and not callable(self.transform_fn):
            raise ConfigError(f"transform_fn={self.transform_fn!r} is not callable")
        if self.prefetch_row_groups < 1:
            raise ConfigError(f"prefetch_row_groups={self.prefetch_row_groups!r} must be >= 1")


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
    """Plug-in point for turning a shard of Parquet into numpy chunks of any size.

    Subclasses set ``name`` (``reader="name"`` then selects them) and implement
    :meth:`read_pass` — one pass over the rank's shard, which also serves the validation pass —
    or, for training only, :meth:`chunks`.
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _READERS[cls.name] = cls

    def read_pass(self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int) -> Iterator[Chunk]:
        """One pass over this rank's shard (seeded ``spec.seed + pass_index``), honouring
        ``spec``'s filters and hold-out part. Must close its resources when closed."""
        raise NotImplementedError(f"reader {self.name or type(self).__name__!r} cannot read single passes (validation)")

    def chunks(self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int) -> Iterator[Chunk]:
        """Endless (features, labels) chunks of this rank's shard: :meth:`read_pass` for pass
        0, 1, 2, ... Must close its resources when the generator is closed."""
        for pass_index in itertools.count():
            rows = 0
            for chunk in self.read_pass(dataset, spec, rank, world_size, pass_index):
                rows += len(chunk[0])
                yield chunk
            if rows == 0:
                narrowed = " after filters and the validation hold-out" if spec.filters is not None or spec.holdout else ""
                raise DataError(f"rank {rank} read no rows from its shard of dataset {dataset.url!r}{narrowed}")


def reader_from_name(name: str) -> DataReader:
    from sparkdl.data import arrow_reader  # noqa: F401 - registers "arrow" (it imports this module)

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
            if spec.shuffle and len(pending) == 1:
                features, labels = pending[0]  # the shuffle's gather below copies it anyway
            else:
                # Also copies a lone chunk: readers may hand out read-only views of Arrow buffers.
                features = np.concatenate([c[0] for c in pending])
                labels = np.concatenate([c[1] for c in pending]) if pending[0][1] is not None else None
            if spec.shuffle:
                order = rng.permutation(len(features))
                features = features[order]
                labels = labels[order] if labels is not None else None
            full = (len(features) // spec.batch_size) * spec.batch_size
            for start in range(0, full, spec.batch_size):
                stop = start + spec.batch_size
                batch = features[start:stop], (labels[start:stop] if labels is not None else None)
                yield apply_transform(spec.transform_fn, *batch) if spec.transform_fn is not None else batch
            pending = [(features[full:], labels[full:] if labels is not None else None)] if full < len(features) else []
            pending_rows = len(features) - full
    finally:
        source.close()


def apply_transform(transform_fn: TransformFn, features: np.ndarray, labels: Optional[np.ndarray]) -> Chunk:
    """Runs the user's per-batch transform and checks what it returns."""
    result = transform_fn(features, labels)
    if not isinstance(result, tuple) or len(result) != 2:
        raise ConfigError(f"transform_fn must return a (features, labels) tuple of numpy arrays, got {type(result).__name__}")
    new_features, new_labels = result
    if not isinstance(new_features, np.ndarray) or (new_labels is not None and not isinstance(new_labels, np.ndarray)):
        raise ConfigError(
            f"transform_fn must return numpy arrays, got ({type(new_features).__name__}, {type(new_labels).__name__})"
        )
    if len(new_features) != len(features) or (new_labels is not None and len(new_labels) != len(features)):
        raise ConfigError(
            f"transform_fn must keep the batch's {len(features)} rows, returned {len(new_features)} features"
            + (f" and {len(new_labels)} labels" if new_labels is not None else "")
            + "; use filters= to drop rows"
        )
    return np.ascontiguousarray(new_features), (np.ascontiguousarray(new_labels) if new_labels is not None else None)


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
    if labels.dtype.kind == "f" and np.isnan(labels).any():
        raise DataError(f"label column {label_info.name} contains NaN or null values in {source}")
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
    Petastorm datasets with a Unischema (codecs such as images stored as ndarrays).

    Petastorm 0.12's own ``filters=`` only prunes Hive partition directories (its legacy
    ``ParquetDataset`` ignores other columns), so row filters are evaluated here, on the
    filter's columns, which are read along with the data.
    """

    name = "petastorm"

    def read_pass(self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int) -> Iterator[Chunk]:
        from sparkdl.data.selection import PositionCursor, RowSelector, pass_row_groups

        selector = RowSelector(dataset, spec.holdout, spec.part, spec.filters, rank, world_size)
        seed = spec.seed + pass_index
        order = pass_row_groups(dataset.num_row_groups, rank, world_size, seed, spec.shuffle)
        # Striding always reads with one thread (see _open); otherwise more threads mean a varying order.
        ordered = spec.reader_threads == 1 or selector.striding
        if selector.needs_positions and not ordered:
            raise ConfigError(
                "reader_threads > 1 reads row groups in a varying order, so rows cannot be matched to their "
                "positions, which the validation hold-out needs"
            )
        feature_names = [c.name for c in dataset.features]
        label_name = dataset.label.name if dataset.label else None
        extra = [c for c in dataset.filter_columns if c not in dataset.columns]
        source = f"dataset {dataset.url!r}"
        cursor = PositionCursor(selector, order)
        # make_batch_reader hands out one whole row group per item and skips empty ones: the
        # expected sizes catch a Petastorm whose order differs from selection.pass_row_groups.
        expected = iter([dataset.row_group_rows[g] for g in order if dataset.row_group_rows[g] > 0])
        reader = self._open(dataset, spec, rank, world_size, selector.striding, seed, dataset.columns + extra)
        try:
            for item in _row_batches(reader, spec.batch_size) if dataset.is_petastorm else reader:
                columns = [np.asarray(getattr(item, name)) for name in feature_names]
                label = np.asarray(getattr(item, label_name)) if label_name else None
                count = len(columns[0])
                if ordered and not dataset.is_petastorm and count != next(expected, None):
                    raise DataError(
                        f"Petastorm returned a row group of {count} rows where {source} has a different one next; "
                        f"its row-group order differs from the one sparkdl expects (Petastorm version?)"
                    )
                positions = cursor.take(count) if selector.needs_positions else None
                filter_table = None
                if selector.expression is not None:
                    filter_table = pa.table({c: _arrow_column(getattr(item, c)) for c in dataset.filter_columns})
                keep = selector.keep(positions, filter_table)
                if keep is not None:
                    if not keep.any():
                        continue
                    columns = [c[keep] for c in columns]
                    label = label[keep] if label is not None else None
                yield to_arrays(columns, label, dataset.features, dataset.label, source)
        finally:
            reader.stop()
            reader.join()

    @staticmethod
    def _open(dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, striding: bool, seed: int, columns: List[str]):
        with warnings.catch_warnings():
            # Petastorm 0.12 calls pyarrow's legacy API, which warns on every call.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            from petastorm import make_batch_reader, make_reader

            if dataset.is_petastorm:
                factory, location = make_reader, dataset.url
            else:
                # The explicit file list fixes Petastorm's row-group order to DatasetInfo.files.
                factory, location = make_batch_reader, [f.url for f in dataset.files]
            return factory(
                location,
                filesystem=_legacy_filesystem(dataset.url),
                schema_fields=columns,
                reader_pool_type="thread",
                # Row striding needs every rank to see rows in the same order: one thread.
                workers_count=1 if striding else spec.reader_threads,
                # Without shuffling no seed: Petastorm would still shuffle row groups before sharding.
                seed=seed if spec.shuffle else None,
                shuffle_row_groups=spec.shuffle,
                num_epochs=1,
                cur_shard=None if striding else rank,
                shard_count=None if striding else world_size,
            )


def _legacy_filesystem(url: str):
    """None for the schemes Petastorm opens itself (file, hdfs); otherwise the URL's fsspec
    filesystem behind pyarrow's legacy interface. Petastorm 0.12 hands other schemes' fsspec
    filesystems straight to ``pyarrow.parquet.ParquetDataset`` with legacy-only arguments, which
    pyarrow >= 13 rejects ("validate_schema is not yet supported with the new Dataset API",
    uber/petastorm#758); a legacy filesystem keeps it on the legacy code path that works."""
    import urllib.parse

    if urllib.parse.urlparse(url).scheme in ("", "file", "hdfs"):
        return None
    import fsspec
    import pyarrow.filesystem as legacy

    class _FsspecLegacy(legacy.DaskFileSystem):
        # The legacy wrapper lacks these two, which ParquetDataset calls.
        def isfile(self, path: str) -> bool:
            return self.fs.isfile(path)

        def isdir(self, path: str) -> bool:
            return self.fs.isdir(path)

    return _FsspecLegacy(fsspec.core.url_to_fs(url)[0])


def _arrow_column(values: np.ndarray) -> pa.Array:
    """A filter column as Arrow; NaN becomes null, as Petastorm turned nulls into NaN."""
    if values.ndim > 1:
        return pa.array(list(values))
    return pa.array(values, from_pandas=True)


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
