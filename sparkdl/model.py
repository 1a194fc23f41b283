"""Spark ML ``TorchModel``: a trained module, its inputs, and prediction on DataFrames."""

from __future__ import annotations

import io
import json
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import cloudpickle
import numpy as np
import pandas as pd
import torch
from pyspark.ml import Model
from pyspark.ml.param import Param, Params, TypeConverters

from sparkdl import filesystem
from sparkdl._driver.prepare_data import spark_column_infos
from sparkdl._spark import is_connect
from sparkdl._task.fit_loop import ModelFactory
from sparkdl._version import __version__
from sparkdl.data.batching import call_model, frame_batch
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


class TorchModel(Model, _TorchParams):
    """A trained module plus what it needs to predict on Spark DataFrames.

    Attributes:
        module: the trained ``torch.nn.Module`` (on CPU, on the driver).
        history: one dict per epoch: epoch, loss (mean over all ranks' samples), samples (global),
            seconds, samples_per_sec, comm_bytes (model-sync bytes each rank sent).
        run_info: strategy, sizes and timings of the run that produced it.
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
                rows = len(batch[0])
                outputs = []
                with torch.inference_mode():
                    for start in range(0, rows, 1024):
                        named = {name: values.iloc[start : start + 1024] for name, values in zip(columns, batch)}
                        inputs = frame_batch(plan, named, infos, "the DataFrame to transform")
                        tensors = (
                            {k: torch.from_numpy(v) for k, v in inputs.items()}
                            if isinstance(inputs, dict)
                            else torch.from_numpy(inputs)
                        )
                        out = call_model(module, tensors)
                        outputs.append(out.reshape(len(out), -1).double().numpy())
                values = np.concatenate(outputs) if outputs else np.zeros((0, 1))
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
        """Writes the weights (``state_dict.pt``), the model factory (``model_fn.pkl``) and
        metadata (``metadata.json``) into directory ``path`` (a local path or a URL)."""
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

    @classmethod
    def load(cls, path: str, model: Optional[ModelFactory] = None) -> "TorchModel":
        """Reads a model saved by :meth:`save`.

        ``model_fn.pkl`` is a pickle: load only models you trust, or pass ``model`` (the same
        factory used to train) so that only the weights and JSON metadata are read.
        """
        _, fs, root = filesystem.open_url(path, "model path")
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
        return cls(
            module=module,
            history=metadata["history"],
            feature_cols=metadata["feature_cols"],
            input_plan=InputPlan.from_json(metadata["inputs"]) if "inputs" in metadata else None,
            output_shape=metadata["output_shape"],
            prediction_col=metadata["prediction_col"],
            model_fn=model_fn,
            run_info=metadata.get("run_info"),
        )


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
