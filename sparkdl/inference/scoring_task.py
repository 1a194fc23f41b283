"""Executor side: one task's scoring — threads, device, the cached model, and the loop over its
record batches with their slices prepared ahead (:class:`~sparkdl.inference.scorer.Scorer`,
which enters this for every task, says what each step does)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
from typing import Any, Deque, Iterator, List, Optional, Tuple

import pyarrow as pa
import torch

from sparkdl._spark import task_threads
from sparkdl.inference.execution import ModelRunner, current_task, task_device
from sparkdl.inference.model_cache import cached_model

logger = logging.getLogger("sparkdl.inference")

#: A slice of the task's input: (its record batch, the slice's rows, is it that batch's last).
_Slice = Tuple[pa.RecordBatch, pa.RecordBatch, bool]


class ScoringTask:
    """The state of one task's scoring, entered for the task's duration."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer
        self.stack = contextlib.ExitStack()
        self.partition = 0
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.threads = 1
        self.bad_rows = 0

    def __enter__(self) -> "ScoringTask":
        context = current_task()
        if context is not None:
            self.partition = context.partitionId()
            self.threads = task_threads(context)
            torch.set_num_threads(self.threads)
        options = self.scorer.options
        try:
            assignment = self.stack.enter_context(task_device(options.use_gpu))
            module = cached_model(self.scorer.ref.key, assignment.device, self.scorer.ref.build)
            self.runner = ModelRunner(module, assignment.device, options.precision, options.batch_size)
            # Decoding images (Pillow and numpy release the GIL) overlaps the model; plain
            # numbers are converted inline, where a thread would only add hand-offs.
            if self.scorer.plan.expensive:
                workers = options.decode_threads or self.threads
                self.pool = self.stack.enter_context(
                    concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="sparkdl-score-decode")
                )
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stack.close()
        if self.bad_rows:
            logger.warning(
                "partition %d: %d row(s) could not be scored (null predictions)", self.partition, self.bad_rows
            )

    def score(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The task's output batches, one per input record batch, in order."""
        scorer = self.scorer
        pending: List[Any] = []
        first_row = 0
        ahead = 2 * (self.pool._max_workers if self.pool is not None else 1)
        work = ((piece, lambda item: scorer.try_prepare(item[1])) for piece in self._slices(batches))
        for (source, rows, last), prepared in in_order(self.pool, work, ahead):
            pending.append(scorer.score(rows, prepared, self.runner))
            if last:
                whole = scorer.join(pending)
                self.bad_rows += int((~whole.valid).sum())
                yield scorer.finish(source, whole, first_row, self.partition)
                first_row += source.num_rows
                pending = []

    def _slices(self, batches: Iterator[pa.RecordBatch]) -> Iterator[_Slice]:
        size = self.scorer.options.batch_size
        for batch in batches:
            # An empty batch has nothing to score and no columns to add rows to: it is dropped.
            for start in range(0, batch.num_rows, size):
                yield batch, batch.slice(start, size), start + size >= batch.num_rows


def in_order(
    pool: Optional[concurrent.futures.ThreadPoolExecutor], work: Iterator[Tuple[Any, Any]], ahead: int
) -> Iterator[Tuple[Any, Any]]:
    """``(item, fn(item))`` for ``(item, fn)`` pairs in order, ``ahead`` of them computing on
    ``pool`` at once (inline without a pool)."""
    if pool is None:
        for item, fn in work:
            yield item, fn(item)
        return
    flight: Deque[Tuple[Any, concurrent.futures.Future]] = collections.deque()
    try:
        for item, fn in work:
            flight.append((item, pool.submit(fn, item)))
            if len(flight) >= ahead:
                done, future = flight.popleft()
                yield done, future.result()
        while flight:
            done, future = flight.popleft()
            yield done, future.result()
    finally:
        for _, future in flight:
            future.cancel()
