"""A tiny Scorer with the shape of sparkdl.inference.scorer.Scorer (picklable, ``output_schema``,
``error_column``, ``model_key``, called on an iterator of record batches): ``y = 2 * x``.

Predict-job tests use it where the model does not matter, only which rows were written when.
Optionally it holds (a bounded wait) before each part once ``hold_at`` parts of an output are
committed: the test then kills the driver at a known point, without sleeping for it.
"""

from __future__ import annotations

import os
import time
from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.compute as pc


class DoublingScorer:
    """``y = 2 * x``; with ``error_column``, a negative ``x`` gives a null ``y`` and a reason.

    Args:
        error_column: the error column's name (``on_error="null"``), or None.
        hold_output: an output directory (local path) whose commits ``hold_at`` counts.
        hold_at: before scoring a part, wait while at least this many parts are committed.
        model_key: what identifies the "model" in the job record.
    """

    def __init__(
        self,
        error_column: Optional[str] = None,
        hold_output: Optional[str] = None,
        hold_at: int = 0,
        model_key: str = "doubling-v1",
    ) -> None:
        self.error_column, self.hold_output, self.hold_at, self.model_key = (
            error_column,
            hold_output,
            hold_at,
            model_key,
        )

    #: The columns the "model" reads.
    input_columns = ("x",)

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        schema = input_schema.append(pa.field("y", pa.float64()))
        return schema.append(pa.field(self.error_column, pa.string())) if self.error_column else schema

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        self._hold()
        for batch in batches:
            x = batch.column("x")
            bad = pc.less(x, 0)
            y = pc.if_else(bad, pa.scalar(None, pa.float64()), pc.multiply(x, 2.0))
            columns = list(batch.columns) + [y if self.error_column else pc.multiply(x, 2.0)]
            if self.error_column:
                columns.append(pc.if_else(bad, pa.scalar("negative x"), pa.scalar(None, pa.string())))
            yield pa.RecordBatch.from_arrays(columns, schema=self.output_schema(batch.schema))

    def _hold(self) -> None:
        if self.hold_output is None:
            return
        markers = os.path.join(self.hold_output, "_committed")
        deadline = time.monotonic() + 120
        while _count(markers) >= self.hold_at:  # the test kills this driver meanwhile
            if time.monotonic() > deadline:
                raise RuntimeError("the driver was not killed within 120 s")
            time.sleep(0.05)


def _count(directory: str) -> int:
    return len([n for n in os.listdir(directory) if n.endswith(".json")]) if os.path.isdir(directory) else 0
