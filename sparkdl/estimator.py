"""Spark ML ``TorchEstimator`` / ``TorchModel``: fit a PyTorch model across the cluster."""

from __future__ import annotations

import io
import json
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import cloudpickle
import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import torch
from pyspark.ml import Estimator, Model
from pyspark.ml.param import Param, Params, TypeConverters

from sparkdl import __version__
from sparkdl._launcher import LaunchConfig, launch
from sparkdl._progress import ProgressCallback, ProgressDisplay
from sparkdl._session import is_connect
from sparkdl.checkpoint import CheckpointConfig
from sparkdl._training import FitLoop, LossFn, ModelFactory, OptimizerFactory, default_optimizer
from sparkdl.data.batching import DataSpec, MetricFn, TransformFn, call_model, frame_batch
from sparkdl.data.dataset import normalize_url
from sparkdl.data.inputs import InputPlan, Sequence as SequenceInput
from sparkdl.data.prepare import DEFAULT_READER, DataSource, prepare_data, spark_column_infos
from sparkdl.data.readers.base import reader_from_name
from sparkdl.errors import ConfigError
from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.base import Strategy
from sparkdl.tracking import Tracker, check_available as check_tracking, describe_callable


class _TorchParams(Params):
    featureCols = Param(Params._dummy(), "featureCols", "numeric or array<numeric> columns, concatenated in order", TypeConverters.toListString)
    predictionCol = Param(Params._dummy(), "predictionCol", "output column of transform", TypeConverters.toString)

    def getFeatureCols(self) -> List[str]:
        return self.getOrDefault(self.featureCols)

    def getPredictionCol(self) -> str:
        return self.getOrDefault(self.predictionCol)


