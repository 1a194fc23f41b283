"""``sparkdl.run``: the low-level entry for custom training loops."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

from sparkdl._launcher import LaunchConfig, launch
from sparkdl._progress import ProgressCallback, ProgressDisplay
from sparkdl.checkpoint import CheckpointConfig
from sparkdl.context import TrainContext
from sparkdl.data.cache import materialize
from sparkdl.data.dataset import DatasetInfo, Filters, ParquetFiles, inspect_dataset, referenced_columns
from sparkdl.data.reader import DataReader, DataSpec, MetricFn, TransformFn, ValidationSpec, reader_from_name, steps_per_epoch
from sparkdl.errors import ConfigError, DataError
from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.base import Strategy

DataSource = Union[str, Any]  # a dataset URL/path, a pyspark.sql.DataFrame, ParquetFiles, or a connector source
#: The reader used when none is named (see docs/data.md for the measurements behind it).
DEFAULT_READER = "arrow"


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
        feature_cols: numeric or array columns concatenated, in order, into the features.
        label_col: the label column, or None for unlabeled data.
        batch_size: rows per batch on each rank.
        shuffle: shuffle row groups and rows (seeded by ``seed``).
        seed: seed of the data shuffle.
        reader: the data reader plug-in: ``"arrow"`` (native pyarrow) or ``"petastorm"``.
        filters: keep only matching rows: pyarrow's DNF ``[("col", ">", 3), ...]`` or a
            ``pyarrow.compute`` expression; row groups ruled out by their statistics are skipped.
        transform_fn: ``(features, labels) -> (features, labels)`` on numpy arrays, run on
            the executors for every batch (training and validation); must keep the row count.
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
            data, feature_cols=feature_cols, label_col=label_col, num_workers=num_workers, batch_size=batch_size,
            shuffle=shuffle, seed=seed, reader=reader, filters=filters, transform_fn=transform_fn,
            validation=validation, metrics=metrics, spark=spark, cache_dir=cache_dir,
        )
    elif validation is not None or filters is not None or transform_fn is not None or metrics:
        raise ConfigError("validation=, filters=, transform_fn= and metrics= need data=")
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


def prepare_data(
    data: DataSource,
    *,
    feature_cols: Sequence[str],
    label_col: Optional[str],
    num_workers: int,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    reader: str = DEFAULT_READER,
    filters: Filters = None,
    transform_fn: Optional[TransformFn] = None,
    validation: Optional[Union[float, DataSource]] = None,
    metrics: Optional[Mapping[str, MetricFn]] = None,
    spark: Any = None,
    cache_dir: Optional[str] = None,
) -> Tuple[DatasetInfo, DataSpec, DataReader, int]:
    """Everything the tasks need to read data, checked on the driver before launch.

    Returns the training dataset, the data spec (with the validation plan), the reader, and the
    steps per epoch (from the rows that pass the filter and are not held out).

    Raises:
        ConfigError: bad arguments (validation fraction, metrics without validation, ...).
        DataError: bad data, or a rank whose shard holds no rows.
    """
    from sparkdl.data.selection import shard_rows

    data_reader = reader_from_name(reader)
    holdout, validation_data = 0.0, None
    if metrics is not None and (not isinstance(metrics, Mapping) or not all(callable(f) for f in metrics.values())):
        raise ConfigError(f"metrics={metrics!r} must map names to functions fn(output, label) -> scalar")
    if validation is None:
        if metrics:
            raise ConfigError("metrics= are computed on validation data: pass validation= as well")
    elif isinstance(validation, float):
        if not 0.0 < validation < 1.0:
            raise ConfigError(f"validation={validation!r}: a fraction of the rows must be in (0, 1)")
        holdout = validation
    elif isinstance(validation, (bool, int)):
        raise ConfigError(f"validation={validation!r} must be a fraction in (0, 1) or validation data")
    spec = DataSpec(
        batch_size=batch_size, shuffle=shuffle, seed=seed, filters=filters, transform_fn=transform_fn, holdout=holdout,
    )
    dataset = prepare_dataset(data, list(feature_cols), label_col, num_workers, spark, cache_dir, filters=filters)
    if validation is not None and not holdout:
        validation_data = prepare_dataset(validation, list(feature_cols), label_col, num_workers, spark, cache_dir, filters=filters)
    if validation is not None:
        spec = dataclasses.replace(spec, validation=ValidationSpec(validation_data, tuple(sorted((metrics or {}).items()))))

    conditions = [text for text, on in (("pass the filters", filters is not None), ("are not held out for validation", holdout)) if on]
    narrowed = " that " + " and ".join(conditions) if conditions else ""
    counts = shard_rows(dataset, num_workers, holdout, "train", filters)
    empty = [rank for rank, rows in enumerate(counts) if rows == 0]
    if empty:
        raise DataError(
            f"the shard of rank(s) {', '.join(map(str, empty))} in dataset {dataset.url!r} holds no rows{narrowed} "
            f"(rows per rank: {counts}); use fewer workers, more row groups, or a wider filter"
        )
    steps = steps_per_epoch(sum(counts), spec.batch_size, num_workers)
    if validation is not None:
        source = validation_data or dataset
        held = shard_rows(source, num_workers, 0.0 if validation_data else holdout, "train" if validation_data else "holdout", filters)
        if sum(held) == 0:
            raise DataError(f"the validation data ({source.url!r}) holds no rows{' that pass the filters' if filters is not None else ''}")
    return dataset, spec, data_reader, steps


def prepare_dataset(
    data: DataSource,
    feature_cols: Sequence[str],
    label_col: Optional[str],
    num_workers: int,
    spark: Any = None,
    cache_dir: Optional[str] = None,
    filters: Filters = None,
) -> DatasetInfo:
    """Validates the columns and turns a DataFrame, URL or connector source into a dataset the
    tasks can stream (a DataFrame is materialized with the columns to train on and filter by)."""
    if isinstance(feature_cols, str):
        raise ConfigError(f"feature_cols={feature_cols!r} must be a list of column names, e.g. [{feature_cols!r}]")
    if not feature_cols:
        raise ConfigError("feature_cols is empty: name at least one feature column")
    columns = list(feature_cols) + ([label_col] if label_col else [])
    if len(set(columns)) != len(columns):
        raise ConfigError(f"feature_cols and label_col repeat a column: {columns}")
    if isinstance(data, (str, ParquetFiles)):
        return inspect_dataset(data, feature_cols, label_col, filters)
    from pyspark.sql import DataFrame, SparkSession

    if not isinstance(data, DataFrame) and callable(getattr(data, "resolve", None)):
        # A connector source: Parquet files to read in place, or a DataFrame to materialize.
        data = data.resolve(spark or SparkSession.getActiveSession(), columns)
        if isinstance(data, ParquetFiles):
            return inspect_dataset(data, feature_cols, label_col, filters)
    if not isinstance(data, DataFrame):
        raise DataError(
            f"data must be a Spark DataFrame, a dataset URL string or a connector source, got {type(data).__name__}"
        )
    missing = [c for c in columns if c not in data.columns]
    if missing:
        raise DataError(f"column(s) {', '.join(map(repr, missing))} not in the DataFrame; its columns are: {', '.join(data.columns)}")
    _check_spark_types(data, feature_cols, label_col)
    if filters is not None:
        columns += [c for c in referenced_columns(filters, _arrow_schema(data), "the DataFrame") if c not in columns]
    url = materialize(data, columns, num_workers, cache_dir)
    return inspect_dataset(url, feature_cols, label_col, filters)


def _arrow_schema(df: Any) -> Any:
    """The DataFrame's columns that Arrow can represent, as an Arrow schema."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_type

    fields = []
    for field in df.schema.fields:
        try:
            fields.append(pa.field(field.name, to_arrow_type(field.dataType)))
        except Exception:  # noqa: BLE001 - a type Arrow lacks cannot be filtered on anyway
            continue
    return pa.schema(fields)


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
