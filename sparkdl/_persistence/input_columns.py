"""What a model's input columns hold — kind (float, int, binary, image struct...) and shape —
recorded with a ``TorchModel`` (``input_columns``) from its training data or an example, so
that the MLflow signature can be written and the pyfunc can read plain pandas columns the way
``transform`` reads a DataFrame's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import numpy as np
import pandas as pd
import torch

from sparkdl._driver.prepare_data import spark_column_infos
from sparkdl.data.batching import call_model, frame_batch
from sparkdl.data.columns import ColumnInfo
from sparkdl.data.plan import InputPlan
from sparkdl.errors import ConfigError


def recorded(infos: Mapping[str, ColumnInfo], plan: InputPlan) -> Dict[str, Dict[str, Any]]:
    """``input_columns`` of a plan's input columns (not the label), from what the data held."""
    return {
        c: {"kind": infos[c].kind, "shape": list(infos[c].shape), "type": infos[c].type_name}
        for c in plan.without_label().columns
    }


_IMAGE_FIELDS = {"height", "width", "nChannels", "data"}


def describe_columns(example: Any, plan: InputPlan) -> Dict[str, Dict[str, Any]]:
    """What each input column of ``example`` (a Spark or pandas DataFrame) holds, as
    :attr:`TorchModel.input_columns` records it; checked against the inputs' specs."""
    plan = plan.without_label()
    if isinstance(example, pd.DataFrame):
        missing = [c for c in plan.columns if c not in example.columns]
        if missing:
            raise ConfigError(f"example has no column(s) {missing}; its columns are: {list(example.columns)}")
        infos = {c: _pandas_column(c, example[c]) for c in plan.columns}
        plan.check(infos, "example")
    elif hasattr(example, "schema") and hasattr(example, "columns"):
        missing = [c for c in plan.columns if c not in example.columns]
        if missing:
            raise ConfigError(f"example has no column(s) {missing}; its columns are: {example.columns}")
        infos = spark_column_infos(example, plan)
    else:
        raise ConfigError(f"example must be a Spark or pandas DataFrame, got {type(example).__name__}")
    return recorded(infos, plan)


def column_infos(input_columns: Mapping[str, Mapping[str, Any]]) -> Dict[str, ColumnInfo]:
    """:class:`ColumnInfo` of recorded :attr:`TorchModel.input_columns` (plain values, as pandas holds them)."""
    return {
        name: ColumnInfo(name, column["kind"], tuple(column["shape"]), type_name=column.get("type") or column["kind"])
        for name, column in input_columns.items()
    }


def _pandas_column(name: str, values: Any) -> ColumnInfo:
    if isinstance(values, pd.DataFrame):  # a struct column
        return ColumnInfo(
            name, "image_struct" if _IMAGE_FIELDS <= set(values.columns) else "other", (), type_name="struct"
        )
    kind = values.dtype.kind
    if kind in "biuf":
        number = {"b": "bool", "i": "int", "u": "int", "f": "float"}[kind]
        return ColumnInfo(name, number, (), type_name=str(values.dtype))
    first = next((v for v in values if v is not None), None)
    if isinstance(first, (bytes, bytearray)):
        return ColumnInfo(name, "binary", (), type_name="binary")
    if isinstance(first, str):
        return ColumnInfo(name, "string", (), type_name="string")
    if isinstance(first, dict):
        return ColumnInfo(name, "image_struct" if _IMAGE_FIELDS <= set(first) else "other", (), type_name="struct")
    if isinstance(first, (list, tuple, np.ndarray)):
        array = np.asarray(first)
        element = {"b": "bool", "i": "int", "u": "int", "f": "float"}.get(array.dtype.kind, "other")
        return ColumnInfo(name, element, (None,) * max(array.ndim, 1), type_name=f"array of {array.dtype}")
    return ColumnInfo(name, "other", (), type_name=type(first).__name__)


def example_rows(example: Any, plan: InputPlan, infos: Mapping[str, ColumnInfo]) -> Dict[str, Any]:
    """The first rows of ``example`` as named columns (:func:`model_columns`)."""
    columns = plan.without_label().columns
    frame = example.head(2) if isinstance(example, pd.DataFrame) else example.select(*columns).limit(2).toPandas()
    if len(frame) == 0:
        raise ConfigError("example has no rows: give a few input rows, or output_shape=")
    return model_columns(frame, columns, infos)


def model_columns(frame: pd.DataFrame, columns: List[str], infos: Mapping[str, ColumnInfo]) -> Dict[str, Any]:
    """Named columns of ``frame`` as ``transform``'s UDF receives them: a struct column — a Series
    of dicts (how MLflow hands an object column) or of Spark Rows (``toPandas``) — as a DataFrame."""
    out: Dict[str, Any] = {}
    for column in columns:
        values = frame[column]
        if infos[column].kind == "image_struct" and not isinstance(values, pd.DataFrame):
            rows = [value.asDict() if hasattr(value, "asDict") else dict(value) for value in values]
            values = pd.DataFrame(rows, index=values.index)
        out[column] = values
    return out


def output_shapes(
    module: torch.nn.Module, plan: InputPlan, infos: Mapping[str, ColumnInfo], rows: Mapping[str, Any]
) -> Dict[str, List[int]]:
    """One row's output shape per head of the model's result on ``rows``: ``{"": shape}`` for
    one tensor, ``{"0": ..., "1": ...}`` for a tuple or list, the keys of a dict."""
    from sparkdl.inference.outputs import named_outputs

    inputs = frame_batch(plan, rows, infos, "example")
    tensors = (
        {k: torch.from_numpy(v) for k, v in inputs.items()} if isinstance(inputs, dict) else torch.from_numpy(inputs)
    )
    with torch.inference_mode():
        out = call_model(module.eval(), tensors)
    return {name: list(value.shape[1:]) for name, value in named_outputs(out).items()}
