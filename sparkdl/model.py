"""Spark ML ``TorchModel``: a trained module, its inputs, and prediction on DataFrames.

Saved (:meth:`TorchModel.save`) as a directory that :meth:`TorchModel.load` reads and that Spark
ML loads as a stage of a ``PipelineModel`` or ``CrossValidatorModel`` (:mod:`sparkdl._persistence`);
logged to MLflow as an MLflow model by :func:`sparkdl.tracking.log_model`.
"""

from __future__ import annotations

import io
import json
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import cloudpickle
import numpy as np
import pandas as pd
import torch
from pyspark.ml import Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import MLReadable, MLWritable

from sparkdl import filesystem
from sparkdl._driver.prepare_data import spark_column_infos
from sparkdl._persistence.input_columns import column_infos, describe_columns, example_rows
from sparkdl._persistence.input_columns import output_shape as measured_shape
from sparkdl._persistence.stage import (
    StageReader,
    StageWriter,
    read_stage_metadata,
    readable_path,
    restore_params,
    write_stage_metadata,
)
from sparkdl._spark import is_connect
from sparkdl._task.fit_loop import ModelFactory
from sparkdl._version import __version__
from sparkdl.data.batching import call_model, frame_batch
from sparkdl.data.columns import ColumnInfo
from sparkdl.data.plan import InputPlan
from sparkdl.errors import ConfigError


class _TorchParams(Params):
    featureCols = Param(
        Params._dummy(),
        "featureCols",
        "numeric or array<numeric> columns, concatenated in order",
        TypeConverters.toListString,
    )
    predictionCol = Param(Params._dummy(), "predictionCol", "output column of transform", TypeConverters.toString)

    def getFeatureCols(self) -> List[str]:
        return self.getOrDefault(self.featureCols)

    def getPredictionCol(self) -> str:
        return self.getOrDefault(self.predictionCol)


