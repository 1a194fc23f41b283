"""Driver side: a TorchModel's predictions for a DataFrame, as one ``mapInArrow`` stage.

:func:`scorer_for` builds the :class:`~sparkdl.inference.scorer.Scorer` (the model shipped by
:func:`~sparkdl.inference.model_source.ship_model`, the input plan checked against the
DataFrame's types, the heads' columns); :func:`transform_dataframe` runs it:

* over a DataFrame that only scans Parquet files (``spark.read.parquet(path)``, a Parquet
  table), the tasks read the files themselves (:mod:`sparkdl.inference.parts`), as training
  does: Spark's scan and the hand-over of every input row from the JVM to Python are skipped;
* over any other DataFrame, ``mapInArrow`` on it: Arrow batches from Spark, no pandas.

With ``resources=`` the stage gets its own resource profile (a GPU per task, say) while the rest
of the application keeps its defaults, as for training (docs/resources.md).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from sparkdl._driver.prepare_data import spark_column_infos
from sparkdl._driver.resource_profile import stage_profile
from sparkdl._spark import Session
from sparkdl.errors import ConfigError
from sparkdl.inference.api import InferenceOptions
from sparkdl.inference.file_scoring import score_files
from sparkdl.inference.model_source import ship_model
from sparkdl.inference.outputs import Head
from sparkdl.inference.scan import plain_parquet_sources
from sparkdl.inference.scorer import Scorer
from sparkdl.resources import Resources

_SOURCE = "the DataFrame to transform"


def model_heads(model: Any, options: InferenceOptions) -> List[Head]:
    """The model's heads and their columns: from ``model.output_heads`` (``{head: shape}``, a
    model with several outputs), else its one output of ``model.output_shape``."""
    shapes: Mapping[str, Sequence[int]] = getattr(model, "output_heads", None) or {"": model.output_shape}
    prediction = model.getPredictionCol()
    heads = []
    for name, shape in shapes.items():
        size = int(np.prod(shape)) if len(shape) else 1
        kind = options.kind_of(name)
        if kind in ("probabilities", "label", "top_k") and size < 2:
            raise ConfigError(
                f"output={kind!r} needs one score per class, but the model's output {name or 'tensor'!r} has one value "
                f"per row: use output='raw' for it"
            )
        heads.append(Head(name, prediction if len(shapes) == 1 else f"{prediction}_{name}", size, kind))
    return heads


def scorer_for(model: Any, spark: Any, input_schema: Any, options: InferenceOptions, source: str = _SOURCE) -> Scorer:
    """The scorer of ``model`` for rows of ``input_schema`` (a Spark ``StructType``).

    Raises:
        ConfigError: an input column missing, a prediction or error column that already
            exists, a kind the model's outputs cannot give, a model too large for Spark Connect.
        DataError: an input column of a type the model's input plan cannot use.
    """
    plan = model.input_plan
    names = [field.name for field in input_schema.fields]
    missing = [c for c in plan.columns if c not in names]
    if missing:
        raise ConfigError(f"column(s) {missing} not in {source}; its columns are: {names}")
    infos = spark_column_infos(_Schema(input_schema), plan)
    heads = model_heads(model, options)
    scorer = Scorer(
        ship_model(spark, model.module, model.scoring_factory(), model.saved_location()),
        plan,
        infos,
        heads,
        options,
        model.getPredictionCol(),
        source,
    )
    taken = [field.name for field in scorer.new_columns() if field.name in names]
    if taken:
        raise ConfigError(
            f"{source} already has column(s) {taken}, which scoring would add: choose another with "
            f"setPredictionCol(...) (or error_col= for the error column), or drop them first"
        )
    return scorer


def transform_dataframe(
    model: Any, dataset: Any, options: InferenceOptions, resources: Optional[Resources] = None
) -> Any:
    """``dataset`` with the model's prediction columns (see the module docstring)."""
    from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
    from pyspark.sql.types import StructField, StructType

    spark = dataset.sparkSession
    scorer = scorer_for(model, spark, dataset.schema, options)
    schema = StructType(
        [
            *dataset.schema.fields,
            *(StructField(f.name, from_arrow_type(f.type), nullable=True) for f in scorer.new_columns()),
        ]
    )
    kwargs: Dict[str, Any] = {}
    stage = stage_profile(Session(spark), resources)
    if stage is not None and stage.profile is not None:
        kwargs["profile"] = stage.profile
    roots = plain_parquet_sources(dataset)
    if roots is not None:
        scored = score_files(dataset, roots, to_arrow_schema(dataset.schema), scorer, schema, kwargs)
        if scored is not None:
            return scored
    return dataset.mapInArrow(scorer, schema, **kwargs)


class _Schema:
    """A Spark schema where :func:`spark_column_infos` expects a DataFrame."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
