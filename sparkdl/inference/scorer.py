"""Executor side: Arrow record batches in, the same rows with prediction columns out.

A :class:`Scorer` is built on the driver (:func:`sparkdl.inference.transform.scorer_for`) and
called by ``mapInArrow`` in every task, or by a predict job per input part. Per task it

1. sets torch's threads to the task's CPUs and selects the task's device (the GPU Spark
   assigned, as training does);
2. takes the model from this Python worker's cache, or builds it once
   (:mod:`sparkdl.inference.model_cache`);
3. cuts the rows into batches of ``batch_size`` and turns each into model inputs with the
   training run's own input plan (the same columns, image decoding, sequences, named inputs),
   on decode threads ahead of the model when the inputs need decoding;
4. runs the model (:class:`~sparkdl.inference.execution.ModelRunner`) and appends each head's
   column, Arrow all the way: no pandas in the loop.

A batch that fails — an input that cannot be decoded or converted, a model that raises on a
row, an output that is not finite — is bisected down to the rows that fail, so the good rows in
it are scored. With ``on_error="null"`` the bad rows get a null prediction and the reason in
the error column; with ``"fail"`` the task fails naming the first such row (the partition and
the row's place in it) and what to change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from sparkdl.data.batching import frame_batch
from sparkdl.data.columns import ColumnInfo
from sparkdl.data.plan import InputPlan
from sparkdl.errors import ConfigError, DataError
from sparkdl.inference.api import InferenceOptions
from sparkdl.inference.model_source import ModelRef
from sparkdl.inference.outputs import Head, fields, head_arrays
from sparkdl.inference.scoring_task import ScoringTask

#: How much of a reason the error column keeps.
_REASON_CHARS = 400

#: A batch of at least this many rows in which every row fails the model the same way is a
#: model that does not fit its input, not a batch of bad rows: the task fails even with "null".
_SYSTEMATIC_ROWS = 16


class ScoringError(DataError):
    """A row could not be scored with ``on_error="fail"``."""


@dataclasses.dataclass
class _Scored:
    """Outputs of consecutive rows: each head's ``[rows, size]`` values, which rows are valid,
    and each invalid row's reason (prefixed by where it failed)."""

    values: Dict[str, np.ndarray]
    valid: np.ndarray
    reasons: List[Optional[str]]

    @staticmethod
    def join(parts: Sequence["_Scored"]) -> "_Scored":
        if len(parts) == 1:
            return parts[0]
        return _Scored(
            {name: np.concatenate([p.values[name] for p in parts]) for name in parts[0].values},
            np.concatenate([p.valid for p in parts]),
            [reason for p in parts for reason in p.reasons],
        )


