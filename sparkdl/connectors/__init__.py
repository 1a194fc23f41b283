"""Connectors: where a platform's data becomes the Parquet that sparkdl's readers stream.

Each connector is a small :class:`Source` that resolves, on the driver, to the Parquet files (and
so the schema) to train on, without copying when the data can be read in place::

    from sparkdl import connectors

    est.fit(connectors.SparkTable("sales.clicks"))                       # a Spark/Hive table by name
    est.fit(connectors.DeltaSource("s3://lake/clicks", version=12))     # a Delta table, time travel
    sparkdl.run(train_fn, data=connectors.ParquetSource("gs://b/data/*.parquet"), ...)

``fit()`` and ``sparkdl.run(data=...)`` accept any object with a ``resolve(spark, columns)``
method returning :class:`sparkdl.data.dataset.ParquetFiles` (read in place) or a Spark
DataFrame (materialized once through sparkdl's cache).
"""

from sparkdl.connectors.base import Source
from sparkdl.connectors.delta import DeltaSource
from sparkdl.connectors.parquet import ParquetSource
from sparkdl.connectors.spark_table import SparkTable

__all__ = ["DeltaSource", "ParquetSource", "Source", "SparkTable"]
