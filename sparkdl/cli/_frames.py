"""Parquet datasets at any URL as Spark DataFrames, for ``sparkdl predict``: Spark's own reader and
writer where the cluster's Hadoop has a filesystem for the URL's scheme (local paths, ``hdfs://``,
EMR's ``s3://``, ``s3a://`` with hadoop-aws, Dataproc's ``gs://``), else Parquet files read and
written on the executors through :mod:`sparkdl.filesystem` (pyarrow's filesystems, else fsspec).

The executors open the URL themselves, so it must carry what they need (an endpoint in the
URL's query, credentials from their environment or instance role), as for a training dataset.
Writing commits like Spark's own committer: each task writes its part under ``_temporary/``,
the driver moves the parts of the tasks that succeeded into place, then writes ``_SUCCESS``.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Iterator, List

from sparkdl.cli._common import UsageError


def read_parquet(spark: Any, url: str, option: str) -> Any:
    """The DataFrame of the Parquet dataset at ``url`` (``option`` names it in errors)."""
    try:
        return spark.read.parquet(url)
    except Exception as exc:  # noqa: BLE001 - Spark raises Py4J or Connect errors for a missing filesystem
        if not _no_hadoop_filesystem(exc):
            raise
    return _read_through_filesystem(spark, url, option)


def write_parquet(frame: Any, url: str, overwrite: bool) -> None:
    """Writes ``frame`` as a Parquet dataset at ``url`` (an existing one is replaced with
    ``overwrite``, else refused)."""
    try:
        frame.write.mode("overwrite" if overwrite else "errorifexists").parquet(url)
        return
    except Exception as exc:  # noqa: BLE001
        if not _no_hadoop_filesystem(exc):
            raise
    _write_through_filesystem(frame, url, overwrite)


def _no_hadoop_filesystem(exc: BaseException) -> bool:
    """Whether Spark failed because its Hadoop has no FileSystem for the URL's scheme (it says
    so before any task runs: nothing was read or written)."""
    return "No FileSystem for scheme" in str(exc) or "UnsupportedFileSystemException" in str(exc)


def _read_through_filesystem(spark: Any, url: str, option: str) -> Any:
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import from_arrow_schema

    from sparkdl.errors import ConfigError
    from sparkdl.filesystem import child_url, open_url

    try:
        url, fs, root = open_url(url, option)
    except ConfigError as exc:  # neither Spark's Hadoop nor pyarrow or fsspec opens the scheme
        raise UsageError(str(exc)) from exc
    paths = _parquet_files(fs, root)
    if not paths:
        raise UsageError(f"{option} {url!r} holds no Parquet files")
    with fs.open_input_file(paths[0]) as handle:
        schema = from_arrow_schema(pq.read_schema(handle))
    urls = [child_url(url, root, path) for path in paths]
    files = spark.createDataFrame([(u,) for u in urls], "url string").repartition(len(urls))
    return files.mapInArrow(_FileReader(schema), schema)


def _parquet_files(fs: Any, root: str) -> List[str]:
    """The data files of a dataset directory (or the file itself), as Spark lists them: names
    starting with ``_`` or ``.`` (``_SUCCESS``, ``.crc``, ``_temporary/``) are not data."""
    import pyarrow.fs as pafs

    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        return [root]
    if info.type == pafs.FileType.NotFound:
        return []
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return sorted(
        f.path
        for f in found
        if f.type == pafs.FileType.File
        and not any(part.startswith(("_", ".")) for part in f.path[len(root) :].split("/") if part)
    )


class _FileReader:
    """Executor side: the record batches of each Parquet file URL, in the DataFrame's schema."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark.sql.pandas.types import to_arrow_schema

        from sparkdl.filesystem import open_url

        target = to_arrow_schema(self.schema)
        for batch in batches:
            for url in batch.column(0).to_pylist():
                _, fs, path = open_url(url, "dataset file")
                with fs.open_input_file(path) as handle:
                    for part in pq.ParquetFile(handle).iter_batches():
                        yield pa.Table.from_batches([part]).cast(target).combine_chunks().to_batches()[0]


def _write_through_filesystem(frame: Any, url: str, overwrite: bool) -> None:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    from sparkdl.filesystem import join, open_url, write_atomically

    url, fs, root = open_url(url, "predictions")
    _clear(fs, root, url, overwrite)
    staging = f"_temporary/{uuid.uuid4().hex}"
    written = frame.mapInArrow(_PartWriter(url, staging), "name string, rows long").collect()
    for row in written:  # the parts of tasks that succeeded; a failed attempt's stay in _temporary
        fs.move(join(root, f"{staging}/{row['name']}"), join(root, row["name"]))
    if not written:  # no rows: one empty file still says what the columns are
        with fs.open_output_stream(join(root, "part-00000.parquet")) as out:
            pq.write_table(to_arrow_schema(frame.schema).empty_table(), out)
    if fs.get_file_info(join(root, "_temporary")).type != pafs.FileType.NotFound:
        fs.delete_dir(join(root, "_temporary"))
    write_atomically(fs, join(root, "_SUCCESS"), b"")


def _clear(fs: Any, root: str, url: str, overwrite: bool) -> None:
    import pyarrow.fs as pafs

    if fs.get_file_info(root).type != pafs.FileType.NotFound:
        if not overwrite:
            raise UsageError(f"{url!r} already exists: pass --overwrite to replace it")
        fs.delete_dir(root)
    fs.create_dir(root, recursive=True)


class _PartWriter:
    """Executor side: writes its task's rows as one Parquet file in the ``staging`` directory
    (under the dataset's) and yields the file's name and row count; an empty task writes none."""

    def __init__(self, url: str, staging: str) -> None:
        self.url, self.staging = url, staging

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        from sparkdl.filesystem import join, open_url

        _, fs, root = open_url(self.url, "predictions")
        directory = join(root, self.staging)
        name = f"part-{TaskContext.get().partitionId():05d}-{uuid.uuid4().hex[:12]}.parquet"
        rows = 0
        with contextlib.ExitStack() as stack:
            writer = None
            for batch in batches:
                if writer is None:
                    fs.create_dir(directory, recursive=True)
                    # Closed in this order: the writer's footer, then the stream (an object
                    # store's upload completes only when its stream closes).
                    stream = stack.enter_context(fs.open_output_stream(join(directory, name)))
                    writer = stack.enter_context(_closing_writer(stream, batch.schema))
                writer.write_batch(batch)
                rows += batch.num_rows
        if writer is not None:
            yield pa.RecordBatch.from_pydict({"name": [name], "rows": [rows]})


@contextlib.contextmanager
def _closing_writer(stream: Any, schema: Any) -> Iterator[Any]:
    import pyarrow.parquet as pq

    writer = pq.ParquetWriter(stream, schema)
    try:
        yield writer
    finally:
        writer.close()
