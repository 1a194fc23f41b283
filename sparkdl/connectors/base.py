"""The connector interface."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Sequence, Union

from sparkdl.data.dataset import ParquetFiles

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession


class Source(abc.ABC):
    """Data to train on, resolved on the driver just before training.

    Subclasses implement :meth:`resolve`. ``TorchEstimator.fit(source)`` and
    ``sparkdl.run(data=source)`` call it, then validate the result from Parquet footers
    (columns, types across files, row counts) as for any dataset.
    """

    @abc.abstractmethod
    def resolve(self, spark: "SparkSession | None", columns: Sequence[str]) -> Union[ParquetFiles, "DataFrame"]:
        """The Parquet files to read in place, or a DataFrame to materialize when the data cannot
        be read in place (another format, a view, a needed column that lives only in the
        partition directories).

        Args:
            spark: the active SparkSession, or None when there is none (sources that do not
                need Spark, such as Delta through delta-rs, work without one).
            columns: the columns the run reads (features and label).
        """

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if v is not None)
        return f"{type(self).__name__}({fields})"


def _require_spark(spark: Any, what: str) -> Any:
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    if spark is None:
        from sparkdl.errors import ConfigError

        raise ConfigError(f"{what} needs a SparkSession: create one first")
    return spark
