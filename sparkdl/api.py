"""``sparkdl.run``: the low-level entry for custom training loops."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from sparkdl._launcher import LaunchConfig, launch
from sparkdl._progress import ProgressCallback, ProgressDisplay
from sparkdl.checkpoint import CheckpointConfig
from sparkdl.context import TrainContext
from sparkdl.data.cache import materialize
from sparkdl.data.dataset import DatasetInfo, inspect_dataset
from sparkdl.data.reader import DataSpec, reader_from_name, steps_per_epoch
from sparkdl.errors import ConfigError, DataError
from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.base import Strategy

DataSource = Union[str, Any]  # a dataset URL/path, or a pyspark.sql.DataFrame


def run(
    train_fn: Callable[[TrainContext], Any],
    *,
    num_workers: int,
    strategy: Optional[Strategy] = None,
    data: Optional[DataSource] = None,
    feature_cols: Sequence[str] = (),
    label_col: Optional[str] = None,
    batch_size: int = 32,
    shuffle: bool = True,
    seed: int = 0,
    reader: str = "petastorm",
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
        data: a Spark DataFrame (materialized to Parquet once) or a Parquet/Petastorm URL.
        feature_cols: numeric or array columns concatenated, in order, into the features.
        label_col: the label column, or None for unlabeled data.
        batch_size: rows per batch on each rank.
        shuffle: shuffle row groups and rows (seeded by ``seed``).
        seed: seed of the data shuffle.
        reader: the data reader plug-in (``"petastorm"``).
        spark: the SparkSession; default the active one.
        use_gpu: None uses GPUs when Spark assigns them to tasks; True requires them.
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

    Raises:
        TrainingError: a rank failed; names the rank and carries its traceback.
        InsufficientSlotsError: the cluster has fewer task slots than ``num_workers``.
        ConfigError, DataError: bad arguments or data, before anything launches.
    """
    config = LaunchConfig(
        num_workers=num_workers, use_gpu=use_gpu, timeout_s=timeout_s, progress=bool(progress),
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
        spec = DataSpec(batch_size=batch_size, shuffle=shuffle, seed=seed)
        data_reader = reader_from_name(reader)
        dataset = prepare_dataset(data, list(feature_cols), label_col, num_workers, spark, cache_dir)
        steps = steps_per_epoch(dataset.num_rows, spec.batch_size, num_workers)
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


def prepare_dataset(
    data: DataSource,
    feature_cols: Sequence[str],
    label_col: Optional[str],
    num_workers: int,
    spark: Any = None,
    cache_dir: Optional[str] = None,
) -> DatasetInfo:
    """Validates the columns and turns a DataFrame or URL into a dataset the tasks can stream."""
    if isinstance(feature_cols, str):
        raise ConfigError(f"feature_cols={feature_cols!r} must be a list of column names, e.g. [{feature_cols!r}]")
    if not feature_cols:
        raise ConfigError("feature_cols is empty: name at least one feature column")
    columns = list(feature_cols) + ([label_col] if label_col else [])
    if len(set(columns)) != len(columns):
        raise ConfigError(f"feature_cols and label_col repeat a column: {columns}")
    if isinstance(data, str):
        return inspect_dataset(data, feature_cols, label_col)
    from pyspark.sql import DataFrame

    if not isinstance(data, DataFrame):
        raise DataError(f"data must be a Spark DataFrame or a dataset URL string, got {type(data).__name__}")
    missing = [c for c in columns if c not in data.columns]
    if missing:
        raise DataError(f"column(s) {', '.join(map(repr, missing))} not in the DataFrame; its columns are: {', '.join(data.columns)}")
    _check_spark_types(data, feature_cols, label_col)
    url = materialize(data, columns, num_workers, cache_dir)
    return inspect_dataset(url, feature_cols, label_col)


def _check_spark_types(df: Any, feature_cols: Sequence[str], label_col: Optional[str]) -> None:
    """Rejects non-numeric columns before anything is written."""
    from pyspark.sql import types as T

    def numeric(data_type: Any) -> bool:
        if isinstance(data_type, T.ArrayType):
            return numeric(data_type.elementType)
        return isinstance(data_type, (T.NumericType, T.BooleanType))

    types = {f.name: f.dataType for f in df.schema.fields}
    for role, name in [("feature", c) for c in feature_cols] + ([("label", label_col)] if label_col else []):
        if not numeric(types[name]):
            raise DataError(
                f"{role} column {name!r} has type {types[name].simpleString()}, which is not numeric; "
                f"{role}s must be numbers or arrays of numbers"
            )
