"""What a task reads and how it batches it: :class:`DataSpec` (with :class:`ValidationSpec`),
the contract every reader (:mod:`sparkdl.data.readers.base`) and the batching
(:mod:`sparkdl.data.batching`) are given, and the types of the user's per-batch functions.

It sits below the reader plug-in point, so that a reader's base module owns the spec it reads
by without importing what is built on the readers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np

from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.shard_cache import Decision
from sparkdl.errors import ConfigError

#: Model inputs of a batch: one array (``feature_cols``) or a dict of named arrays (``inputs=``).
Inputs = Union[np.ndarray, Dict[str, np.ndarray]]
#: ``transform_fn(features, labels) -> (features, labels)``: numpy in, numpy out, same row count
#: (``features`` is the dict of named inputs with ``inputs=``).
TransformFn = Callable[[Inputs, Optional[np.ndarray]], Tuple[Inputs, Optional[np.ndarray]]]
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
        transform_fn: ``(features, labels) -> (features, labels)`` on numpy arrays (with
            ``inputs=``, ``features`` is the dict of named inputs), applied to every batch on the
            executor (on the decode threads); must keep the row count.
        holdout: fraction of rows held out of training for validation (by row position).
        part: ``"train"`` reads the rows not held out, ``"holdout"`` only the held-out ones.
        validation: the validation pass, or None for none.
        prefetch_row_groups: row groups the Arrow reader reads ahead in the background; None:
            two, or the decode threads when there are more (each reads one at a time).
        decode_threads: the task's decode workers: threads that read and decode row groups at
            once (the Arrow reader) and finish batches (decode images, apply ``transform_fn``)
            ahead of the training step; None uses the task's cores (``spark.task.cpus``). Runs
            without images or ``transform_fn`` finish batches inline: there is nothing to decode.
        shard_cache: the driver's shard-cache decision (:mod:`sparkdl.data.shard_cache`): with a
            budget, the reader keeps the rank's decoded row groups in memory after its first pass.
        pass_marks: set by :func:`~sparkdl.data.batching.batches` on a shuffled stream: a reader's ``chunks`` also
            yields ``PASS_END`` after each pass, and every chunk carries its rows' positions
            (``POSITION_KEY``), so that an epoch is one pass (:func:`~sparkdl.data.batching.cut_stream`).
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
    prefetch_row_groups: Optional[int] = None
    decode_threads: Optional[int] = None
    pass_marks: bool = False
    shard_cache: Optional[Decision] = None

    def decode_thread_count(self) -> int:
        """The decode threads of a task: ``decode_threads``, else the task's cores."""
        if self.decode_threads is not None:
            return self.decode_threads
        import torch

        # The launcher sets torch's threads to the task's cores (spark.task.cpus).
        return max(1, torch.get_num_threads())

    def read_ahead(self) -> int:
        """Row groups the Arrow reader reads ahead: ``prefetch_row_groups``, else two or, when
        there are more, one per decode thread (so that every thread has one to read)."""
        if self.prefetch_row_groups is not None:
            return self.prefetch_row_groups
        return max(2, self.decode_thread_count())

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
        if self.prefetch_row_groups is not None and self.prefetch_row_groups < 1:
            raise ConfigError(f"prefetch_row_groups={self.prefetch_row_groups!r} must be >= 1")
        if self.decode_threads is not None and (
            not isinstance(self.decode_threads, int) or isinstance(self.decode_threads, bool) or self.decode_threads < 1
        ):
            raise ConfigError(
                f"decode_threads={self.decode_threads!r} must be a positive integer or None (the task's cores)"
            )
