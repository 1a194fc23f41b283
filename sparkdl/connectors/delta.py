"""Delta Lake tables as they are: partition columns, column mapping and deletion vectors.

A table version is read, in this order of preference:

1. **in place**, through delta-rs (the ``deltalake`` package; no Spark jars needed): the log
   names the version's Parquet files, each file's partition values, its columns' physical names
   and its deleted rows (:mod:`sparkdl.connectors.delta_log`), and the readers read the files
   with that :class:`~sparkdl.data.table_layout.TableLayout`: nothing is copied;
2. through the **Spark session's Delta reader** (delta-spark or Databricks), when in-place
   reading is not possible (a reader feature sparkdl does not read in place, say): a DataFrame
   that sparkdl materializes once like any other;
3. **copied** into sparkdl's cache (``spark.sparkdl.cacheDir``) when the session has no Delta
   reader: once per table version and driver, by sparkdl with the log's layout or, for a table
   it cannot interpret, by delta-rs's own reader (:mod:`sparkdl.connectors.delta_copy`).

Time travel picks the version by number or by timestamp; every path reads that version.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Dict, Optional, Sequence, Union

from sparkdl.connectors.base import Source
from sparkdl.data.dataset import EmptyDatasetError, ParquetFiles
from sparkdl.errors import ConfigError, DataError
from sparkdl.filesystem import normalize_url

logger = logging.getLogger("sparkdl.data")

_MATERIALIZE = ("auto", "never", "always")


class DeltaSource(Source):
    """A Delta Lake table at a path or URL, optionally at an earlier version.

    Args:
        path: the table's root (``/data/t``, ``s3://lake/t``, ...).
        version: read this table version (time travel); default the latest.
        timestamp: read the version current at this time (a ``datetime``, or an ISO-8601
            string such as ``"2024-05-01T00:00:00Z"``); exclusive with ``version``.
        storage_options: passed to delta-rs (object-store credentials and settings).
        materialize: ``"auto"`` (read in place when possible, else through the Spark session's
            Delta reader, else a copy), ``"never"`` (in place or fail), or ``"always"`` (never
            in place: for readers that read files only as they are stored, such as Petastorm).
        cache_dir: where a copy goes (default ``spark.sparkdl.cacheDir``, else the temp dir);
            on a cluster, storage every executor can read.

    Raises (at resolve):
        DataError: no Delta table there, a bad version or timestamp, a version without rows,
            or a table no path can read (each path's reason named); a missing column is named
            when the dataset is checked, as for any source.
    """

    def __init__(
        self,
        path: str,
        version: Optional[int] = None,
        timestamp: Optional[Union[str, datetime.datetime]] = None,
        storage_options: Optional[Dict[str, str]] = None,
        materialize: str = "auto",
        cache_dir: Optional[str] = None,
    ) -> None:
        if version is not None and timestamp is not None:
            raise ConfigError("pass version= or timestamp=, not both")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ConfigError(f"version={version!r} must be a table version number >= 0")
        if materialize not in _MATERIALIZE:
            raise ConfigError(f"materialize={materialize!r} must be one of {', '.join(map(repr, _MATERIALIZE))}")
        self.path = path
        self.version = version
        self.timestamp = timestamp
        self.storage_options = storage_options
        self.materialize = materialize
        self.cache_dir = cache_dir

    def table(self) -> Any:
        """The ``deltalake.DeltaTable`` at the chosen version."""
        try:
            from deltalake import DeltaTable
        except ImportError as exc:  # pragma: no cover - an optional dependency
            raise ConfigError("DeltaSource needs the deltalake package: pip install 'sparkdl-torch[delta]'") from exc
        from deltalake.exceptions import TableNotFoundError

        try:
            table = DeltaTable(self.path, version=self.version, storage_options=self.storage_options)
            if self.timestamp is not None:
                table.load_as_version(self.timestamp)
        except TableNotFoundError as exc:
            raise DataError(f"no Delta table at {self.path!r}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - delta-rs raises generic errors for bad versions
            raise _NotLoaded(f"cannot load Delta table {self.path!r} ({self._at()}): {exc}") from exc
        if self.timestamp is not None and table.version() == 0:
            self._check_not_before_the_first_version(table)
        return table

    def _check_not_before_the_first_version(self, table: Any) -> None:
        """delta-rs answers a timestamp before the table's first commit with version 0; Spark
        (and this) refuse it: the table did not exist then. Version 0's time is its log file's
        modification time (what delta-rs times versions by) or its commit's: the earlier one."""
        wanted = self.timestamp
        if isinstance(wanted, str):
            try:
                wanted = datetime.datetime.fromisoformat(wanted.replace("Z", "+00:00"))
            except ValueError:  # a form delta-rs reads and this Python does not: nothing to compare
                return
        if wanted.tzinfo is None:  # delta-rs reads a naive time as UTC
            wanted = wanted.replace(tzinfo=datetime.timezone.utc)
        stamps = [
            entry["timestamp"] / 1000 for entry in table.history() if entry.get("version") == 0 and "timestamp" in entry
        ]
        try:
            from sparkdl.filesystem import filesystem_and_path

            fs, root = filesystem_and_path(normalize_url(table.table_uri).rstrip("/"))
            stamps.append(fs.get_file_info(f"{root}/_delta_log/{0:020d}.json").mtime.timestamp())
        except Exception:  # noqa: BLE001 - a store this process cannot list: the commit's time only
            pass
        if stamps and wanted.timestamp() < min(stamps):
            first = datetime.datetime.fromtimestamp(min(stamps), datetime.timezone.utc).isoformat()
            raise DataError(
                f"Delta table {self.path!r} has no version at timestamp {self.timestamp}: its first is from {first}"
            )

    def resolve(self, spark: Any = None, columns: Sequence[str] = ()) -> Union[ParquetFiles, Any]:
        from sparkdl.connectors import delta_log

        try:
            table = self.table()
        except _NotLoaded as exc:
            return self._through_spark_only(spark, exc)
        description = f"Delta table {self.path} version {table.version()}"
        files, reason = None, "materialize='always'"
        try:
            files = delta_log.in_place(table, list(columns), description)
        except delta_log.NotInPlace as exc:
            reason = str(exc)
        if files is not None and self.materialize != "always":
            return files
        if self.materialize == "never":
            raise DataError(f"{description} cannot be read in place ({reason}) and materialize='never'")
        return self._not_in_place(table, files, spark, description, reason)

    def _through_spark_only(self, spark: Any, error: DataError) -> Any:
        """delta-rs cannot load the version (a version or a reader feature it does not know):
        the session's Delta reader may."""
        from sparkdl.connectors import delta_copy

        if self.materialize == "never":
            raise error
        frame, not_spark = delta_copy.spark_read(spark, normalize_url(self.path), self._spark_options())
        if frame is None:
            raise DataError(f"{error}; Spark: {not_spark}") from error
        logger.info("reading Delta table %s through Spark's Delta reader: %s", self.path, error)
        return frame

    def _not_in_place(
        self, table: Any, files: Optional[ParquetFiles], spark: Any, description: str, reason: str
    ) -> Union[ParquetFiles, Any]:
        """Through the session's Delta reader, else a copy (from ``files`` when sparkdl can read
        them, else by delta-rs)."""
        from sparkdl.connectors import delta_copy

        frame, not_spark = delta_copy.spark_read(spark, normalize_url(self.path), {"versionAsOf": str(table.version())})
        if frame is not None:
            logger.info("reading %s through Spark's Delta reader: not in place because %s", description, reason)
            return frame
        logger.info("copying %s: not in place because %s; not through Spark: %s", description, reason, not_spark)
        key = f"delta:{normalize_url(table.table_uri).rstrip('/')}@{table.version()}"
        try:
            return delta_copy.copy_table(table, files, key, description, self.cache_dir, spark)
        except EmptyDatasetError:
            raise
        except DataError as exc:
            raise DataError(
                f"{exc}. It was not read in place ({reason}) nor by Spark ({not_spark}); "
                f"read it with a Spark session that has Delta (delta-spark) and pass the DataFrame"
            ) from exc

    def _spark_options(self) -> Dict[str, str]:
        if self.version is not None:
            return {"versionAsOf": str(self.version)}
        if self.timestamp is not None:
            stamp = self.timestamp
            return {"timestampAsOf": stamp.isoformat() if isinstance(stamp, datetime.datetime) else stamp}
        return {}

    def _at(self) -> str:
        if self.version is not None:
            return f"version {self.version}"
        if self.timestamp is not None:
            return f"timestamp {self.timestamp}"
        return "latest version"


class _NotLoaded(DataError):
    """delta-rs cannot load the table version (a bad version, or a reader feature it lacks)."""
