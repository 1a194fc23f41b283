"""``sparkdl.run``: the low-level entry for custom training loops."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

from sparkdl._launcher import LaunchConfig, launch
from sparkdl._progress import ProgressCallback, ProgressDisplay
from sparkdl.checkpoint import CheckpointConfig
from sparkdl.context import TrainContext
from sparkdl.data.batching import MetricFn, TransformFn
from sparkdl.data.dataset import Filters
from sparkdl.data.prepare import DEFAULT_READER, DataSource, prepare_data
from sparkdl.errors import ConfigError
from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.base import Strategy



def run(
    train_fn: Callable[[TrainContext], Any],
    *,
    num_workers: int,
    strategy: Optional[Strategy] = None,
    data: Optional[DataSource] = None,
    feature_cols: Sequence[str] = (),
    inputs: Optional[Mapping[str, Any]] = None,
    label_col: Any = None,
    batch_size: int = 32,
    shuffle: bool = True,
    seed: int = 0,
    reader: str = DEFAULT_READER,
    filters: Filters = None,
    transform_fn: Optional[TransformFn] = None,
    validation: Optional[Union[float, DataSource]] = None,
    metrics: Optional[Mapping[str, MetricFn]] = None,
    spark: Any = None,
    use_gpu: Optional[bool] = None,
    timeout_s: float = 600.0,
    progress: Union[bool, ProgressCallback] = True,
    cache_dir: Optional[str] = None,
    checkpoint_dir: Optional[str] = None,
    keep_checkpoints: int = 3,
    resume: bool = True,
    max_failures: int = 0,
    watchdog_timeout_s: Optional[float] = 600.0,
    precision: str = "32",
    decode_threads: Optional[int] = None,
) -> Any:
    """Runs ``train_fn(ctx)`` on ``num_workers`` Spark barrier tasks and returns rank 0's result.

    ``ctx`` (:class:`~sparkdl.TrainContext`) gives the rank, world size and device, the task's
    shard of ``data`` as batches (``ctx.epoch_batches()``), and the strategy's helpers
    (``ctx.prepare_model``, ``ctx.prepare_optimizer``, ``ctx.final_module``). ``train_fn`` may
    be a closure or a class defined in a notebook: Spark ships it by value.

    Args:
        train_fn: the training function; rank 0's return value must be picklable.
        num_workers: number of ranks (barrier tasks).
        strategy: how replicas stay consistent; default :class:`~sparkdl.AllReduce`.
        data: a Spark DataFrame (materialized to Parquet once), a Parquet/Petastorm URL, or a
            connector source (``connectors.SparkTable``, ``DeltaTable``, ``ParquetSource``).
        feature_cols: numeric or array columns concatenated, in order, into the features (one
            tensor per batch).
        inputs: named model inputs instead of ``feature_cols``: input name -> a column (as it
            is), a list of columns (concatenated floats), ``sparkdl.Image(...)`` or
            ``sparkdl.Sequence(...)``; batches are then ``(dict of tensors, labels)``, for
            ``model(**inputs)`` (docs/data.md, "Deep-learning inputs").
        label_col: the label column (an array column for multi-label), a
            ``sparkdl.Sequence`` (token tagging), or None for unlabeled data.
        batch_size: rows per batch on each rank.
        shuffle: shuffle row groups and rows (seeded by ``seed``).
        seed: seed of the data shuffle.
        reader: the data reader plug-in: ``"arrow"`` (native pyarrow) or ``"petastorm"``.
        filters: keep only matching rows: pyarrow's DNF ``[("col", ">", 3), ...]`` or a
            ``pyarrow.compute`` expression; row groups ruled out by their statistics are skipped.
        transform_fn: ``(features, labels) -> (features, labels)`` on numpy arrays (with
            ``inputs=``, ``features`` is the dict of named inputs), run on the executors' decode
            threads for every batch (training and validation); must keep the row count.
        validation: a fraction in (0, 1) of the rows held out for validation (by row position,
            fixed for a dataset), or separate data (URL, DataFrame, source). Read by
            ``ctx.validation_batches()`` / ``ctx.validate(model, loss)``.
        metrics: ``name -> fn(output, label)`` batch means that ``ctx.validate`` reports as
            ``val_<name>``; needs ``validation``.
        spark: the SparkSession; default the active one.
        use_gpu: None uses GPUs when Spark assigns them to tasks; True requires them (docs/gpu.md).
        timeout_s: bound on rendezvous and every collective.
        progress: show per-epoch progress on the driver; a callable also receives each record.
        cache_dir: where DataFrames are materialized (default: ``spark.sparkdl.cacheDir`` conf).
        checkpoint_dir: where ``ctx.save_checkpoint`` writes (a path or URL every executor can
            write); with it, a relaunched or re-run job resumes, and a finished one returns its
            stored result without running again.
        keep_checkpoints: how many checkpoints to keep.
        resume: False ignores (and replaces) what ``checkpoint_dir`` holds.
        max_failures: relaunch the stage up to this many times after a failure.
        watchdog_timeout_s: fail when a rank makes no progress for this long (None: never).
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``; the loop applies it with
            ``ctx.autocast()`` and ``ctx.backward_and_step(loss, optimizer)``.
        decode_threads: threads per task that decode images and run ``transform_fn`` ahead of
            the training step; default the task's cores (``spark.task.cpus``).

    Raises:
        TrainingError: a rank failed; names the rank and carries its traceback.
        InsufficientSlotsError: the cluster has fewer task slots than ``num_workers``.
        ConfigError, DataError: bad arguments or data, before anything launches.
    """
    config = LaunchConfig(
        num_workers=num_workers, use_gpu=use_gpu, timeout_s=timeout_s, progress=bool(progress), precision=precision,
        max_failures=max_failures, watchdog_timeout_s=watchdog_timeout_s,
    )
    checkpoint = CheckpointConfig(checkpoint_dir, keep=keep_checkpoints, resume=resume) if checkpoint_dir else None
    strategy = strategy if strategy is not None else AllReduce()
    if not isinstance(strategy, Strategy):
        raise ConfigError(f"strategy={strategy!r} is not a sparkdl strategy (e.g. sparkdl.AllReduce())")
    if not callable(train_fn):
        raise ConfigError(f"train_fn={train_fn!r} is not callable")
    dataset = spec = data_reader = steps = None
    if data is not None:
        dataset, spec, data_reader, steps = prepare_data(
            data, feature_cols=feature_cols, inputs=inputs, label_col=label_col, num_workers=num_workers,
            decode_threads=decode_threads, batch_size=batch_size,
            shuffle=shuffle, seed=seed, reader=reader, filters=filters, transform_fn=transform_fn,
            validation=validation, metrics=metrics, spark=spark, cache_dir=cache_dir,
        )
    elif validation is not None or filters is not None or transform_fn is not None or metrics or inputs is not None:
        raise ConfigError("inputs=, validation=, filters=, transform_fn= and metrics= need data=")
    display = ProgressDisplay(enabled=bool(progress), callback=progress if callable(progress) else None)
    outcome = launch(
        train_fn,
        config,
        strategy,
        spark=spark,
        dataset=dataset,
        data_spec=spec,
        reader=data_reader,
        steps_per_epoch=steps,
        display=display,
        checkpoint=checkpoint,
    )
    return outcome.value
