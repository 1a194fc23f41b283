"""Delta Lake tables through delta-rs (the ``deltalake`` package): no Spark jars needed.

The Delta log says which Parquet files make up a table version; those files are read in place.
Time travel picks the version by number or by timestamp. delta-spark is not required (and the
tests could not use it: its JVM jars come from Maven, which this project's environment cannot
reach), so this works the same with or without Spark.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, Optional, Sequence, Union

from sparkdl.connectors.base import Source
from sparkdl.data.dataset import ParquetFiles
from sparkdl.errors import ConfigError, DataError
from sparkdl.filesystem import normalize_url

#: Reader features that change what the Parquet files mean: deleted rows still in the files
#: (deletion vectors), physical column names that differ from the logical ones (column mapping).
_UNSUPPORTED_FEATURES = {"deletionVectors", "columnMapping"}


class DeltaSource(Source):
    """A Delta Lake table at a path or URL, optionally at an earlier version.

    Args:
        path: the table's root (``/data/t``, ``s3://lake/t``, ...).
        version: read this table version (time travel); default the latest.
        timestamp: read the version current at this time (a ``datetime``, or an ISO-8601
            string such as ``"2024-05-01T00:00:00Z"``); exclusive with ``version``.
        storage_options: passed to delta-rs (object-store credentials and settings).

    Raises (at resolve):
        DataError: no Delta table there, an empty version, a needed column that is a partition
            column (its values are not in the files), or a table whose reader features
            (deletion vectors, column mapping) mean its files cannot be read as plain Parquet.
    """

    def __init__(
        self,
        path: str,
        version: Optional[int] = None,
        timestamp: Optional[Union[str, datetime.datetime]] = None,
        storage_options: Optional[Dict[str, str]] = None,
    ) -> None:
        if version is not None and timestamp is not None:
            raise ConfigError("pass version= or timestamp=, not both")
        if version is not None and (not isinstance(version, int) or version < 0):
            raise ConfigError(f"version={version!r} must be a table version number >= 0")
        self.path = path
        self.version = version
        self.timestamp = timestamp
        self.storage_options = storage_options

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
            raise DataError(f"cannot load Delta table {self.path!r} ({self._at()}): {exc}") from exc
        return table

    def resolve(self, spark: Any = None, columns: Sequence[str] = ()) -> ParquetFiles:
        table = self.table()
        features = set(table.protocol().reader_features or ()) & _UNSUPPORTED_FEATURES
        if features:
            raise DataError(
                f"Delta table {self.path!r} uses {', '.join(sorted(features))}: its Parquet files cannot be read "
                f"as they are; read it with Spark (delta-spark) and pass the DataFrame instead"
            )
        partitions = set(table.metadata().partition_columns) & set(columns)
        if partitions:
            raise DataError(
                f"column(s) {', '.join(sorted(partitions))} of Delta table {self.path!r} are partition columns, whose "
                f"values live in the Delta log, not the Parquet files; read it with Spark and pass the DataFrame"
            )
        # Sorted: the log's file order depends on how it was replayed; sharding wants a fixed one.
        files = sorted(normalize_url(uri) for uri in table.file_uris())
        if not files:
            raise DataError(f"Delta table {self.path!r} has no data files at version {table.version()}")
        return ParquetFiles(
            url=normalize_url(self.path),
            files=tuple(files),
            description=f"Delta table {self.path} version {table.version()}",
        )

    def _at(self) -> str:
        if self.version is not None:
            return f"version {self.version}"
        if self.timestamp is not None:
            return f"timestamp {self.timestamp}"
        return "latest version"
