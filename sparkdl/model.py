"""Spark ML ``TorchModel``: a trained module, its inputs, and prediction on DataFrames.

Saved (:meth:`TorchModel.save`) as a directory that :meth:`TorchModel.load` reads and that Spark
ML loads as a stage of a ``PipelineModel`` or ``CrossValidatorModel`` (:mod:`sparkdl._persistence`);
logged to MLflow as an MLflow model by :func:`sparkdl.tracking.log_model`.
"""

from __future__ import annotations

import io
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import cloudpickle
import numpy as np
import torch
from pyspark.ml import Model
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import MLReadable, MLWritable

from sparkdl import filesystem
from sparkdl._persistence.input_columns import column_infos, describe_columns, example_rows
from sparkdl._persistence.input_columns import output_shapes as measured_shapes
from sparkdl._persistence.stage import (
    StageReader,
    StageWriter,
    read_stage_metadata,
    readable_path,
    restore_params,
    write_stage_metadata,
)
from sparkdl._task.fit_loop import ModelFactory
from sparkdl._version import __version__
from sparkdl.data.batching import call_model, frame_batch
from sparkdl.data.columns import ColumnInfo
from sparkdl.data.plan import InputPlan
from sparkdl.errors import ConfigError
from sparkdl.inference.api import InferenceOptions, inference_options
from sparkdl.inference.model_source import weights_bytes, weights_key
from sparkdl.inference.transform import transform_dataframe
from sparkdl.resources import Resources
from sparkdl.strategies.parameter_server.table_files import resolve_tables, save_tables