class TorchModel(Model, _TorchParams, MLReadable["TorchModel"], MLWritable):
    """A trained module plus what it needs to predict on Spark DataFrames.

    A Spark ML ``Model`` that Spark ML saves and loads: in a ``PipelineModel``, as a
    ``CrossValidatorModel``'s best model, or alone (``model.write().overwrite().save(path)``).
    A model trained by ``sparkdl.run`` or ``sparkdl.launch`` becomes one with :meth:`from_state`.

    Attributes:
        module: the trained ``torch.nn.Module`` (on CPU, on the driver).
        history: one dict per epoch: epoch, loss (mean over all ranks' samples), samples (global),
            seconds, samples_per_sec, comm_bytes (model-sync bytes each rank sent).
        run_info: strategy, sizes and timings of the run that produced it.
        input_columns: what each input column held in training, ``{column: {"kind", "shape",
            "type"}}`` (the MLflow signature is made of it); None when unknown (a model saved
            by an older sparkdl, or made by :meth:`from_state` without ``example``).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        history: List[Dict[str, Any]],
        feature_cols: Sequence[str] = (),
        output_shape: Sequence[int] = (),
        prediction_col: str = "prediction",
        model_fn: Optional[ModelFactory] = None,
        run_info: Optional[Dict[str, Any]] = None,
        input_plan: Optional[InputPlan] = None,
        input_columns: Optional[Mapping[str, Mapping[str, Any]]] = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.history = list(history)
        #: How predictions' inputs are built from a DataFrame's columns (the training run's
        #: inputs, without the label).
        self.input_plan = (input_plan or InputPlan.from_feature_cols(list(feature_cols), None)).without_label()
        if not feature_cols:
            feature_cols = self.input_plan.columns
        self.output_shape = list(output_shape)
        self.model_fn = model_fn
        self.run_info = dict(run_info or {})
        self.input_columns = {name: dict(value) for name, value in input_columns.items()} if input_columns else None
        self._set(featureCols=list(feature_cols), predictionCol=prediction_col)

    @property
    def output_size(self) -> int:
        return int(np.prod(self.output_shape)) if self.output_shape else 1

    def _transform(self, dataset: Any) -> Any:
        from pyspark.sql.functions import pandas_udf
        from pyspark.sql.types import ArrayType, DoubleType

        plan = self.input_plan
        columns = plan.columns
        missing = [c for c in columns if c not in dataset.columns]
        if missing:
            raise ConfigError(
                f"column(s) {missing} not in the DataFrame to transform; its columns are: {dataset.columns}"
            )
        infos = spark_column_infos(dataset, plan)
        scalar = self.output_size == 1
        return_type = DoubleType() if scalar else ArrayType(DoubleType())
        buffer = io.BytesIO()
        torch.save(self.module.state_dict(), buffer)
        blob = (cloudpickle.dumps(self.model_fn or _FixedModule(self.module)), buffer.getvalue())
        # Classic sessions ship the weights once per job as a broadcast; a Spark Connect client has
        # no SparkContext, so there they travel inside the UDF, with the plan.
        model_blob = (
            _Inline(blob) if is_connect(dataset.sparkSession) else dataset.sparkSession.sparkContext.broadcast(blob)
        )

        def predict_batches(batches: Iterator[Tuple[Any, ...]]) -> Iterator[pd.Series]:
            module = _load_for_inference(*model_blob.value)
            for batch in batches:
                values = predict_frame(module, plan, infos, dict(zip(columns, batch)), "the DataFrame to transform")
                yield pd.Series(values[:, 0]) if scalar else pd.Series(list(values))

        # Spark picks the UDF's kind from its annotations; a struct column (an image) arrives
        # as a DataFrame, every other column as a Series.
        if len(columns) == 1:

            def predict(batches: Iterator[Union[pd.Series, pd.DataFrame]]) -> Iterator[pd.Series]:
                return predict_batches((column,) for column in batches)

        else:

            def predict(batches: Iterator[Tuple[Union[pd.Series, pd.DataFrame], ...]]) -> Iterator[pd.Series]:  # type: ignore[misc]
                return predict_batches(batches)

        return dataset.withColumn(self.getPredictionCol(), pandas_udf(predict, return_type)(*columns))

    def save(self, path: str) -> None:
        """Writes the weights (``state_dict.pt``), the model factory (``model_fn.pkl``), metadata
        (``metadata.json``) and the line Spark ML reads a stage's class and params from
        (``metadata/part-00000``) into directory ``path`` (a local path or a URL), replacing
        a model saved there before. No Spark is needed.

        ``model.write().save(path)`` writes the same files as Spark ML's writers do: it refuses
        a path that exists unless ``write().overwrite()``, and resolves a path without a scheme
        against Spark's ``fs.defaultFS``, as a ``PipelineModel`` does for its own files.
        """
        self._write_files(path)

    def _write_files(self, path: str) -> None:
        _, fs, root = filesystem.open_url(path, "model path")
        fs.create_dir(root, recursive=True)
        buffer = io.BytesIO()
        torch.save(self.module.state_dict(), buffer)
        metadata = {
            "format": 1,
            "sparkdl_version": __version__,
            "torch_version": torch.__version__,
            "feature_cols": self.getFeatureCols(),
            "prediction_col": self.getPredictionCol(),
            "inputs": self.input_plan.to_json(),
            "input_columns": self.input_columns,
            "output_shape": self.output_shape,
            "history": self.history,
            "run_info": self.run_info,
        }
        files = {
            "state_dict.pt": buffer.getvalue(),
            "model_fn.pkl": cloudpickle.dumps(self.model_fn or _FixedModule(self.module)),
            "metadata.json": json.dumps(metadata, indent=2, default=str).encode(),
        }
        for name, data in files.items():
            filesystem.write_atomically(fs, filesystem.join(root, name), data)
        write_stage_metadata(fs, root, self)  # last: Spark ML finds a stage only once it is whole

    def write(self) -> StageWriter:
        """Spark ML's writer of this model (``overwrite()``, ``save(path)``): the files of :meth:`save`."""
        return StageWriter(self, self._write_files)

    @classmethod
    def read(cls) -> StageReader:
        """Spark ML's reader of this class: ``read().load(path)`` is :meth:`load`."""
        return StageReader(cls.load)

    @classmethod
    def load(cls, path: str, model: Optional[ModelFactory] = None) -> "TorchModel":
        """Reads a model saved by :meth:`save`, ``write().save``, or inside a ``PipelineModel``
        (which calls this with the stage's directory); uid and params come back as saved.

        ``model_fn.pkl`` is a pickle: load only models you trust, or pass ``model`` (the same
        factory used to train) so that only the weights and JSON metadata are read.
        """
        _, fs, root = filesystem.open_url(readable_path(path, "metadata.json"), "model path")
        if not filesystem.is_file(fs, filesystem.join(root, "metadata.json")):
            raise FileNotFoundError(f"no sparkdl model at {path!r} (metadata.json is missing)")

        def read(name: str) -> bytes:
            return filesystem.read_bytes(fs, filesystem.join(root, name))

        metadata = json.loads(read("metadata.json"))
        if model is None:
            try:
                model = cloudpickle.loads(read("model_fn.pkl"))
            except ImportError as exc:
                raise ImportError(
                    f"the model factory saved in {path!r} refers to code that is not importable here ({exc}); "
                    f"make it importable or pass the factory: TorchModel.load(path, model=make_model)"
                ) from exc
        model_fn = model
        module = model_fn()
        module.load_state_dict(torch.load(io.BytesIO(read("state_dict.pt")), weights_only=True))
        loaded = cls(
            module=module,
            history=metadata["history"],
            feature_cols=metadata["feature_cols"],
            input_plan=InputPlan.from_json(metadata["inputs"]) if "inputs" in metadata else None,
            output_shape=metadata["output_shape"],
            prediction_col=metadata["prediction_col"],
            model_fn=model_fn,
            run_info=metadata.get("run_info"),
            input_columns=metadata.get("input_columns"),
        )
        return restore_params(loaded, read_stage_metadata(fs, root))

    @classmethod
    def from_state(
        cls,
        state: Union[Mapping[str, Any], torch.nn.Module],
        model: ModelFactory,
        feature_cols: Optional[Sequence[str]] = None,
        inputs: Optional[Dict[str, Any]] = None,
        example: Any = None,
        output_shape: Optional[Sequence[int]] = None,
        prediction_col: str = "prediction",
        history: Sequence[Dict[str, Any]] = (),
        run_info: Optional[Dict[str, Any]] = None,
    ) -> "TorchModel":
        """A model of weights trained elsewhere — what ``sparkdl.run`` or ``sparkdl.launch``
        returned (rank 0's ``state_dict``), a checkpoint's weights — that transforms, saves,
        joins a ``PipelineModel`` and logs to MLflow (:func:`sparkdl.tracking.log_model`) as a
        fitted one does.

        Args:
            state: the weights: a ``state_dict`` (``ctx.final_module(model).state_dict()`` in a
                ``train_fn``) or a module.
            model: zero-argument callable building the module the weights fit, as for
                ``TorchEstimator`` (saved with the model: ``TorchModel.load`` rebuilds it).
            feature_cols: the input columns, concatenated into one positional input, as for
                ``TorchEstimator`` (default ``["features"]`` when ``inputs`` is not given).
            inputs: named model inputs instead, as for ``TorchEstimator``.
            example: a few rows holding the input columns (a Spark or pandas DataFrame): the
                columns' types, which the MLflow signature is made of, and (without
                ``output_shape``) one row's output shape are taken from it.
            output_shape: the shape of one row's output: ``[10]`` makes ``transform`` add an
                ``array<double>`` of 10, ``[]`` or ``[1]`` a ``double``. Default: ``example``'s.
            prediction_col: the column ``transform`` adds.
            history: per-epoch records, if the run kept any.
            run_info: anything to keep with the model (saved in ``metadata.json``).

        Raises:
            ConfigError: the weights do not fit ``model()``, or neither ``example`` nor
                ``output_shape`` says what one row's output is.
        """
        if not callable(model) or isinstance(model, torch.nn.Module):
            raise ConfigError(
                "model must be a zero-argument callable that builds the module (e.g. a class or a function)"
            )
        if isinstance(state, torch.nn.Module):
            state = state.state_dict()
        if not isinstance(state, Mapping):
            raise ConfigError(
                f"state must be a state_dict (parameter name -> tensor) or a module, got {type(state).__name__}; "
                f"return ctx.final_module(model).state_dict() from the train_fn"
            )
        module = model()
        try:
            module.load_state_dict(state)
        except RuntimeError as exc:
            raise ConfigError(
                f"the state does not fit model() ({exc}); a train_fn should return ctx.final_module(model).state_dict(), "
                f"whose names have no DDP 'module.' prefix"
            ) from exc
        plan = InputPlan.build(["features"] if feature_cols is None and inputs is None else feature_cols, inputs, None)
        input_columns = describe_columns(example, plan) if example is not None else None
        if output_shape is None:
            if example is None:
                raise ConfigError(
                    "give output_shape= (one row's output, e.g. [10] for 10 scores, [] for one number) or "
                    "example= (a few input rows, from which it is measured)"
                )
            infos = column_infos(input_columns)
            output_shape = measured_shape(module, plan, infos, example_rows(example, plan, infos))
        return cls(
            module=module,
            history=list(history),
            input_plan=plan,
            output_shape=output_shape,
            prediction_col=prediction_col,
            model_fn=model,
            run_info=run_info,
            input_columns=input_columns,
        )


