"""The data-reader plug-in point: how a task turns its shard of Parquet into named columns.

A reader implements :meth:`DataReader.read_pass` — one pass over a rank's shard, honouring the
shared selection rules of :mod:`sparkdl.data.selection` (row groups per rank and their order,
filters, the validation hold-out) — and yields :data:`Chunk`\\ s: the named columns it read, run
through :meth:`InputPlan.extract <sparkdl.data.plan.InputPlan.extract>` (the one place that
knows how columns become arrays), with each row's position in the dataset. Everything after
that (shuffle, batches, decoding, transforms, tensors) is :mod:`sparkdl.data.batching`, the same
for every reader.

A new reader subclasses :class:`DataReader` and sets ``name``: defining the class registers it
(``__init_subclass__``), so its module must be imported before ``reader=`` names it; it joins
the reader contract test (``tests/unit/test_reader_contract.py``) by adding its name there.

This module is the contract only: it imports no reader. The built-in ones are imported, and so
registered, by the package (:mod:`sparkdl.data.readers`), which also holds the lookup by name
(:func:`~sparkdl.data.readers.reader_from_name`); the spec a reader reads by is
:class:`~sparkdl.data.spec.DataSpec`.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from typing import ClassVar, Dict, Iterable, Iterator, Optional, Type

import numpy as np

from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.shard_cache import ShardCache
from sparkdl.data.spec import DataSpec
from sparkdl.errors import DataError

#: Row-aligned arrays of some rows of a shard, as :meth:`InputPlan.extract` makes them.
Chunk = Dict[str, np.ndarray]

#: Every defined reader class by name (filled by ``DataReader.__init_subclass__``); looked up
#: by :func:`sparkdl.data.readers.reader_from_name`.
_READERS: Dict[str, Type["DataReader"]] = {}
#: The reader used when none is named (see docs/data.md for the measurements behind it).
DEFAULT_READER = "arrow"


class DataReader(abc.ABC):
    """Plug-in point for turning a shard of Parquet into chunks of named columns.

    Subclasses set ``name`` (``reader="name"`` then selects them) and implement
    :meth:`read_pass` — one pass over the rank's shard, which also serves the validation pass.
    """

    name: ClassVar[str] = ""
    #: One line for ``--help`` and error messages.
    description: ClassVar[str] = ""
    #: Whether it reads dense arrays stored as float32 bytes (:mod:`sparkdl.data.tensor_bytes`):
    #: DataFrames materialized for it are then written that way, which decodes several times
    #: faster than Parquet lists. Readers that decode through :mod:`sparkdl.data.columns` do.
    reads_tensor_bytes: ClassVar[bool] = False
    #: Whether :meth:`passes` keeps row groups in the :class:`~sparkdl.data.shard_cache.ShardCache`
    #: it is given (readers whose chunks are a pure function of the row group can).
    caches_row_groups: ClassVar[bool] = False
    #: Whether a checkpoint written by another number of workers can be resumed reading with it
    #: (elastic resume, ``min_workers``): the interrupted epoch's remaining rows are replayed by
    #: :mod:`sparkdl.data.reshard` through the Arrow reader's code, so the reader's chunks must be
    #: the Arrow reader's rows in its order — true of it and of readers that subclass it.
    reshardable: ClassVar[bool] = False
    #: The training stream's shard cache on this rank (run_info reports it); None: streaming.
    shard_cache: Optional[ShardCache] = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _READERS[cls.name] = cls

    @abc.abstractmethod
    def read_pass(
        self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int
    ) -> Iterator[Chunk]:
        """One pass over this rank's shard (seeded ``spec.seed + pass_index``), honouring
        ``spec``'s filters and hold-out part. Must close its resources when closed."""

    def check(self, dataset: DatasetInfo) -> None:
        """Raises ConfigError, on the driver before launch, when this reader cannot read what
        the dataset's input plan needs."""

    def chunks(self, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int) -> Iterator[Chunk]:
        """Endless chunks of this rank's shard: pass 0, 1, 2, ... (:meth:`passes`); a pass that
        gives no rows fails naming the rank. With ``spec.pass_marks``, each pass is followed by
        :data:`PASS_END` (and :meth:`read_pass` should put each row's position under
        ``POSITION_KEY``). Must close its resources when the generator is closed."""
        rows = 0
        budget = spec.shard_cache.budget_bytes if spec.shard_cache is not None else None
        self.shard_cache = (
            ShardCache(budget, rank, dataset.name, images_decoded=dataset.plan.converts_kept)
            if budget and self.caches_row_groups
            else None
        )
        for chunk in self.passes(dataset, spec, rank, world_size, itertools.count(), self.shard_cache):
            if chunk is PASS_END:
                if rows == 0:
                    narrowed = (
                        " after filters and the validation hold-out" if spec.filters is not None or spec.holdout else ""
                    )
                    raise DataError(f"rank {rank} read no rows from its shard of {dataset.name}{narrowed}")
                rows = 0
                if spec.pass_marks:
                    yield PASS_END
                continue
            rows += chunk_rows(chunk)
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
        """The chunks of the passes ``pass_indexes``, one pass after the other, each followed by
        :data:`PASS_END`: :meth:`read_pass` per pass. A reader that reads ahead across the
        passes' boundaries overrides it; one with ``caches_row_groups`` serves the row groups
        ``cache`` holds from it and fills it (this one streams every pass)."""
        for pass_index in pass_indexes:
            # closing(): closing this generator closes the pass's reader at once, not whenever
            # the garbage collector gets to it.
            with contextlib.closing(self.read_pass(dataset, spec, rank, world_size, pass_index)) as stream:
                yield from stream
            yield PASS_END


#: Ends a pass in :meth:`DataReader.passes` (compared by identity; a real chunk has rows).
PASS_END: Chunk = {}


def chunk_rows(chunk: Chunk) -> int:
    return len(next(iter(chunk.values()))) if chunk else 0
