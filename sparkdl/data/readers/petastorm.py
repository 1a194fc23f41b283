"""The Petastorm reader: ``reader="petastorm"``.

``make_batch_reader`` for plain Parquet, ``make_reader`` for Petastorm datasets with a Unischema
(codecs such as images stored as ndarrays or compressed images, which Petastorm decodes).
It follows the selection rules of :mod:`sparkdl.data.selection` so that it hands out the same
rows, in the same order, as the Arrow reader; its columns become arrays in
:meth:`InputPlan.extract <sparkdl.data.plan.InputPlan.extract>` like every reader's.
"""

from __future__ import annotations

import warnings
from typing import Dict, Iterator, List

import numpy as np
import pyarrow as pa

from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.inputs import POSITION_KEY
from sparkdl.data.petastorm_schema import petastorm_problem
from sparkdl.data.readers.base import Chunk, DataReader
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError, DataError


class PetastormReader(DataReader):
    """Streams through Petastorm: ``make_batch_reader`` for plain Parquet, ``make_reader`` for
    Petastorm datasets with a Unischema (codecs such as images stored as ndarrays).

    Petastorm 0.12's own ``filters=`` only prunes Hive partition directories (its legacy
    ``ParquetDataset`` ignores other columns), so row filters are evaluated here, on the
    filter's columns, which are read along with the data.
    """

    name = "petastorm"
    description = "Petastorm's make_batch_reader / make_reader (needs petastorm and pyarrow < 15)"
    # Petastorm hands a binary column out as Python bytes per row, which sparkdl.data.columns
    # joins into one float32 matrix: 1.7x Petastorm's own decoding of a list<float> column
    # (benchmarks/data_readers.py, 64 floats per row).
    reads_tensor_bytes = True

    def __init__(self) -> None:
        problem = petastorm_problem()
        if problem:
            raise ConfigError(
                f"reader='petastorm' cannot run here: {problem}. Install it with pip install 'sparkdl-torch[petastorm]': Petastorm 0.12 "
                f"needs pyarrow's legacy API (pyarrow < 15), so it runs beside PySpark 3.5 or 4.0 with pyarrow 14, numpy 1 "
                f"and pandas 2. The default reader='arrow' needs none of this and reads the same data"
            )

    def check(self, dataset: DatasetInfo) -> None:
        from sparkdl.data.inputs import Sequence

        # Petastorm reads the files' columns as they are stored, every row of them.
        needs = dataset.layout.changes(dataset.columns + list(dataset.filter_columns)) if dataset.layout else []
        if needs:
            raise ConfigError(
                f"reader='petastorm' cannot read {dataset.name} in place: its table has {' and '.join(needs)}, which "
                f"only its log describes; use reader='arrow' (the default), or have the table copied first "
                f"(connectors.DeltaSource(..., materialize='always'))"
            )

        specs = [(key, spec) for key, spec in dataset.plan.inputs] + (
            [("label", dataset.plan.label)] if dataset.plan.label else []
        )
        ragged = [key for key, spec in specs if isinstance(spec, Sequence)]
        if ragged and not dataset.is_petastorm:
            raise ConfigError(
                f"reader='petastorm' cannot read the variable-length arrays of sparkdl.Sequence input(s) {', '.join(map(repr, ragged))}: "
                f"Petastorm's make_batch_reader stacks every list column into one matrix and fails on rows of different "
                f"lengths; use reader='arrow' (the default)"
            )

    def read_pass(
        self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int
    ) -> Iterator[Chunk]:
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
        infos = dataset.infos
        extra = [c for c in dataset.filter_columns if c not in dataset.columns]
        source = dataset.name
        cursor = PositionCursor(selector, order)
        # make_batch_reader hands out one whole row group per item and skips empty ones: the
        # expected sizes catch a Petastorm whose order differs from selection.pass_row_groups.
        expected = iter([dataset.row_group_rows[g] for g in order if dataset.row_group_rows[g] > 0])
        reader = self._open(dataset, spec, rank, world_size, selector.striding, seed, dataset.columns + extra)
        try:
            for item in _row_batches(reader, spec.batch_size) if dataset.is_petastorm else reader:
                columns = {name: np.asarray(getattr(item, name)) for name in dataset.columns}
                count = len(next(iter(columns.values())))
                if ordered and not dataset.is_petastorm and count != next(expected, None):
                    raise DataError(
                        f"Petastorm returned a row group of {count} rows where {source} has a different one next; "
                        f"its row-group order differs from the one sparkdl expects (Petastorm version?)"
                    )
                positions = cursor.take(count) if ordered else None
                filter_table = None
                if selector.expression is not None:
                    filter_table = pa.table({c: _arrow_column(getattr(item, c)) for c in dataset.filter_columns})
                keep = selector.keep(positions, filter_table)
                if keep is not None:
                    if not keep.any():
                        continue
                    columns = {name: values[keep] for name, values in columns.items()}
                    positions = positions[keep] if positions is not None else None
                where = dataset.row_group_of(int(positions[0])) if positions is not None and len(positions) else source
                chunk = dataset.plan.extract(columns, infos, where, positions)
                if spec.pass_marks and positions is not None:
                    chunk.setdefault(POSITION_KEY, positions)
                yield chunk
        finally:
            reader.stop()
            reader.join()

    @staticmethod
    def _open(
        dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, striding: bool, seed: int, columns: List[str]
    ):
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
    return _Columns({f: _stack([getattr(r, f) for r in rows]) for f in fields})


def _stack(values: List[object]) -> np.ndarray:
    """Values of one field as one array; an object array when shapes differ (images of
    several sizes, variable-length sequences)."""
    from sparkdl.data.columns import object_rows

    try:
        return np.stack(values)
    except ValueError:
        return object_rows(values)
