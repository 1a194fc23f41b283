"""Spark ML ``TorchEstimator``: fit a PyTorch model across the cluster (the result: :mod:`sparkdl.model`).

Spark ML saves and loads it (``Pipeline``, ``CrossValidator``, ``est.write().save(path)``): its
Params as Spark ML writes them, and its constructor arguments pickled (:mod:`sparkdl._persistence`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import time
from typing import Any, Dict, Optional, Sequence, Union

import torch
from pyspark.ml import Estimator
from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.util import MLReadable, MLWritable

from sparkdl._driver import launch
from sparkdl._driver.dataframe_copy import remove_after_run
from sparkdl._driver.memory_check import check_model_memory, session_conf
from sparkdl._driver.preflight import build_checked_model, check_loss, check_optimizer
from sparkdl._driver.prepare_data import DataSource, prepare_data
from sparkdl._driver.progress import ProgressCallback, ProgressDisplay
from sparkdl._driver.session_checks import check_session
from sparkdl._driver.settings import DataSettings, RunSettings
from sparkdl._driver.table_return import check_table_return
from sparkdl._driver.warmup import warm_up
from sparkdl._persistence.arguments import read_arguments, write_arguments
from sparkdl._persistence.input_columns import recorded
from sparkdl._persistence.stage import StageReader, StageWriter
from sparkdl._task.fit_loop import FitLoop, LossFn, ModelFactory, OptimizerFactory, default_optimizer, startup_phases
from sparkdl._version import __version__
from sparkdl.data import reshard
from sparkdl.data.readers.base import DEFAULT_READER
from sparkdl.data.spec import MetricFn, TransformFn
from sparkdl.errors import ConfigError
from sparkdl.model import TorchModel, _FixedModule, _TorchParams  # noqa: F401 - models saved by 0.1 pickled _FixedModule here
from sparkdl.resources import Resources
from sparkdl.strategies.base import Strategy
from sparkdl.strategies.parameter_server.embedding import check_sharded_embeddings
from sparkdl.tracking import Tracker, describe_callable
from sparkdl.tracking import check_available as check_tracking


class TorchEstimator(Estimator, _TorchParams, MLReadable["TorchEstimator"], MLWritable):
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
            returns its stored model instead of training again (unless ``resume=False``). A
            DataFrame's copy is kept there until the run completes, so a new driver resumes on
            the same rows (docs/recovery.md, "A DataFrame's copy beside the checkpoints").
        checkpoint_every: also checkpoint every this many steps (default: at each epoch's end).
        keep_checkpoints: how many checkpoints to keep.
        checkpoint_async: write checkpoints in the background after a copy to host memory (the
            default; training stalls only for the copy); False writes before training goes on.
        resume: False ignores (and replaces) what ``checkpoint_dir`` holds.
        max_failures: relaunch the stage up to this many times after a failure (a lost
            executor, a killed process, a hang...).
        watchdog_timeout_s: fail when a rank makes no progress for this long (None: never);
            ``"auto"``: a bound that follows the run's step times (docs/recovery.md, Hang watchdog).
        min_workers: a launch (the first one too) that finds fewer free slots than
            ``num_workers`` within ``slot_wait_s`` trains on as many as are free, down to this
            many; a relaunch resumes the checkpoint on that many workers (``batch_size`` stays
            per worker, so the global batch shrinks); None: never fewer.
        on_resize: what training on fewer workers than ``num_workers`` does to the optimization
            (docs/recovery.md, "Batch size and learning rate"): ``"keep_global_batch"`` (the
            default for AllReduce and ShardedDataParallel) takes ⌈num_workers/M⌉ micro-batches per
            step on M workers (gradient accumulation), keeping the global batch and steps per epoch;
            ``"scale_lr"`` multiplies the learning rates by M/num_workers (the linear scaling rule);
            ``"none"`` (the default, and the only choice, for ModelAveraging, DiLoCo,
            ElasticAveraging and ParameterServer) trains M·batch_size rows per step at the same lr.
        slot_wait_s: how long to wait for enough free task slots (executors still registering,
            or, over Spark Connect, the barrier stage's tasks to start) before failing with
            ``InsufficientSlotsError``; raise it on clusters whose executors start slowly.
        progress: per-epoch progress on the driver; a callable also receives every record.
        cache_dir: where DataFrames are materialized (default: ``spark.sparkdl.cacheDir``); with
            ``checkpoint_dir``, the training DataFrame's copy is also kept beside the checkpoints.
        reader: the data reader: ``"arrow"`` (native pyarrow) or ``"petastorm"``.
        filters: keep only matching rows: pyarrow's DNF ``[("col", ">", 3), ...]`` or a
            ``pyarrow.compute`` expression (pushed down to the Parquet row groups).
        transform_fn: ``(features, labels) -> (features, labels)`` on numpy arrays, run on the
            executors for every training and validation batch; must keep the row count.
        validation: a fraction in (0, 1) of the rows held out (by row position), or separate
            validation data (URL, DataFrame, connector source); adds ``val_loss`` and
            ``val_<metric>`` to every epoch of ``history``.
        metrics: ``name -> fn(output, label)`` batch means computed on the validation data, or
            names of built-in metrics (``["accuracy"]``; also ``"mae"``, ``"mse"``: the CLI's
            ``--metric`` vocabulary, :data:`sparkdl._runtime.validation.METRICS`).
        decode_threads: threads per task that decode images and run ``transform_fn`` ahead of
            the training step (default: the task's cores, ``spark.task.cpus``).
        shard_cache: ``"auto"`` (default) keeps each rank's decoded shard in memory after the
            first pass when it fits half the memory a task has (``spark.executor.pyspark.memory``,
            else ``spark.executor.memory``), so later epochs read no Parquet; ``"memory"`` keeps it
            whenever it fits that memory at all (refused before launch when it cannot);
            ``"none"`` streams every epoch. Batches are the same either way (docs/data.md).
        resources: the training stage's own task resources, e.g. ``sparkdl.Resources(cpus=4,
            gpus=1)``: only the barrier stage runs with a Spark resource profile of them, so ETL
            in the same application keeps ``spark.task.cpus`` (docs/resources.md). None: the
            application's ``spark.task.*`` settings.
        mlflow_experiment: log params, per-epoch metrics and the trained model, as an MLflow
            model (pyfunc, with a signature), to this MLflow experiment (``MLFLOW_TRACKING_URI``
            picks the store); see :mod:`sparkdl.tracking`.
        mlflow_registered_model_name: also register the logged model under this name in
            MLflow's model registry (a new version each fit); needs ``mlflow_experiment``.
        tensorboard_dir: write per-epoch scalars there for TensorBoard.

    Saving: ``est.save(path)`` / ``est.write().overwrite().save(path)``, and Spark ML's
    ``Pipeline`` and ``CrossValidator`` writers, keep the Params and every constructor argument
    (pickled with cloudpickle: ``TorchEstimator.load`` unpickles, so load only what you trust). An
    argument that cannot be pickled (a DataFrame as ``validation``) is named in a ``ConfigError``.
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
        checkpoint_async: bool = True,
        resume: bool = True,
        max_failures: int = 0,
        watchdog_timeout_s: Union[float, str, None] = 600.0,
        min_workers: Optional[int] = None,
        on_resize: Optional[str] = None,
        slot_wait_s: float = 30.0,
        progress: "bool | ProgressCallback" = True,
        cache_dir: Optional[str] = None,
        reader: str = DEFAULT_READER,
        filters: Any = None,
        transform_fn: Optional[TransformFn] = None,
        validation: Any = None,
        metrics: "Optional[Dict[str, MetricFn] | Sequence[str]]" = None,
        precision: str = "32",
        mlflow_experiment: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        inputs: Optional[Dict[str, Any]] = None,
        decode_threads: Optional[int] = None,
        shard_cache: str = "auto",
        resources: Optional[Resources] = None,
        mlflow_registered_model_name: Optional[str] = None,
    ) -> None:
        #: Every constructor argument, as given: what a saved estimator is rebuilt from.
        self._arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        if not callable(model) or isinstance(model, torch.nn.Module):
            raise ConfigError(
                "model must be a zero-argument callable that builds the module (e.g. a class or a function), "
                "so every task builds its own copy"
            )
        if feature_cols is None and inputs is None:
            feature_cols = ("features",)
        if not isinstance(epochs, int) or epochs < 1:
            raise ConfigError(f"epochs={epochs!r} must be a positive integer")
        #: The validated launch, strategy, checkpoint and data configs (before Param overrides).
        self.settings = RunSettings.from_arguments(locals(), with_data=True)
        self.model_fn = model
        self.optimizer_fn = optimizer or default_optimizer
        self.loss_fn = loss or torch.nn.functional.cross_entropy
        self.progress = progress
        check_tracking(mlflow_experiment, tensorboard_dir)  # fails now when mlflow/tensorboard is missing
        if mlflow_registered_model_name is not None and (
            mlflow_experiment is None
            or not isinstance(mlflow_registered_model_name, str)
            or not mlflow_registered_model_name
        ):
            raise ConfigError(
                f"mlflow_registered_model_name={mlflow_registered_model_name!r} needs mlflow_experiment= and must be "
                f"a non-empty model name"
            )
        self.mlflow_experiment = mlflow_experiment
        self.mlflow_registered_model_name = mlflow_registered_model_name
        self.tensorboard_dir = tensorboard_dir
        plan = self.settings.data.plan
        features = list(feature_cols) if inputs is None else [c for c in plan.columns if c != plan.label_column]
        self._set(featureCols=features, labelCol=plan.label_column or "", predictionCol=prediction_col)
        self._set(numWorkers=num_workers, batchSize=batch_size, epochs=epochs, seed=seed, shuffle=shuffle)

    def _fit(self, dataset: DataSource) -> "TorchModel":
        started = time.time()
        num_workers = self.getOrDefault(self.numWorkers)
        config = dataclasses.replace(self.settings.launch, num_workers=num_workers, planned_workers=num_workers)
        data_settings = self._data_settings()
        spark = getattr(dataset, "sparkSession", None)  # None for URLs and connector sources
        check_session(spark)  # dynamic allocation, Spark's encryption: refused before executors or data are touched
        if spark is not None:  # a DataFrame: the executors' Python workers start while it is materialized
            warm_up(spark, num_workers)
        # The model, built once on the driver: its forward must take the inputs, checked before
        # anything launches; it also receives the trained weights at the end.
        module = build_checked_model(self.model_fn, data_settings.plan)
        info, spec, data_reader, steps = prepare_data(
            dataset, data_settings, num_workers, spark, task_cpus=config.task_cpus, checkpoint=self.settings.checkpoint
        )
        # What would fail every rank (and every relaunch) the same way fails here, named.
        check_optimizer(self.optimizer_fn, module)
        check_loss(module, self.loss_fn, info, spec, data_reader)
        check_model = getattr(self.settings.strategy, "check_model", None)  # ShardedDataParallel.shard_modules, ...
        if check_model is not None:
            check_model(module)
        # ShardedEmbedding tables: trained by ParameterServer only.
        check_sharded_embeddings(module, self.settings.strategy.name)
        # A model whose weights and gradients alone exceed a task's Python memory cannot train.
        check_model_memory(module, self.settings.strategy.name, num_workers, session_conf(spark), config.task_cpus)
        check_table_return(module, self.settings.strategy, session_conf(spark))  # or ParameterServer(tables_dir=)
        epochs = self.getOrDefault(self.epochs)
        checkpoint, strategy = self.settings.checkpoint, self.settings.strategy
        loop = FitLoop(
            model=self.model_fn,
            optimizer=self.optimizer_fn,
            loss=self.loss_fn,
            epochs=epochs,
            seed=self.getOrDefault(self.seed),
            checkpoint_every=checkpoint.every_steps if checkpoint else None,
        )
        # MLflow / TensorBoard (sparkdl/tracking.py): a no-op unless mlflow_experiment or tensorboard_dir is set.
        tracker = Tracker(self.mlflow_experiment, self.tensorboard_dir, self.mlflow_registered_model_name)
        if tracker.enabled:
            tracker.start(self._tracking_params(info, num_workers, epochs))
        display = ProgressDisplay(
            enabled=bool(self.progress),
            callback=tracker.callback(self.progress if callable(self.progress) else None),
            total_epochs=epochs,
        )
        launched = time.time()
        try:
            outcome = launch(
                loop,
                config,
                strategy,
                spark=spark,
                dataset=info,
                data_spec=spec,
                reader=data_reader,
                steps_per_epoch=steps,
                display=display,
                checkpoint=checkpoint,
                steps_for=functools.partial(reshard.steps_for, info, spec),
            )
        except BaseException as exc:
            tracker.fail(exc)
            raise
        # The result is stored with the checkpoints: a resume no longer needs the DataFrame's copy.
        remove_after_run(checkpoint)
        result = outcome.value
        module.load_state_dict(torch.load(io.BytesIO(result["state_dict"]), weights_only=True))
        timing = result["timing"]
        run_info = {
            "strategy": strategy.describe(),
            "num_workers": num_workers,
            "batch_size": spec.batch_size,
            "epochs": epochs,
            "steps_per_epoch": steps,
            "dataset": {
                "url": info.url,
                "rows": info.num_rows,
                "row_groups": info.num_row_groups,
                "reader": data_settings.reader,
                # The driver's decision, and rank 0's cache after the fit (sparkdl.data.shard_cache).
                "shard_cache": {
                    **(spec.shard_cache.to_json() if spec.shard_cache else {}),
                    "rank0": result.get("shard_cache"),
                },
            },
            "startup_seconds": (timing["first_batch"] - launched)
            if timing.get("first_batch") and not outcome.from_finished_checkpoint
            else None,
            "prepare_seconds": launched - started,
            # prepare_seconds + startup_seconds, phase by phase (sparkdl._task.fit_loop.startup_phases)
            "startup": None
            if outcome.from_finished_checkpoint
            else startup_phases(launched - started, launched, timing),
            "train_seconds": timing["end"] - timing["start"],
            "steps": result.get("steps"),
            "checkpoints": result.get("checkpoints"),
            "device": result.get("device"),
            "precision": result.get("precision"),
            "attempts": outcome.attempts,
            "workers": outcome.workers,  # per attempt: fewer than num_workers after a shrinking relaunch
            "resumed": result.get("resumed"),  # {"from_workers", "on_workers"} after an elastic resume
            # on_resize, micro-batches per step and the global batch of the last attempt (sparkdl._runtime.resize)
            "resize": result.get("resize"),
            "from_finished_checkpoint": outcome.from_finished_checkpoint,
            # resources=: the task CPUs/GPUs asked for and the profile id Spark ran the stage with
            "resources": outcome.resources or None,
        }
        model = TorchModel(
            module=module,
            history=result["history"],
            feature_cols=self.getFeatureCols(),
            input_plan=info.plan,
            input_columns=recorded(info.infos, info.plan),
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
            "strategy": self.settings.strategy.describe(),
            "num_workers": num_workers,
            "batch_size": self.getOrDefault(self.batchSize),
            "epochs": epochs,
            "seed": self.getOrDefault(self.seed),
            "feature_cols": self.getFeatureCols(),
            "inputs": None if info.plan.positional else {k: spec.to_json() for k, spec in info.plan.inputs},
            "label_col": self.getOrDefault(self.labelCol),
            "dataset": {"url": info.url, "rows": info.num_rows},
            "checkpoint_dir": self.settings.checkpoint.url if self.settings.checkpoint else None,
            "sparkdl_version": __version__,
        }

    def _data_settings(self) -> DataSettings:
        """The data settings with the current Params (``copy({est.featureCols: ...})`` applies)."""
        data = self.settings.data
        label_col = self.getOrDefault(self.labelCol) or None
        # A label spec (a Sequence) is kept while the labelCol Param still names its column.
        label = data.plan.label
        if label is None or label.source_columns()[0] != label_col:
            label = label_col
        positional = data.plan.positional
        return dataclasses.replace(
            data,
            feature_cols=self.getFeatureCols() if positional else None,
            inputs=None if positional else dict(data.plan.inputs),
            label_col=label,
            batch_size=self.getOrDefault(self.batchSize),
            shuffle=self.getOrDefault(self.shuffle),
            seed=self.getOrDefault(self.seed),
        )

    def write(self) -> StageWriter:
        """Spark ML's writer of this estimator (``overwrite()``, ``save(path)``); ``save(path)``
        is ``write().save(path)``. Writes ``estimator.pkl`` (the constructor arguments),
        ``estimator.json`` (the same, readable) and Spark ML's ``metadata/`` line; no Spark job runs."""
        return StageWriter(self, lambda url: write_arguments(url, self, self._arguments))

    @classmethod
    def read(cls) -> StageReader:
        """Spark ML's reader of this class: ``read().load(path)`` is :meth:`load`."""
        return StageReader(cls.load)

    @classmethod
    def load(cls, path: str) -> "TorchEstimator":
        """Reads an estimator saved by ``save`` / ``write().save`` or inside a saved ``Pipeline``
        or ``CrossValidator``: the same constructor arguments, uid and Params. Unpickles the
        arguments: load only estimators you trust."""
        return read_arguments(cls, path)
