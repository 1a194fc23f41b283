"""Spark / Hive metastore tables by name, read in place when they are Parquet."""

from __future__ import annotations

from typing import Any, Dict, Sequence, Union

from sparkdl.connectors.base import Source, _require_spark
from sparkdl.data.dataset import ParquetFiles
from sparkdl.errors import ConfigError, DataError
from sparkdl.filesystem import normalize_url


class SparkTable(Source):
    """A table in the session's catalog (``spark.table(name)``).

    A managed or external Parquet table is read in place: its files come from Spark itself
    (``DataFrame.inputFiles()``, which honours the catalog's partitions), its location from
    ``DESCRIBE TABLE EXTENDED``. Otherwise — a view, another format (CSV, ORC, JSON), or a needed
    column that exists only as a partition directory — the table is materialized once through
    sparkdl's DataFrame cache. A Delta table (provider ``delta``) is resolved through its log
    with :class:`~connectors.DeltaSource`.

    Args:
        name: the table name, optionally qualified (``db.table``).
        materialize: ``"auto"`` (copy only when it cannot be read in place), ``"never"`` (fail
            instead of copying), or ``"always"``.
    """

    def __init__(self, name: str, materialize: str = "auto") -> None:
        if materialize not in ("auto", "never", "always"):
            raise ConfigError(f"materialize={materialize!r} must be 'auto', 'never' or 'always'")
        self.name = name
        self.materialize = materialize

    def describe(self, spark: Any) -> Dict[str, str]:
        """The table's detail rows (``Provider``, ``Location``, ``Type``, ...)."""
        try:
            rows = spark.sql(f"DESCRIBE TABLE EXTENDED {self.name}").collect()
        except Exception as exc:  # noqa: BLE001 - AnalysisException and friends
            raise DataError(f"no table {self.name!r} in the Spark catalog: {str(exc).splitlines()[0]}") from exc
        return {row["col_name"].strip(): (row["data_type"] or "").strip() for row in rows if row["col_name"]}

    def resolve(self, spark: Any, columns: Sequence[str] = ()) -> Union[ParquetFiles, Any]:
        spark = _require_spark(spark, f"SparkTable({self.name!r})")
        details = self.describe(spark)
        provider = details.get("Provider", "").lower()
        kind = details.get("Type", "").upper()
        location = details.get("Location", "")
        if provider == "delta" and location and self.materialize != "always":
            from sparkdl.connectors.delta import DeltaSource

            return DeltaSource(location, materialize=self.materialize).resolve(spark, columns)
        reason = self._not_in_place(spark, details, provider, kind, columns)
        if reason is None:
            files = sorted(spark.table(self.name).inputFiles(), key=lambda f: f.split("/"))
            if not files:
                raise DataError(f"Spark table {self.name!r} has no data files")
            return ParquetFiles(
                url=normalize_url(location) if location else normalize_url(files[0]),
                files=tuple(normalize_url(f) for f in files),
                description=f"Spark table {self.name} ({kind.lower()} {provider}, read in place)",
            )
        if self.materialize == "never":
            raise DataError(f"Spark table {self.name!r} cannot be read in place ({reason}) and materialize='never'")
        return spark.table(self.name)

    def _not_in_place(self, spark: Any, details: Dict[str, str], provider: str, kind: str, columns: Sequence[str]):
        """Why the table cannot be read in place, or None when it can."""
        if self.materialize == "always":
            return "materialize='always'"
        if kind not in ("MANAGED", "EXTERNAL"):
            return f"it is a {kind.lower() or 'view'}"
        hive_parquet = provider == "hive" and "parquet" in details.get("Serde Library", "").lower()
        if provider != "parquet" and not hive_parquet:
            return f"its format is {provider or 'unknown'}, not Parquet"
        partitions = self._partition_columns(spark) & set(columns)
        if partitions:
            return f"column(s) {', '.join(sorted(partitions))} are partition columns, not stored in the files"
        return None

    def _partition_columns(self, spark: Any) -> set:
        return {c.name for c in spark.catalog.listColumns(self.name) if c.isPartition}
