"""Executor side: one task's scoring — threads, device, the cached model, and the loop over its
record batches with their slices prepared ahead (:class:`~sparkdl.inference.scorer.Scorer`,
which enters this for every task, says what each step does)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Tuple

import pyarrow as pa
import torch

from sparkdl._spark import task_threads
from sparkdl.data.batching import finish_in_order
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
        self.threads = 1
        #: Threads preparing slices ahead of the model (0: inline).
        self.decode_threads = 0
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
            self.runner = ModelRunner(
                module,
                assignment.device,
                options.precision,
                options.batch_size,
                key=self.scorer.ref.key,
                optimize=options.optimize,
            )
            # Decoding images (Pillow and numpy release the GIL) overlaps the model; plain
            # numbers are converted inline, where a thread would only add hand-offs.
            if self.scorer.plan.expensive:
                self.decode_threads = options.decode_threads or self.threads
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

        def prepare(_: int, piece: _Slice) -> Tuple[_Slice, Any]:
            return piece, scorer.try_prepare(piece[1])

        # The data path's own in-order finisher: at most twice the threads' slices in flight.
        for (source, rows, last), prepared in finish_in_order(self._slices(batches), prepare, 0, self.decode_threads):
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
