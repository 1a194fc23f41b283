"""A model's outputs as prediction columns: which heads it has, each head's Spark type for the
asked kind (:data:`~sparkdl.inference.api.OUTPUT_KINDS`), and a batch's tensors as Arrow arrays.

A model returning one tensor has one head, written to the prediction column itself; a tuple or
list of tensors has heads ``"0"``, ``"1"``...; a dict has its keys. Each head of a model with
several goes to ``<prediction>_<head>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence

import numpy as np
import pyarrow as pa

from sparkdl.inference.api import InferenceOptions


@dataclasses.dataclass(frozen=True)
class Head:
    """One output of the model: its name in the model's result, its column, values per row and kind."""

    name: str
    column: str
    size: int
    kind: str

    def arrow_type(self, top_k: int) -> pa.DataType:
        if self.kind == "label":
            return pa.int32()
        if self.kind == "top_k":
            return pa.struct([("indices", pa.list_(pa.int32())), ("scores", pa.list_(pa.float32()))])
        if self.kind == "raw" and self.size == 1:
            return pa.float32()
        return pa.list_(pa.float32())


def named_outputs(out: Any) -> Dict[str, Any]:
    """The model's result as ``{head: tensor}`` (one tensor: the head ``""``)."""
    if isinstance(out, dict):
        return {str(k): v for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return {str(i): v for i, v in enumerate(out)}
    return {"": out}


def same_outputs(expected: Any, got: Any) -> bool:
    """Whether two calls' results have the same heads, shapes and values (float tolerance: a
    frozen graph or another call size may sum in another order)."""
    import torch  # executors only: the driver builds output fields without torch

    want, have = named_outputs(expected), named_outputs(got)
    if list(want) != list(have):
        return False
    return all(
        isinstance(have[name], torch.Tensor)
        and have[name].shape == value.shape
        and torch.allclose(have[name].float(), value.float(), rtol=1e-4, atol=1e-5, equal_nan=True)
        for name, value in want.items()
    )


def fields(heads: Sequence[Head], options: InferenceOptions) -> List[pa.Field]:
    """The prediction columns' Arrow fields (nullable: a row that failed has none)."""
    return [pa.field(head.column, head.arrow_type(options.top_k)) for head in heads]


def head_arrays(head: Head, values: np.ndarray, valid: np.ndarray, top_k: int) -> pa.Array:
    """One head's column for a batch: ``values`` ``[rows, head.size]`` float32 as the model gave
    them (probabilities and top_k apply softmax here), rows not ``valid`` null."""
    rows = len(values)
    invalid = ~valid
    if head.kind == "label":
        return pa.array(values.argmax(axis=1).astype(np.int32), mask=invalid)
    if head.kind == "raw" and head.size == 1:
        return pa.array(values[:, 0].astype(np.float32, copy=False), mask=invalid)
    if head.kind in ("probabilities", "top_k"):
        values = _softmax(values)
    if head.kind == "top_k":
        k = min(top_k, head.size)
        order = np.argsort(-values, axis=1, kind="stable")[:, :k].astype(np.int32)
        scores = np.take_along_axis(values, order, axis=1).astype(np.float32)
        indices = _lists(order, k, rows, invalid)
        score_lists = _lists(scores, k, rows, invalid)
        return pa.StructArray.from_arrays([indices, score_lists], names=["indices", "scores"], mask=pa.array(invalid))
    return _lists(values.astype(np.float32, copy=False), head.size, rows, invalid)


def _lists(values: np.ndarray, width: int, rows: int, invalid: np.ndarray) -> pa.Array:
    """``rows`` lists of ``width`` values each (no copy of the values), null where ``invalid``."""
    offsets = pa.array(np.arange(0, (rows + 1) * width, width, dtype=np.int32))
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    lists = pa.ListArray.from_arrays(offsets, flat)
    if not invalid.any():
        return lists
    # A null list is a validity bit over the same offsets (pyarrow's from_arrays takes a mask
    # only in recent versions; this works on every supported one).
    validity = pa.array(~invalid).buffers()[1]
    return pa.Array.from_buffers(lists.type, rows, [validity, lists.buffers()[1]], children=[lists.values])


def _softmax(values: np.ndarray) -> np.ndarray:
    shifted = values - values.max(axis=1, keepdims=True)
    exp = np.exp(shifted, dtype=np.float32)
    return exp / exp.sum(axis=1, keepdims=True)