class TorchEstimator(Estimator, _TorchParams):
    """Trains a PyTorch model on ``num_workers`` Spark barrier tasks.

    Args:
        model: zero-argument callable returning the ``torch.nn.Module`` to train.
        optimizer: ``params -> torch.optim.Optimizer``; default Adam(lr=1e-3).
        loss: ``(output, label) -> scalar tensor``; default cross entropy (classification).
        feature_cols: numeric and/or array<numeric> columns, concatenated in order into one
            positional model input (default ``["features"]`` when ``inputs`` is not given).
        inputs: named model inputs instead: input name -> a column name (the column as it is:
            an integer id stays int64), a list of columns (concatenated into one float
            matrix), ``sparkdl.Image(...)`` (encoded images) or ``sparkdl.Sequence(...)``
            (variable-length token ids); the model is called as ``model(**inputs)``. See
            docs/data.md, "Deep-learning inputs".
        label_col: the label column (integer labels become int64, others float32; an array
            column gives a matrix, e.g. multi-label), or ``sparkdl.Sequence(...)`` for
            variable-length labels (token tagging; pad with -100 for cross_entropy to ignore).
        strategy: :class:`~sparkdl.AllReduce` (default) or another strategy object.
        num_workers: number of ranks; the cluster needs that many free task slots.
        batch_size: rows per batch on each rank (global batch = num_workers * batch_size).
        epochs: passes over the data; each is the same number of steps on every rank.
        seed: seeds model initialization and data shuffling.
        shuffle: shuffle row groups and rows each pass.
        prediction_col: column ``TorchModel.transform`` adds.
        use_gpu: None uses GPUs when Spark assigns them; True requires them; False never
            (docs/gpu.md).
        precision: ``"32"`` (default), ``"bf16-mixed"`` (autocast to bfloat16; CPUs and
            Ampere+ GPUs) or ``"16-mixed"`` (float16 with loss scaling; GPUs only).
        timeout_s: bound on rendezvous and each collective.
        checkpoint_dir: where checkpoints go (a path or URL every executor can write: HDFS, an
            object store or a shared mount on a real cluster). With it, a failed attempt resumes
            from the newest checkpoint, re-running the same job resumes, and a finished run
            returns its stored model instead of training again (unless ``resume=False``).
        checkpoint_every: also checkpoint every this many steps (default: at each epoch's end).
        keep_checkpoints: how many checkpoints to keep.
        resume: False ignores (and replaces) what ``checkpoint_dir`` holds.
        max_failures: relaunch the stage up to this many times after a failure (a lost
            executor, a killed process, a hang...).
        watchdog_timeout_s: fail when a rank makes no progress for this long (None: never).
        progress: per-epoch progress on the driver; a callable also receives every record.
        cache_dir: where DataFrames are materialized (default: ``spark.sparkdl.cacheDir``).
        reader: the data reader: ``"arrow"`` (native pyarrow) or ``"petastorm"``.
        filters: keep only matching rows: pyarrow's DNF ``[("col", ">", 3), ...]`` or a
            ``pyarrow.compute`` expression (pushed down to the Parquet row groups).
        transform_fn: ``(features, labels) -> (features, labels)`` on numpy arrays, run on the
            executors for every training and validation batch; must keep the row count.
        validation: a fraction in (0, 1) of the rows held out (by row position), or separate
            validation data (URL, DataFrame, connector source); adds ``val_loss`` and
            ``val_<metric>`` to every epoch of ``history``.
        metrics: ``name -> fn(output, label)`` batch means computed on the validation data.
        decode_threads: threads per task that decode images and run ``transform_fn`` ahead of
            the training step (default: the task's cores, ``spark.task.cpus``).
        mlflow_experiment: log params, per-epoch metrics and the model to this MLflow
            experiment (``MLFLOW_TRACKING_URI`` picks the store); see :mod:`sparkdl.tracking`.
        tensorboard_dir: write per-epoch scalars there for TensorBoard.
    """

    numWorkers = Param(Params._dummy(), "numWorkers", "number of barrier tasks (ranks)", TypeConverters.toInt)
    batchSize = Param(Params._dummy(), "batchSize", "rows per batch on each rank", TypeConverters.toInt)
    epochs = Param(Params._dummy(), "epochs", "passes over the data", TypeConverters.toInt)
    labelCol = Param(Params._dummy(), "labelCol", "label column", TypeConverters.toString)
    seed = Param(Params._dummy(), "seed", "seed of initialization and shuffling", TypeConverters.toInt)
    shuffle = Param(Params._dummy(), "shuffle", "shuffle row groups and rows", TypeConverters.toBoolean)

    def __init__(
        self,
        model: ModelFactory,
        optimizer: Optional[OptimizerFactory] = None,
        loss: Optional[LossFn] = None,
        feature_cols: Optional[Sequence[str]] = None,
        label_col: Any = "label",
        strategy: Optional[Strategy] = None,
        num_workers: int = 2,
        batch_size: int = 32,
        epochs: int = 10,
        seed: int = 0,
        shuffle: bool = True,
        prediction_col: str = "prediction",
        use_gpu: Optional[bool] = None,
        timeout_s: float = 600.0,
        checkpoint_dir: Optional[str] = None,
        checkpoint_every: Optional[int] = None,
        keep_checkpoints: int = 3,
        resume: bool = True,
        max_failures: int = 0,
        watchdog_timeout_s: Optional[float] = 600.0,
        progress: "bool | ProgressCallback" = True,
        cache_dir: Optional[str] = None,
        reader: str = DEFAULT_READER,
        filters: Any = None,
        transform_fn: Optional[TransformFn] = None,
        validation: Any = None,
        metrics: Optional[Dict[str, MetricFn]] = None,
        precision: str = "32",
        mlflow_experiment: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        inputs: Optional[Dict[str, Any]] = None,
        decode_threads: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not callable(model) or isinstance(model, torch.nn.Module):
            raise ConfigError(
                "model must be a zero-argument callable that builds the module (e.g. a class or a function), "
                "so every task builds its own copy"
            )
        if feature_cols is None and inputs is None:
            feature_cols = ("features",)
        # Validates feature_cols / inputs / label_col now, not at fit.
        self.input_plan = InputPlan.build(feature_cols, inputs, label_col)
        self.label_spec = label_col
        if not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs={epochs!r} must be a positive integer")
        self.model_fn = model
        self.optimizer_fn = optimizer or default_optimizer
        self.loss_fn = loss or torch.nn.functional.cross_entropy
        self.strategy = strategy if strategy is not None else AllReduce()
        if not isinstance(self.strategy, Strategy):
            raise ConfigError(f"strategy={strategy!r} is not a sparkdl strategy (e.g. sparkdl.AllReduce())")
        self.launch_config = LaunchConfig(
            num_workers=num_workers, use_gpu=use_gpu, timeout_s=timeout_s, progress=bool(progress), precision=precision,
            max_failures=max_failures, watchdog_timeout_s=watchdog_timeout_s,
        )
        self.checkpoint = CheckpointConfig(checkpoint_dir, every_steps=checkpoint_every, keep=keep_checkpoints, resume=resume) if checkpoint_dir else None
        if checkpoint_every is not None and checkpoint_dir is None:
            raise ConfigError("checkpoint_every is set but checkpoint_dir is not: name a directory for the checkpoints")
        DataSpec(batch_size=batch_size, decode_threads=decode_threads)  # validates both now, not at fit
        self.decode_threads = decode_threads
        self.progress = progress
        self.cache_dir = cache_dir
        self.reader = reader_from_name(reader)  # fails now on an unknown name, not at fit
        self.reader_name = reader
        self.filters = filters
        self.transform_fn = transform_fn
        self.validation = validation
        self.metrics = metrics
        check_tracking(mlflow_experiment, tensorboard_dir)  # fails now when mlflow/tensorboard is missing
        self.mlflow_experiment = mlflow_experiment
        self.tensorboard_dir = tensorboard_dir
        self._set(
            featureCols=list(feature_cols) if inputs is None else [c for c in self.input_plan.columns if c != self.input_plan.label_column],
            labelCol=self.input_plan.label_column or "",
            predictionCol=prediction_col,
            numWorkers=num_workers,
            batchSize=batch_size,
            epochs=epochs,
            seed=seed,
            shuffle=shuffle,
        )

    def _fit(self, dataset: DataSource) -> "TorchModel":
        started = time.time()
        num_workers = self.getOrDefault(self.numWorkers)
        config = LaunchConfig(**{**self.launch_config.__dict__, "num_workers": num_workers})
        plan = self._plan()
        spark = getattr(dataset, "sparkSession", None)  # None for URLs and connector sources
        # The model, built once on the driver: its forward must take the inputs, checked before
        # anything launches; it also receives the trained weights at the end.
        module = _build_checked(self.model_fn, plan)
        info, spec, data_reader, steps = prepare_data(
            dataset, feature_cols=None if not plan.positional else self.getFeatureCols(),
            inputs=None if plan.positional else dict(plan.inputs), label_col=plan.label if isinstance(plan.label, SequenceInput) else plan.label_column,
            num_workers=num_workers, decode_threads=self.decode_threads,
            batch_size=self.getOrDefault(self.batchSize), shuffle=self.getOrDefault(self.shuffle), seed=self.getOrDefault(self.seed),
            reader=self.reader_name, filters=self.filters, transform_fn=self.transform_fn, validation=self.validation,
            metrics=self.metrics, spark=spark, cache_dir=self.cache_dir,
        )
        epochs = self.getOrDefault(self.epochs)
        loop = FitLoop(
            model=self.model_fn, optimizer=self.optimizer_fn, loss=self.loss_fn, epochs=epochs, seed=self.getOrDefault(self.seed),
            checkpoint_every=self.checkpoint.every_steps if self.checkpoint else None,
        )
        # MLflow / TensorBoard (sparkdl/tracking.py): a no-op unless mlflow_experiment or tensorboard_dir is set.
        tracker = Tracker(self.mlflow_experiment, self.tensorboard_dir)
        if tracker.enabled:
            tracker.start(self._tracking_params(info, num_workers, epochs))
        display = ProgressDisplay(
            enabled=bool(self.progress), callback=tracker.callback(self.progress if callable(self.progress) else None), total_epochs=epochs
        )
        launched = time.time()
        try:
            outcome = launch(
                loop, config, self.strategy, spark=spark, dataset=info, data_spec=spec, reader=data_reader,
                steps_per_epoch=steps, display=display, checkpoint=self.checkpoint,
            )
        except BaseException as exc:
            tracker.fail(exc)
            raise
        result = outcome.value
        module.load_state_dict(torch.load(io.BytesIO(result["state_dict"]), weights_only=True))
        timing = result["timing"]
        run_info = {
            "strategy": self.strategy.describe(),
            "num_workers": num_workers,
            "batch_size": spec.batch_size,
            "epochs": epochs,
            "steps_per_epoch": steps,
            "dataset": {"url": info.url, "rows": info.num_rows, "row_groups": info.num_row_groups, "reader": self.reader_name},
            "startup_seconds": (timing["first_batch"] - launched) if timing.get("first_batch") and not outcome.from_finished_checkpoint else None,
            "prepare_seconds": launched - started,
            "train_seconds": timing["end"] - timing["start"],
            "steps": result.get("steps"),
            "checkpoints": result.get("checkpoints"),
            "device": result.get("device"),
            "precision": result.get("precision"),
            "attempts": outcome.attempts,
            "from_finished_checkpoint": outcome.from_finished_checkpoint,
        }
        model = TorchModel(
            module=module,
            history=result["history"],
            feature_cols=self.getFeatureCols(),
            input_plan=info.plan,
            output_shape=result["output_shape"],
            prediction_col=self.getPredictionCol(),
            model_fn=self.model_fn,
            run_info=run_info,
        )
        if tracker.enabled:
            model.run_info["tracking"] = tracker.finish(model)
        return model

    def _tracking_params(self, info: Any, num_workers: int, epochs: int) -> Dict[str, Any]:
        """What the tracking run records as parameters."""
        return {
            "model": describe_callable(self.model_fn),
            "optimizer": describe_callable(self.optimizer_fn),
            "loss": describe_callable(self.loss_fn),
            "strategy": self.strategy.describe(),
            "num_workers": num_workers,
            "batch_size": self.getOrDefault(self.batchSize),
            "epochs": epochs,
            "seed": self.getOrDefault(self.seed),
            "feature_cols": self.getFeatureCols(),
            "inputs": None if self.input_plan.positional else {k: spec.to_json() for k, spec in self.input_plan.inputs},
            "label_col": self.getOrDefault(self.labelCol),
            "dataset": {"url": info.url, "rows": info.num_rows},
            "checkpoint_dir": self.checkpoint.url if self.checkpoint else None,
            "sparkdl_version": __version__,
        }


    def _plan(self) -> InputPlan:
        """The input plan with the current Params (``copy({est.featureCols: ...})`` applies)."""
        label_col = self.getOrDefault(self.labelCol) or None
        if self.input_plan.positional:
            return InputPlan.from_feature_cols(self.getFeatureCols(), label_col)
        label = self.input_plan.label
        if label is None or label.source_columns()[0] != label_col:
            label = label_col
        return InputPlan.from_inputs(dict(self.input_plan.inputs), label)


def _build_checked(model_fn: ModelFactory, plan: InputPlan) -> torch.nn.Module:
    """``model_fn()``, checked: a Module whose forward accepts the plan's named inputs."""
    import inspect

    module = model_fn()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model() must return a torch.nn.Module, got {type(module).__name__}")
    if plan.positional:
        return module
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward inspect cannot read (C++, some wrappers): trust it
        return module
    kinds = {p.kind for p in parameters.values()}
    names = plan.model_input_names()
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        accepted = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [n for n in names if n not in accepted]
        if unknown:
            raise ConfigError(
                f"{type(module).__name__}.forward does not accept the input(s) {', '.join(map(repr, unknown))} of inputs= "
                f"(its parameters: {', '.join(accepted) or 'none'}); rename the inputs or the parameters of forward"
            )
    missing = [
        n for n, p in parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in names
    ]
    if missing:
        raise ConfigError(
            f"{type(module).__name__}.forward needs {', '.join(map(repr, missing))}, which inputs= does not give "
            f"(inputs: {', '.join(names)}); add them to inputs= or give them defaults"
        )
    return module


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
            raise ConfigError(f"column(s) {missing} not in the DataFrame to transform; its columns are: {dataset.columns}")
        infos = spark_column_infos(dataset, plan)
        scalar = self.output_size == 1
        return_type = DoubleType() if scalar else ArrayType(DoubleType())
        buffer = io.BytesIO()
        torch.save(self.module.state_dict(), buffer)
        blob = (cloudpickle.dumps(self.model_fn or _FixedModule(self.module)), buffer.getvalue())
        # Classic sessions ship the weights once per job as a broadcast; a Spark Connect client has
        # no SparkContext, so there they travel inside the UDF, with the plan.
        model_blob = _Inline(blob) if is_connect(dataset.sparkSession) else dataset.sparkSession.sparkContext.broadcast(blob)
        def predict_batches(batches: Iterator[Tuple[Any, ...]]) -> Iterator[pd.Series]:
            module = _load_for_inference(*model_blob.value)
            for batch in batches:
                rows = len(batch[0])
                outputs = []
                with torch.inference_mode():
                    for start in range(0, rows, 1024):
                        named = {name: values.iloc[start:start + 1024] for name, values in zip(columns, batch)}
                        inputs = frame_batch(plan, named, infos, "the DataFrame to transform")
                        tensors = {k: torch.from_numpy(v) for k, v in inputs.items()} if isinstance(inputs, dict) else torch.from_numpy(inputs)
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
        fs, root = pafs.FileSystem.from_uri(normalize_url(path))
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
            with fs.open_output_stream(f"{root}/{name}") as out:
                out.write(data)

    @classmethod
    def load(cls, path: str, model: Optional[ModelFactory] = None) -> "TorchModel":
        """Reads a model saved by :meth:`save`.

        ``model_fn.pkl`` is a pickle: load only models you trust, or pass ``model`` (the same
        factory used to train) so that only the weights and JSON metadata are read.
        """
        fs, root = pafs.FileSystem.from_uri(normalize_url(path))
        if fs.get_file_info(f"{root}/metadata.json").type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no sparkdl model at {path!r} (metadata.json is missing)")

        def read(name: str) -> bytes:
            with fs.open_input_stream(f"{root}/{name}") as stream:
                return stream.read()

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

    context = TaskContext.get()
    if context is not None:
        torch.set_num_threads(max(1, context.cpus()))
    module = cloudpickle.loads(model_fn_bytes)()
    module.load_state_dict(torch.load(io.BytesIO(state_bytes), weights_only=True))
    return module.eval()