class _TorchParams(Params):
    featureCols = Param(
        Params._dummy(),
        "featureCols",
        "numeric or array<numeric> columns, concatenated in order",
        TypeConverters.toListString,
    )
    predictionCol = Param(Params._dummy(), "predictionCol", "output column of transform", TypeConverters.toString)
    batchSize = Param(Params._dummy(), "batchSize", "rows per model call in transform", TypeConverters.toInt)
    output = Param(
        Params._dummy(),
        "output",
        "what the prediction column holds: raw, probabilities, label or top_k",
        TypeConverters.toString,
    )
    topK = Param(Params._dummy(), "topK", "classes kept by output='top_k'", TypeConverters.toInt)
    onError = Param(
        Params._dummy(),
        "onError",
        "a row that cannot be scored: fail the job, or null its prediction (reason in errorCol)",
        TypeConverters.toString,
    )
    errorCol = Param(
        Params._dummy(),
        "errorCol",
        "column of reasons with onError='null' (default <predictionCol>_error)",
        TypeConverters.toString,
    )
    precision = Param(
        Params._dummy(), "precision", "autocast of the forward pass: bf16 or fp16", TypeConverters.toString
    )
    optimize = Param(
        Params._dummy(),
        "optimize",
        "auto: score with a frozen graph of the model where it is the same and faster (CPU); off: the module",
        TypeConverters.toString,
    )
    useGpu = Param(
        Params._dummy(),
        "useGpu",
        "True: score on the GPU Spark assigns each task (required); False: on the CPU; unset: the GPU when assigned",
        TypeConverters.toBoolean,
    )

    def getFeatureCols(self) -> List[str]:
        return self.getOrDefault(self.featureCols)

    def getPredictionCol(self) -> str:
        return self.getOrDefault(self.predictionCol)

    def setPredictionCol(self, value: str) -> "_TorchParams":
        return self._set(predictionCol=value)

    def setBatchSize(self, value: int) -> "_TorchParams":
        """Rows per model call in ``transform`` (default 1024)."""
        return self._set(batchSize=value)

    def setOutput(self, value: str) -> "_TorchParams":
        """``raw`` (default), ``probabilities``, ``label`` or ``top_k`` (docs/inference.md)."""
        return self._set(output=value)

    def setTopK(self, value: int) -> "_TorchParams":
        return self._set(topK=value)

    def setOnError(self, value: str) -> "_TorchParams":
        """``fail`` (default) or ``null``: a row that cannot be scored gets a null prediction
        and its reason in ``errorCol``."""
        return self._set(onError=value)

    def setErrorCol(self, value: str) -> "_TorchParams":
        return self._set(errorCol=value)

    def setPrecision(self, value: str) -> "_TorchParams":
        """``bf16`` or ``fp16``: autocast the forward pass (on a GPU, mostly)."""
        return self._set(precision=value)

    def setOptimize(self, value: str) -> "_TorchParams":
        """``auto`` (default): score with a frozen graph of the model where it computes the same
        outputs faster; ``off``: always the module as it is (docs/inference.md)."""
        return self._set(optimize=value)

    def setUseGpu(self, value: bool) -> "_TorchParams":
        """True requires the GPU Spark assigns each scoring task, False scores on the CPU; unset
        (the default) uses the GPU when Spark assigns one, as training does."""
        return self._set(useGpu=value)

    def inference_options(self) -> InferenceOptions:
        """The scoring options these params say (validated)."""
        given: Dict[str, Any] = {}
        for param, name in (
            (self.batchSize, "batch_size"),
            (self.output, "output"),
            (self.topK, "top_k"),
            (self.onError, "on_error"),
            (self.errorCol, "error_col"),
            (self.precision, "precision"),
            (self.useGpu, "use_gpu"),
            (self.optimize, "optimize"),
        ):
            if self.isDefined(param):
                given[name] = self.getOrDefault(param)
        return inference_options(**given)


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
        output_heads: Optional[Mapping[str, Sequence[int]]] = None,
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
        #: ``{head: shape}`` of a model whose forward returns several tensors (a tuple, list or
        #: dict); None for one tensor of ``output_shape``.
        self.output_heads = {str(k): list(v) for k, v in output_heads.items()} if output_heads else None
        #: The scoring stage's own task resources (:meth:`setResources`).
        self.resources: Optional[Resources] = None
        self._saved: Optional[Tuple[str, str]] = None
        self._setDefault(batchSize=1024, output="raw", topK=5, onError="fail")
        self._set(featureCols=list(feature_cols), predictionCol=prediction_col)

    @property
    def output_size(self) -> int:
        return int(np.prod(self.output_shape)) if self.output_shape else 1

    def _transform(self, dataset: Any) -> Any:
        """``dataset`` with the prediction column(s) (and the error column with ``onError='null'``),
        computed by one ``mapInArrow`` stage (:mod:`sparkdl.inference`): the model built once per
        Python worker, Arrow batches of ``batchSize`` rows, the GPU Spark assigns the task; over a
        plain Parquet scan the tasks read the files themselves. Lazy, as every transform is."""
        return transform_dataframe(self, dataset, self.inference_options(), self.resources)

    def setResources(self, resources: Optional[Resources]) -> "TorchModel":
        """The scoring stage's own task resources, e.g. ``sparkdl.Resources(gpus=1)`` (as for
        training: docs/resources.md); None runs it with the application's defaults."""
        if resources is not None and not isinstance(resources, Resources):
            raise ConfigError(f"resources must be sparkdl.Resources or None, got {type(resources).__name__}")
        self.resources = resources
        return self

    def scoring_factory(self) -> ModelFactory:
        """What builds the module on an executor: the model's factory, else a copy of the module."""
        return self.model_fn or _FixedModule(self.module)

    def saved_location(self) -> Optional[Tuple[str, str]]:
        """``(url, weights key)`` of this model's last save or load (executors may read the
        weights there while they are unchanged)."""
        return self._saved

    def save(self, path: str) -> None:
        """Writes the weights (``state_dict.pt``), the model factory (``model_fn.pkl``), metadata
        (``metadata.json``) and the line Spark ML reads a stage's class and params from
        (``metadata/part-00000``) into directory ``path`` (a local path or a URL), replacing
        a model saved there before. No Spark is needed. The files of ``ShardedEmbedding`` tables
        fitted with ``ParameterServer(tables_dir=...)`` are copied into ``tables/`` (file by
        file, never loaded), and the weights refer to them there (docs/embeddings.md).

        ``model.write().save(path)`` writes the same files as Spark ML's writers do: it refuses
        a path that exists unless ``write().overwrite()``, and resolves a path without a scheme
        against Spark's ``fs.defaultFS``, as a ``PipelineModel`` does for its own files.
        """
        self._write_files(path)

    def _write_files(self, path: str) -> None:
        url, fs, root = filesystem.open_url(path, "model path")
        fs.create_dir(root, recursive=True)
        module_state = self.module.state_dict()
        # Files-backed ShardedEmbedding tables are copied into tables/, and referred to there.
        saved_state = save_tables(module_state, url)
        buffer = io.BytesIO()
        torch.save(saved_state, buffer)
        state = buffer.getvalue()
        metadata = {
            "format": 1,
            "sparkdl_version": __version__,
            "torch_version": torch.__version__,
            "feature_cols": self.getFeatureCols(),
            "prediction_col": self.getPredictionCol(),
            "inputs": self.input_plan.to_json(),
            "input_columns": self.input_columns,
            "output_shape": self.output_shape,
            "output_heads": self.output_heads,
            "history": self.history,
            "run_info": self.run_info,
        }
        files = {
            "state_dict.pt": state,
            "model_fn.pkl": cloudpickle.dumps(self.model_fn or _FixedModule(self.module)),
            "metadata.json": json.dumps(metadata, indent=2, default=str).encode(),
        }
        for name, data in files.items():
            filesystem.write_atomically(fs, filesystem.join(root, name), data)
        write_stage_metadata(fs, root, self)  # last: Spark ML finds a stage only once it is whole
        self._saved = (url, weights_key(state if saved_state is module_state else weights_bytes(self.module)))

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
        url, fs, root = filesystem.open_url(readable_path(path, "metadata.json"), "model path")
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
        module.load_state_dict(resolve_tables(torch.load(io.BytesIO(read("state_dict.pt")), weights_only=True), url))
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
            output_heads=metadata.get("output_heads"),
        )
        # Keyed by the weights as loaded, which is what scoring compares (the file's bytes may
        # differ from a new torch.save of the same tensors).
        loaded._saved = (url, weights_key(weights_bytes(module)))
        return restore_params(loaded, read_stage_metadata(fs, root))

    @classmethod
    def from_state(
        cls,
        state: Union[Mapping[str, Any], torch.nn.Module],
        model: ModelFactory,
        feature_cols: Optional[Sequence[str]] = None,
        inputs: Optional[Dict[str, Any]] = None,
        example: Any = None,
        output_shape: Optional[Union[Sequence[int], Mapping[str, Sequence[int]]]] = None,
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
                ``array<float>`` of 10, ``[]`` or ``[1]`` a ``float``; for a model returning several
                tensors (a tuple, list or dict), ``{head: shape}`` with heads ``"0"``, ``"1"``...
                or the dict's keys: each gets its own column. Default: ``example``'s.
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
            output_shape = measured_shapes(module, plan, infos, example_rows(example, plan, infos))
        heads = None
        if isinstance(output_shape, Mapping):
            heads = {str(name): list(shape) for name, shape in output_shape.items()}
            if list(heads) == [""]:  # one tensor, measured
                output_shape, heads = heads[""], None
            elif not heads:
                raise ConfigError("output_shape={} names no output: give {head: shape} for each of the model's outputs")
            else:
                output_shape = next(iter(heads.values()))
        return cls(
            module=module,
            history=list(history),
            input_plan=plan,
            output_shape=output_shape,
            output_heads=heads,
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


class _FixedModule:
    """A factory returning a copy of one module, for models built without a factory."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self) -> torch.nn.Module:
        import copy

        return copy.deepcopy(self.module)
