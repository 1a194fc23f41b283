"""Driver-side data preparation: everything the tasks need to read data, checked before launch.

A DataFrame is materialized to Parquet once (:mod:`sparkdl.data.cache`), a URL or connector
source is read in place; either way the columns are checked against the run's
:class:`~sparkdl.data.plan.InputPlan` from the Parquet footers alone
(:func:`~sparkdl.data.dataset.inspect_dataset`), shard sizes are computed, and empty shards fail
here, on the driver, in terms of the user's data.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple, Union

from sparkdl._driver.dataframe_copy import copy_for_run
from sparkdl.checkpoint import CheckpointConfig
from sparkdl.data import shard_cache
from sparkdl.data.batching import steps_per_epoch
from sparkdl.data.cache import materialize
from sparkdl.data.columns import ColumnInfo
from sparkdl.data.dataset import (
    DatasetInfo,
    EmptyDatasetError,
    Filters,
    ParquetFiles,
    inspect_dataset,
    referenced_columns,
)
from sparkdl.data.inputs import Column, Dense, Image
from sparkdl.data.inputs import Sequence as SequenceInput
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers.base import DataReader
from sparkdl.data.spec import DataSpec, TransformFn, ValidationSpec
from sparkdl.errors import ConfigError, DataError

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl._driver.settings import DataSettings

DataSource = Union[str, Any]  # a dataset URL/path, a pyspark.sql.DataFrame, ParquetFiles, or a connector source

logger = logging.getLogger("sparkdl.data")
#: A shard with more than this many times another's rows gets a warning (:func:`_warn_if_uneven`).
UNEVEN_SHARDS = 1.5


def prepare_data(
    data: DataSource,
    settings: "DataSettings",
    num_workers: int,
    spark: Any = None,
    task_cpus: Optional[float] = None,
    checkpoint: Optional[CheckpointConfig] = None,
) -> Tuple[DatasetInfo, DataSpec, DataReader, int]:
    """Everything the tasks need to read ``data`` as ``settings`` say, checked on the driver
    before launch. ``task_cpus``: the training stage's CPUs per task when ``resources=`` sets
    them (how many ranks share an executor's memory), else ``spark.task.cpus``. ``checkpoint``:
    the run's checkpoints, beside which a training DataFrame's copy is kept
    (:mod:`sparkdl._driver.dataframe_copy`; the entry point removes it when the run completes).

    Returns the training dataset, the data spec (with the validation plan), the reader, and the
    steps per epoch (from the rows that pass the filter and are not held out).

    Raises:
        DataError: bad data, or a rank whose shard holds no rows.
        ConfigError: the session's settings rule the launch out (dynamic allocation on, Spark
            encrypting without unencrypted collectives accepted), before anything is read or
            written: :func:`sparkdl._driver.session_checks.check_session`.
    """
    from sparkdl._driver.session_checks import check_session

    # What the launch would refuse because of the session's settings, refused before a
    # DataFrame is written to the cache, not after.
    check_session(spark or getattr(data, "sparkSession", None))
    plan, spec, filters = settings.plan, settings.spec, settings.filters
    data_reader = settings.data_reader()

    def prepare(source: DataSource, what: str, checkpoint: Optional[CheckpointConfig] = None) -> DatasetInfo:
        prepared = prepare_dataset(
            source,
            plan,
            num_workers,
            spark,
            settings.cache_dir,
            filters=filters,
            transform_fn=settings.transform_fn,
            what=what,
            pack_arrays=data_reader.reads_tensor_bytes,
            checkpoint=checkpoint,
        )
        data_reader.check(prepared)
        return prepared

    # Only the training data's positions are checkpointed: only its copy is kept with them.
    dataset = prepare(data, "the DataFrame", checkpoint)
    validation_data = (
        prepare(settings.validation_data, "the validation DataFrame") if settings.validation_data is not None else None
    )
    steps = _steps_per_epoch(dataset, settings, num_workers)
    if settings.validation is not None:
        _check_validation_rows(validation_data or dataset, validation_data is not None, settings, num_workers)
        metrics = tuple(sorted((settings.metrics or {}).items()))
        spec = dataclasses.replace(spec, validation=ValidationSpec(validation_data, metrics))
    session = spark or getattr(data, "sparkSession", None)
    cache = _shard_cache(settings, dataset, num_workers, data_reader, session, task_cpus)
    return dataset, dataclasses.replace(spec, shard_cache=cache), data_reader, steps


def _steps_per_epoch(dataset: DatasetInfo, settings: "DataSettings", num_workers: int) -> int:
    """Steps every rank runs per epoch, from the rows of each rank's shard that pass the filters
    and are not held out; a rank whose shard holds none is a DataError."""
    from sparkdl.data.selection import shard_rows

    filters, holdout = settings.filters, settings.holdout
    conditions = [
        text
        for text, on in (("pass the filters", filters is not None), ("are not held out for validation", holdout))
        if on
    ]
    narrowed = " that " + " and ".join(conditions) if conditions else ""
    counts = shard_rows(dataset, num_workers, holdout, "train", filters)
    empty = [rank for rank, rows in enumerate(counts) if rows == 0]
    if empty:
        raise DataError(
            f"the shard of rank(s) {', '.join(map(str, empty))} in {dataset.name} holds no rows{narrowed} "
            f"(rows per rank: {counts}); use fewer workers, more row groups, or a wider filter"
        )
    _warn_if_uneven(dataset, counts, narrowed)
    return steps_per_epoch(sum(counts), settings.spec.batch_size, num_workers)


def _check_validation_rows(source: DatasetInfo, separate: bool, settings: "DataSettings", num_workers: int) -> None:
    """The validation rows (``separate``: validation data of its own, else the held-out rows of
    the training data) must not be empty."""
    from sparkdl.data.selection import shard_rows

    filters = settings.filters
    held = shard_rows(
        source, num_workers, 0.0 if separate else settings.holdout, "train" if separate else "holdout", filters
    )
    if sum(held) == 0:
        raise DataError(
            f"the validation data ({source.name}) holds no rows{' that pass the filters' if filters is not None else ''}"
        )


def _shard_cache(
    settings: "DataSettings",
    dataset: DatasetInfo,
    num_workers: int,
    reader: DataReader,
    spark: Any,
    task_cpus: Optional[float] = None,
) -> shard_cache.Decision:
    """Whether each rank keeps its decoded shard in memory, from the setting, the largest rank's
    shard and the memory a task has (Spark's settings; their defaults without a session)."""
    from pyspark.sql import SparkSession

    from sparkdl._spark import Session

    spark = spark or SparkSession.getActiveSession()
    memory, source = shard_cache.task_memory_bytes(
        Session(spark).conf if spark is not None else lambda key: None, task_cpus
    )
    decision = shard_cache.decide(
        settings.shard_cache, dataset, num_workers, settings.holdout, reader.caches_row_groups, memory, source
    )
    logger.info("shard cache: %s", decision.reason)
    return decision


def _warn_if_uneven(dataset: DatasetInfo, counts: Sequence[int], narrowed: str) -> None:
    """Warns when one rank's shard holds more than ``UNEVEN_SHARDS`` times another's rows:
    every rank runs the same steps per epoch, so the smaller shard's rows are trained on that
    many times as often (a skew the user should know of, not an error)."""
    small, large = min(counts), max(counts)
    if small == 0 or large <= UNEVEN_SHARDS * small:
        return
    logger.warning(
        "the ranks' shards of %s are uneven: rows per rank%s: %s. The shard unit is the Parquet row group (rank r "
        "reads row groups r, r+n, ...) and every rank runs the same steps per epoch, so rank %d's rows are trained "
        "on %.1fx as often as rank %d's. Write the data as more row groups of even size, or fit it as a DataFrame "
        "(sparkdl writes its copy with even row groups)",
        dataset.name,
        narrowed,
        list(counts),
        counts.index(small),
        large / small,
        counts.index(large),
    )


def prepare_dataset(
    data: DataSource,
    plan: Union[InputPlan, Sequence[str]],
    num_workers: int,
    spark: Any = None,
    cache_dir: Optional[str] = None,
    filters: Filters = None,
    transform_fn: Optional[TransformFn] = None,
    label_col: Optional[str] = None,
    what: str = "the DataFrame",
    pack_arrays: bool = False,
    checkpoint: Optional[CheckpointConfig] = None,
) -> DatasetInfo:
    """Validates the columns and turns a DataFrame, URL or connector source into a dataset the
    tasks can stream (a DataFrame is materialized with the columns to train on and filter by).
    ``plan`` may also be a list of feature columns (with ``label_col``); ``what`` names a
    DataFrame in messages (``"the validation DataFrame"``): its copy's path never appears.
    ``pack_arrays`` writes a DataFrame's array columns that dense inputs read as float32 bytes
    (:mod:`sparkdl.data.tensor_bytes`; for readers with ``reads_tensor_bytes``). With
    ``checkpoint``, a DataFrame's copy is kept beside the checkpoints
    (:func:`sparkdl._driver.dataframe_copy.copy_for_run`), else in the driver's cache."""
    if not isinstance(plan, InputPlan):
        plan = InputPlan.from_feature_cols(plan, label_col)
    columns = plan.columns
    if isinstance(data, (str, ParquetFiles)):
        return _inspect(data, plan, filters, transform_fn)
    from pyspark.sql import DataFrame, SparkSession

    if not isinstance(data, DataFrame) and callable(getattr(data, "resolve", None)):
        # A connector source: Parquet files to read in place, or a DataFrame to materialize.
        data = data.resolve(spark or SparkSession.getActiveSession(), columns)
        if isinstance(data, ParquetFiles):
            return _inspect(data, plan, filters, transform_fn)
    if not isinstance(data, DataFrame):
        raise DataError(
            f"data must be a Spark DataFrame, a dataset URL string or a connector source, got {type(data).__name__}"
        )
    missing = [c for c in columns if c not in data.columns]
    if missing:
        raise DataError(
            f"column(s) {', '.join(map(repr, missing))} not in the DataFrame; its columns are: {', '.join(data.columns)}"
        )
    _check_spark_types(data, plan)
    if filters is not None:
        columns += [c for c in referenced_columns(filters, _arrow_schema(data), "the DataFrame") if c not in columns]
    packed = _dense_array_columns(data, plan) if pack_arrays else ()
    url = copy_for_run(data, columns, num_workers, checkpoint, packed, cache_dir) or materialize(
        data, columns, num_workers, cache_dir, packed=packed
    )
    try:
        dataset = _inspect(url, plan, filters, transform_fn)
    except EmptyDatasetError:
        raise DataError(
            f"{what} has no rows: there is nothing to train on (check the filters or joins that built it)"
        ) from None
    return dataclasses.replace(dataset, origin=what)


def _dense_array_columns(df: Any, plan: InputPlan) -> Tuple[str, ...]:
    """The numeric array columns only :class:`Dense` inputs read: they become float32 anyway."""
    from pyspark.sql import types as T

    types = {f.name: f.dataType for f in df.schema.fields}
    dense = {c for _, spec in plan.inputs if isinstance(spec, Dense) for c in spec.source_columns()}
    others = {c for _, spec in plan.inputs if not isinstance(spec, Dense) for c in spec.source_columns()}
    if plan.label_column:
        others.add(plan.label_column)
    return tuple(
        sorted(
            c
            for c in dense - others
            if isinstance(types[c], T.ArrayType)
            and isinstance(types[c].elementType, (T.IntegralType, T.FloatType, T.DoubleType, T.BooleanType))
        )
    )


def _inspect(data: Any, plan: InputPlan, filters: Filters, transform_fn: Optional[TransformFn]) -> DatasetInfo:
    dataset = inspect_dataset(data, plan, filters=filters)
    if transform_fn is None:
        # Strings and bytes read as they are can only become tensors through transform_fn.
        for key, spec in plan.inputs:
            info = dataset.infos.get(spec.source_columns()[0])
            if isinstance(spec, Column) and info is not None and info.kind in ("string", "binary"):
                raise ConfigError(
                    f"input {key!r} reads {info.kind} column {info.name!r} as it is, which cannot become a tensor: "
                    f"tokenize or encode it in transform_fn=, or use sparkdl.Image for encoded images"
                )
    return dataset


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


def _check_spark_types(df: Any, plan: InputPlan) -> None:
    """Rejects columns an input cannot use before anything is written."""
    from pyspark.sql import types as T

    def numeric(data_type: Any) -> bool:
        if isinstance(data_type, T.ArrayType):
            return numeric(data_type.elementType)
        return isinstance(data_type, (T.NumericType, T.BooleanType))

    def integers(data_type: Any) -> bool:
        return isinstance(data_type, T.ArrayType) and isinstance(data_type.elementType, T.IntegralType)

    def image(data_type: Any) -> bool:
        if isinstance(data_type, T.BinaryType):
            return True
        return isinstance(data_type, T.StructType) and {"height", "width", "nChannels", "data"} <= set(
            data_type.fieldNames()
        )

    types = {f.name: f.dataType for f in df.schema.fields}
    checks = [(plan.role(key), column, spec) for key, spec in plan.inputs for column in spec.source_columns()]
    if plan.label is not None:
        checks.append(("label", plan.label_column, plan.label))
    for role, name, spec in checks:
        data_type = types[name]
        if isinstance(spec, Image) and not image(data_type):
            raise DataError(
                f"{role} column {name!r} has type {data_type.simpleString()}; sparkdl.Image needs a binary column of encoded "
                f"images or a spark.read.format('image') struct"
            )
        if isinstance(spec, SequenceInput) and not integers(data_type):
            raise DataError(
                f"{role} column {name!r} has type {data_type.simpleString()}; sparkdl.Sequence needs arrays of integers "
                f"(token ids), e.g. array<int>"
            )
        if isinstance(spec, Dense) and not numeric(data_type):
            plural = "features" if role == "feature" else "inputs"
            raise DataError(
                f"{role} column {name!r} has type {data_type.simpleString()}, which is not numeric; "
                f"{plural} must be numbers or arrays of numbers"
            )
        if isinstance(spec, Column) and not (numeric(data_type) or isinstance(data_type, (T.StringType, T.BinaryType))):
            raise DataError(f"{role} column {name!r} has type {data_type.simpleString()}, which is not numeric")


def spark_column_infos(df: Any, plan: InputPlan) -> dict:
    """What each column of a DataFrame holds, as :class:`ColumnInfo` (``TorchModel.transform``
    reads the DataFrame's own types: they may differ from the training data's storage)."""
    from pyspark.sql import types as T

    def kind(data_type: Any) -> str:
        if isinstance(data_type, (T.FloatType, T.DoubleType, T.DecimalType)):
            return "float"
        if isinstance(data_type, (T.IntegralType, T.BooleanType)):
            return "int"
        if isinstance(data_type, T.BinaryType):
            return "binary"
        if isinstance(data_type, T.StringType):
            return "string"
        if isinstance(data_type, T.StructType) and {"height", "width", "nChannels", "data"} <= set(
            data_type.fieldNames()
        ):
            return "image_struct"
        return "other"

    types = {f.name: f.dataType for f in df.schema.fields}
    infos = {}
    for column in plan.columns:
        data_type = types[column]
        if isinstance(data_type, T.ArrayType):
            element = kind(data_type.elementType)
            infos[column] = ColumnInfo(
                column, element if element in ("float", "int") else "other", (None,), type_name=data_type.simpleString()
            )
        else:
            infos[column] = ColumnInfo(column, kind(data_type), (), type_name=data_type.simpleString())
    plan.check(infos, "the DataFrame to transform")
    return infos