def predict_frame(
    module: torch.nn.Module, plan: InputPlan, infos: Mapping[str, ColumnInfo], columns: Mapping[str, Any], source: str
) -> np.ndarray:
    """The module's outputs, ``[rows, outputs]`` float64, for rows given as named pandas columns
    (a struct column as a DataFrame), 1024 rows a call: ``transform``'s UDF and the MLflow
    pyfunc predict with it, so both give the same numbers."""
    rows = len(next(iter(columns.values()))) if columns else 0
    outputs = []
    with torch.inference_mode():
        for start in range(0, rows, 1024):
            named = {name: values.iloc[start : start + 1024] for name, values in columns.items()}
            inputs = frame_batch(plan, named, infos, source)
            tensors = (
                {k: torch.from_numpy(v) for k, v in inputs.items()}
                if isinstance(inputs, dict)
                else torch.from_numpy(inputs)
            )
            out = call_model(module, tensors)
            outputs.append(out.reshape(len(out), -1).double().numpy())
    return np.concatenate(outputs) if outputs else np.zeros((0, 1))


class _Inline:
    """A value with a broadcast's ``.value``, carried in the closure itself."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _FixedModule:
    """A factory returning a copy of one module, for models built without a factory."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self) -> torch.nn.Module:
        import copy

        return copy.deepcopy(self.module)


def _load_for_inference(model_fn_bytes: bytes, state_bytes: bytes) -> torch.nn.Module:
    from pyspark import TaskContext

    from sparkdl._spark import task_threads

    context = TaskContext.get()
    if context is not None:
        torch.set_num_threads(task_threads(context))
    module = cloudpickle.loads(model_fn_bytes)()
    module.load_state_dict(torch.load(io.BytesIO(state_bytes), weights_only=True))
    return module.eval()
