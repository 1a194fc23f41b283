"""``sparkdl.run``: custom training loops on barrier tasks (the low-level entry under ``TorchEstimator``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from sparkdl._driver import launch
from sparkdl._driver.dataframe_copy import remove_after_run
from sparkdl._driver.prepare_data import DataSource, prepare_data
from sparkdl._driver.progress import ProgressCallback, ProgressDisplay
from sparkdl._driver.session_checks import check_session
from sparkdl._driver.settings import RunSettings
from sparkdl._driver.warmup import warm_up
from sparkdl.context import TrainContext
from sparkdl.data import reshard
from sparkdl.data.dataset import Filters
from sparkdl.data.readers.base import DEFAULT_READER
from sparkdl.data.spec import MetricFn, TransformFn
from sparkdl.errors import ConfigError
from sparkdl.resources import Resources
from sparkdl.strategies.base import Strategy


def run(
    train_fn: Callable[[TrainContext], Any],
    *,
    num_workers: int,
    strategy: Optional[Strategy] = None,
    # the data and how it is read
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
    decode_threads: Optional[int] = None,
    validation: Optional[Union[float, DataSource]] = None,
    metrics: Optional[Mapping[str, MetricFn]] = None,
    cache_dir: Optional[str] = None,
    shard_cache: str = "auto",
    # where and how it runs
    spark: Any = None,
    use_gpu: Optional[bool] = None,
    resources: Optional[Resources] = None,
    precision: str = "32",
    timeout_s: float = 600.0,
    progress: Union[bool, ProgressCallback] = True,
    # surviving failures
    checkpoint_dir: Optional[str] = None,
    resume: bool = True,
    keep_checkpoints: int = 3,
    checkpoint_async: bool = True,
    max_failures: int = 0,
    watchdog_timeout_s: Union[float, str, None] = 600.0,
    min_workers: Optional[int] = None,
    on_resize: Optional[str] = None,
    slot_wait_s: float = 30.0,
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
        decode_threads: threads per task that decode images and run ``transform_fn`` ahead of
            the training step; default the task's cores (``spark.task.cpus``).
        validation: a fraction in (0, 1) of the rows held out for validation (by row position,
            fixed for a dataset), or separate data (URL, DataFrame, source). Read by
            ``ctx.validation_batches()`` / ``ctx.validate(model, loss)``.
        metrics: ``name -> fn(output, label)`` batch means that ``ctx.validate`` reports as
            ``val_<name>``; needs ``validation``.
        cache_dir: where DataFrames are materialized (default: ``spark.sparkdl.cacheDir`` conf);
            with ``checkpoint_dir``, the training DataFrame's copy is also kept beside the checkpoints.
        shard_cache: ``"auto"`` (default) keeps each rank's decoded shard in memory after the
            first pass when it fits half the memory a task has (``spark.executor.pyspark.memory``,
            else ``spark.executor.memory``), so later epochs (``ctx.epoch_batches``, ``ctx.shard_dataset()``) read no Parquet; ``"memory"`` keeps it
            whenever it fits that memory at all (refused before launch when it cannot);
            ``"none"`` streams every epoch. Batches are the same either way (docs/data.md).
        spark: the SparkSession; default the active one.
        use_gpu: None uses GPUs when Spark assigns them to tasks; True requires them (docs/gpu.md).
        resources: the training stage's own task resources, e.g. ``sparkdl.Resources(cpus=4,
            gpus=1)``: only the barrier stage runs with a Spark resource profile of them, so ETL
            in the same application keeps ``spark.task.cpus`` (docs/resources.md). None: the
            application's ``spark.task.*`` settings.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``; the loop applies it with
            ``ctx.autocast()`` and ``ctx.backward_and_step(loss, optimizer)``.
        timeout_s: bound on rendezvous and every collective.
        progress: show per-epoch progress on the driver; a callable also receives each record.
        checkpoint_dir: where ``ctx.save_checkpoint`` writes (a path or URL every executor can
            write); with it, a relaunched or re-run job resumes, and a finished one returns its
            stored result without running again. A DataFrame ``data``'s copy is kept there until
            the run completes, so a new driver resumes on the same rows (docs/recovery.md).
        resume: False ignores (and replaces) what ``checkpoint_dir`` holds.
        keep_checkpoints: how many checkpoints to keep.
        checkpoint_async: ``ctx.save_checkpoint`` writes in the background after a copy to host
            memory (the default); False writes before it returns.
        max_failures: relaunch the stage up to this many times after a failure.
        watchdog_timeout_s: fail when a rank makes no progress for this long (None: never);
            ``"auto"``: a bound that follows the run's step times (docs/recovery.md, Hang watchdog).
        min_workers: a launch (the first one too) that finds fewer free slots than
            ``num_workers`` within ``slot_wait_s`` continues on as many as are free, down to this
            many; a relaunch resumes ``checkpoint_dir`` on the new number of workers
            (docs/recovery.md, "Elastic worker counts"); None: never fewer.
        on_resize: what training on fewer workers than ``num_workers`` does to the optimization:
            ``"keep_global_batch"``, ``"scale_lr"`` or ``"none"`` (default: the strategy's). The
            loop applies it: ``ctx.micro_batches()``, ``ctx.gradient_sync``, ``ctx.backward`` and
            ``ctx.apply_resize_lr`` (docs/recovery.md, "Batch size and learning rate").
        slot_wait_s: how long to wait for enough free task slots (executors still registering,
            or, over Spark Connect, the barrier stage's tasks to start) before failing.

    Raises:
        TrainingError: a rank failed; names the rank and carries its traceback.
        InsufficientSlotsError: the cluster has fewer task slots than ``num_workers``.
        ConfigError, DataError: bad arguments or data, before anything launches.
    """
    if not callable(train_fn):
        raise ConfigError(f"train_fn={train_fn!r} is not callable")
    settings = RunSettings.from_arguments(locals(), with_data=data is not None)
    # The session's settings that rule the launch out (dynamic allocation...), in under a second.
    check_session(spark or getattr(data, "sparkSession", None))
    if getattr(data, "sparkSession", None) is not None:  # a DataFrame: workers start while it is materialized
        warm_up(data.sparkSession, num_workers)
    dataset = spec = data_reader = steps = None
    if settings.data is not None:
        dataset, spec, data_reader, steps = prepare_data(
            data, settings.data, num_workers, spark, task_cpus=settings.launch.task_cpus, checkpoint=settings.checkpoint
        )
    display = ProgressDisplay(enabled=bool(progress), callback=progress if callable(progress) else None)
    outcome = launch(
        train_fn,
        settings.launch,
        settings.strategy,
        spark=spark,
        dataset=dataset,
        data_spec=spec,
        reader=data_reader,
        steps_per_epoch=steps,
        display=display,
        checkpoint=settings.checkpoint,
        steps_for=functools.partial(reshard.steps_for, dataset, spec) if dataset is not None else None,
    )
    # The result is stored with the checkpoints: a resume no longer needs the DataFrame's copy.
    remove_after_run(settings.checkpoint)
    return outcome.value
