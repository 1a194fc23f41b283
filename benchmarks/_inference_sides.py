"""The sides ``benchmarks/inference.py`` compares: three ways to score a DataFrame on Spark, each
a function ``(df, workload, state, batch_size) -> DataFrame`` adding ``prediction``; two ways to
write a Parquet dataset's predictions as Parquet, each a function ``(spark, path, out_dir,
workload, state, batch_size)``; and the plain loop in this process (the ceiling).

Each Spark side builds its model on the executors from the same ``state_dict`` and turns the
column into the model's input as its users do: sparkdl through its input plan, the peers with
the hand-written conversions of :mod:`_inference_workloads` (Pillow for the JPEGs, the NCHW view
of the decoded NHWC pixels).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Mapping

import numpy as np
import pandas as pd  # at the top: Spark reads the pandas_udf's type hints in this module's globals
import torch
from _inference_workloads import Workload

State = Mapping[str, torch.Tensor]


#: The rows per call of the hand-tuned predict_batch_udf side: among the smallest sparkdl tries,
#: and where the small CNN scores fastest per row on one thread here.
SMALL_CALL_ROWS = 32


def sparkdl_transform(df: Any, workload: Workload, state: State, batch_size: int) -> Any:
    """``TorchModel.from_state(...).setBatchSize(batch_size).transform(df)``: over a plain Parquet
    scan, its tasks read the files themselves (sparkdl.inference.file_scoring)."""
    return _sparkdl_model(workload, state).setBatchSize(batch_size).transform(df)


def sparkdl_transform_eager(df: Any, workload: Workload, state: State, batch_size: int) -> Any:
    """:func:`sparkdl_transform` with ``setOptimize("off")``: the module as it is, no frozen graph
    (what the graph adds, measured beside it)."""
    return _sparkdl_model(workload, state).setBatchSize(batch_size).setOptimize("off").transform(df)


def _sparkdl_model(workload: Workload, state: State) -> Any:
    import sparkdl

    return sparkdl.TorchModel.from_state(
        dict(state), model=workload.factory, output_shape=[10], **workload.sparkdl_inputs()
    )


def predict_batch_udf_side(df: Any, workload: Workload, state: State, batch_size: int) -> Any:
    """Spark's ``pyspark.ml.functions.predict_batch_udf``: ``make_predict_fn`` builds the model
    once per Python worker (Spark caches it); the weights travel in its closure."""
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql.types import ArrayType, FloatType

    factory, to_tensor = workload.factory, workload.numpy_tensor

    def make_predict_fn() -> Callable[[np.ndarray], np.ndarray]:
        model = factory()
        model.load_state_dict(state)
        model.eval()

        def predict(inputs: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return model(to_tensor(inputs)).numpy()

        return predict

    udf = predict_batch_udf(
        make_predict_fn,
        return_type=ArrayType(FloatType()),
        batch_size=batch_size,
        input_tensor_shapes=workload.tensor_shapes,
    )
    return df.withColumn("prediction", udf(workload.column))


def predict_batch_udf_small_calls(df: Any, workload: Workload, state: State, batch_size: int) -> Any:
    """2 with calls of :data:`SMALL_CALL_ROWS` rows, whatever ``--batch-size`` says: the peer of
    sparkdl's own choice of rows per call (:mod:`sparkdl.inference.call_rows`), for a user who
    tuned it by hand."""
    return predict_batch_udf_side(df, workload, state, SMALL_CALL_ROWS)


def pandas_udf_side(df: Any, workload: Workload, state: State, batch_size: int) -> Any:
    """A hand-written iterator ``pandas_udf``: the ``state_dict`` in a broadcast, the model built
    once per task, ``batch_size`` rows a call."""
    from pyspark.sql.functions import pandas_udf
    from pyspark.sql.types import ArrayType, FloatType

    weights = df.sparkSession.sparkContext.broadcast(dict(state))
    factory, to_tensor = workload.factory, workload.series_tensor

    @pandas_udf(ArrayType(FloatType()))
    def predict(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        model = factory()
        model.load_state_dict(weights.value)
        model.eval()
        with torch.inference_mode():
            for series in batches:
                outputs = [
                    model(to_tensor(series.iloc[start : start + batch_size])).numpy()
                    for start in range(0, len(series), batch_size)
                ]
                yield pd.Series(list(np.concatenate(outputs)))

    return df.withColumn("prediction", predict(workload.column))


SPARK_SIDES: Dict[str, Callable[..., Any]] = {
    "sparkdl transform": sparkdl_transform,
    "sparkdl transform, optimize off": sparkdl_transform_eager,
    "predict_batch_udf": predict_batch_udf_side,
    f"predict_batch_udf, batch {SMALL_CALL_ROWS}": predict_batch_udf_small_calls,
    "pandas_udf": pandas_udf_side,
}


# ---- Parquet in, Parquet out: the whole job, the output files written -----------------------------


def sparkdl_predict_parquet(
    spark: Any, path: str, out_dir: str, workload: Workload, state: State, batch_size: int
) -> Any:
    """``sparkdl.predict(model, path, out_dir, overwrite=True, batch_size=...)``: the tasks read
    the files' parts, score them and write Parquet from Python (all input columns and
    ``prediction``), committing each part. Returns its PredictResult."""
    import sparkdl

    model = _sparkdl_model(workload, state)
    return sparkdl.predict(model, path, out_dir, overwrite=True, batch_size=batch_size)


def sparkdl_predict_ids(spark: Any, path: str, out_dir: str, workload: Workload, state: State, batch_size: int) -> Any:
    """:func:`sparkdl_predict_parquet` keeping only ``id`` of the input (``keep_columns=["id"]``):
    the feature column is read for the model but not written."""
    import sparkdl

    model = _sparkdl_model(workload, state)
    return sparkdl.predict(model, path, out_dir, overwrite=True, keep_columns=["id"], batch_size=batch_size)


def predict_batch_udf_parquet(
    spark: Any, path: str, out_dir: str, workload: Workload, state: State, batch_size: int
) -> Any:
    """predict_batch_udf's DataFrame written by Spark: ``.write.mode("overwrite").parquet(out_dir)``
    (all input columns and ``prediction``, snappy, as sparkdl.predict writes)."""
    scored = predict_batch_udf_side(spark.read.parquet(path), workload, state, batch_size)
    scored.write.mode("overwrite").parquet(out_dir)
    return None


def predict_batch_udf_ids(
    spark: Any, path: str, out_dir: str, workload: Workload, state: State, batch_size: int
) -> Any:
    """:func:`predict_batch_udf_parquet` of ``select("id", "prediction")``."""
    scored = predict_batch_udf_side(spark.read.parquet(path), workload, state, batch_size)
    scored.select("id", "prediction").write.mode("overwrite").parquet(out_dir)
    return None


PARQUET_SIDES: Dict[str, Callable[..., Any]] = {
    "sparkdl predict → Parquet": sparkdl_predict_parquet,
    "predict_batch_udf → Parquet": predict_batch_udf_parquet,
    "sparkdl predict → Parquet, id": sparkdl_predict_ids,
    "predict_batch_udf → Parquet, id": predict_batch_udf_ids,
}
#: What the Parquet sides keep of the input besides ``prediction``.
_KEPT = {side: "id" if side.endswith(", id") else "all columns" for side in PARQUET_SIDES}
PLAIN_LOOP = "plain loop, 1 core"
#: What each side stores: the DataFrame sides compute every row into Spark's noop sink.
WRITES = {
    **{side: "noop" for side in SPARK_SIDES},
    **{side: f"Parquet ({_KEPT[side]})" for side in PARQUET_SIDES},
    PLAIN_LOOP: "nothing",
}


def plain_loop(path: str, workload: Workload, state: State, batch_size: int, keep: bool = False) -> Any:
    """The ceiling: pyarrow reads the files ``batch_size`` rows at a time, the model (one torch
    thread) scores them in this process. Returns the rows scored, or with ``keep`` the
    predictions in ``id`` order."""
    import pyarrow.parquet as pq

    torch.set_num_threads(1)
    model = workload.factory()
    model.load_state_dict(state)
    model.eval()
    rows, ids, outputs = 0, [], []
    with torch.inference_mode():
        for name in sorted(os.listdir(path)):
            columns = [workload.column, "id"] if keep else [workload.column]
            for batch in pq.ParquetFile(os.path.join(path, name)).iter_batches(batch_size, columns=columns):
                prediction = model(workload.arrow_tensor(batch.column(0))).numpy()
                rows += len(prediction)
                if keep:
                    ids.append(batch.column(1).to_numpy())
                    outputs.append(prediction)
    if not keep:
        return rows
    return _in_id_order(np.concatenate(ids), outputs)


def _in_id_order(ids: np.ndarray, outputs: List[np.ndarray]) -> np.ndarray:
    return np.concatenate(outputs)[np.argsort(ids, kind="stable")]


def collected_predictions(scored: Any) -> np.ndarray:
    """A Spark side's predictions, collected, in ``id`` order (for the correctness check)."""
    rows = scored.select("id", "prediction").collect()
    return _in_id_order(np.array([row["id"] for row in rows]), [np.array([row["prediction"] for row in rows])])


def written_predictions(out_dir: str) -> np.ndarray:
    """A Parquet side's predictions, read back with pyarrow, in ``id`` order (files whose names
    start with ``_`` or ``.``, the job records and markers, are not data)."""
    import pyarrow.parquet as pq

    table = pq.read_table(out_dir, columns=["id", "prediction"])
    ids = table.column("id").to_numpy()
    values = table.column("prediction").combine_chunks()
    return _in_id_order(ids, [values.flatten().to_numpy().reshape(len(values), -1)])