class Scorer:
    """Scores Arrow record batches with one model (see the module docstring). Picklable.

    Args:
        ref: where the model's bytes are, and its identity.
        plan: the model's input plan (the training run's inputs, no label).
        infos: what each input column holds, from the DataFrame's schema.
        heads: the model's outputs and their columns.
        options: validated scoring options.
        source: the input, as errors name it (e.g. "the DataFrame to transform").
    """

    def __init__(
        self,
        ref: ModelRef,
        plan: InputPlan,
        infos: Dict[str, ColumnInfo],
        heads: Sequence[Head],
        options: InferenceOptions,
        prediction_col: str,
        source: str,
    ) -> None:
        self.ref, self.plan, self.infos, self.heads = ref, plan, dict(infos), list(heads)
        self.options, self.source = options, source
        self.error_column: Optional[str] = (
            (options.error_col or f"{prediction_col}_error") if options.on_error == "null" else None
        )

    @property
    def model_key(self) -> str:
        return self.ref.key

    @property
    def input_columns(self) -> List[str]:
        """The columns the model reads."""
        return list(self.plan.columns)

    def new_columns(self) -> List[pa.Field]:
        """The columns scoring appends: one per head, then the error column with ``on_error="null"``."""
        extra = fields(self.heads, self.options)
        if self.error_column is not None:
            extra.append(pa.field(self.error_column, pa.string()))
        return extra

    def output_schema(self, input_schema: pa.Schema) -> pa.Schema:
        """``input_schema`` followed by :meth:`new_columns`."""
        return pa.schema([*input_schema, *self.new_columns()])

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        with ScoringTask(self) as task:
            yield from task.score(batches)

    # ---- one slice of rows (called by the task, on its own thread) ----------------------------

    def prepare(self, rows: pa.RecordBatch) -> Any:
        """Model inputs of ``rows`` (the plan's extract and finish); raises what they raise."""
        columns = {name: rows.column(name) for name in self.plan.columns}
        return frame_batch(self.plan, columns, self.infos, self.source)

    def score(self, rows: pa.RecordBatch, prepared: Tuple[bool, Any], run: Any) -> _Scored:
        """:meth:`score_slice` of a whole batch, which fails the task when every row of it
        makes the model fail the same way: a model that does not fit its input, not bad rows."""
        scored = self.score_slice(rows, prepared, run)
        reasons = set(scored.reasons)
        if rows.num_rows >= _SYSTEMATIC_ROWS and not scored.valid.any() and len(reasons) == 1:
            reason = reasons.pop()
            if reason and reason.startswith("the model raised"):
                raise DataError(
                    f"every row of a batch of {rows.num_rows} from {self.source} makes the model fail the same way "
                    f"({reason}): the model does not fit this input (check its input columns and shapes), so no "
                    f"row is scored"
                )
        return scored

    def score_slice(
        self, rows: pa.RecordBatch, prepared: Tuple[bool, Any], run: Any, batch_reason: Optional[str] = None
    ) -> _Scored:
        """Outputs of ``rows``; ``prepared`` is ``(True, inputs)`` or ``(False, the exception)``.
        A failing slice is bisected (its halves prepared again) down to its failing rows;
        ``batch_reason`` is why an enclosing slice's input could not be made (a row too short
        for its batch is only one the model rejects once it is alone: both reasons are kept)."""
        ok, value = prepared
        if ok:
            try:
                values = run(value)
            except ConfigError:
                raise  # the device or the model's setup, not this row: no row would score
            except Exception as exc:  # noqa: BLE001 - any error of the model on these rows
                reason = f"the model raised {_describe(exc)}"
                if batch_reason:
                    reason += f" (with the rows around it, {batch_reason})"
                return self._bisect(rows, run, reason, batch_reason)
            finite = np.ones(rows.num_rows, dtype=bool)
            for array in values.values():
                finite &= np.isfinite(array).all(axis=1)
            reasons: List[Optional[str]] = [
                None if good else "the model's output is not finite (NaN or infinity)" for good in finite
            ]
            return _Scored(values, finite, reasons)
        reason = f"its input cannot be made: {_describe(value)}"
        return self._bisect(rows, run, reason, batch_reason or reason)

    def _bisect(self, rows: pa.RecordBatch, run: Any, reason: str, batch_reason: Optional[str]) -> _Scored:
        if rows.num_rows == 1:
            return _Scored(
                {h.name: np.full((1, h.size), np.nan, np.float32) for h in self.heads}, np.zeros(1, bool), [reason]
            )
        half = rows.num_rows // 2
        parts = []
        for piece in (rows.slice(0, half), rows.slice(half)):
            parts.append(self.score_slice(piece, self.try_prepare(piece), run, batch_reason))
        return _Scored.join(parts)

    def try_prepare(self, rows: pa.RecordBatch) -> Tuple[bool, Any]:
        """``(True, model inputs)`` of ``rows``, or ``(False, the exception)`` for rows that
        cannot be decoded or converted (decode threads call this)."""
        try:
            return True, self.prepare(rows)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a row that cannot be decoded or converted
            return False, exc

    @staticmethod
    def join(parts: Sequence[_Scored]) -> _Scored:
        """Consecutive slices' outputs as one."""
        return _Scored.join(parts)

    # ---- a record batch's output ---------------------------------------------------------------

    def finish(self, rows: pa.RecordBatch, scored: _Scored, first_row: int, partition: int) -> pa.RecordBatch:
        """``rows`` with the prediction columns of ``scored``; raises for a bad row with "fail"."""
        if self.error_column is None and not scored.valid.all():
            bad = int(np.flatnonzero(~scored.valid)[0])
            raise ScoringError(
                f"sparkdl could not score row {first_row + bad} (counting from 0) of partition {partition} of "
                f"{self.source}: {scored.reasons[bad]}. Fix or filter such rows, or pass on_error='null' to give "
                f"them a null prediction and the reason in an error column (the job then counts them)"
            )
        columns = list(rows.columns)
        for head in self.heads:
            columns.append(head_arrays(head, scored.values[head.name], scored.valid, self.options.top_k))
        if self.error_column is not None:
            columns.append(pa.array([r[:_REASON_CHARS] if r else None for r in scored.reasons], pa.string()))
        return pa.RecordBatch.from_arrays(columns, schema=self.output_schema(rows.schema))


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
