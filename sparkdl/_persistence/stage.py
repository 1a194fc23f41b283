"""A sparkdl stage as Spark ML saves and loads it.

Inside a ``Pipeline``, ``PipelineModel`` or ``CrossValidator(Model)``, Spark ML saves a Python
stage with ``stage.write().save(dir)`` (or ``stage.save(dir)``), and loads it with
``DefaultParamsReader.loadParamsInstance(dir)``: that reads ``dir/metadata`` through Spark (one
line of JSON: the class, the uid, the params), imports the class it names and calls
``cls.load(dir)``. A sparkdl stage writes that line itself, beside its own files, through
:mod:`sparkdl.filesystem`: saving needs no Spark job and no SparkContext, and the same directory
is what ``TorchModel.load(dir)`` reads. Both PySpark 3.5 (``sc.textFile``) and 4.x
(``spark.read.text``) read the line from ``metadata/part-00000``.

Where a path without a scheme goes: Spark ML writes a Pipeline's own metadata against Hadoop's
``fs.defaultFS`` (HDFS on YARN, EMR and Dataproc), so a stage written by Spark ML's writers goes
there too (:func:`spark_resolved`), not to the driver's local disk, where the rest of the
Pipeline would not find it.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from typing import Any, Callable, Dict, Optional

import pyarrow.fs as pafs
from pyspark.ml.util import MLReader, MLWriter

from sparkdl import filesystem
from sparkdl.errors import ConfigError, DataError

#: The file Spark ML's readers take the stage's class, uid and params from.
METADATA_FILE = "metadata/part-00000"


def stage_metadata(instance: Any) -> str:
    """The one line of JSON Spark ML's ``DefaultParamsReader`` parses: what PySpark's own
    ``DefaultParamsWriter`` writes, without asking a SparkContext for the version."""
    import pyspark

    document = {
        "class": f"{type(instance).__module__}.{type(instance).__name__}",
        "timestamp": int(round(time.time() * 1000)),
        "sparkVersion": pyspark.__version__,
        "uid": instance.uid,
        "paramMap": {param.name: value for param, value in instance._paramMap.items()},
        "defaultParamMap": {param.name: value for param, value in instance._defaultParamMap.items()},
    }
    return json.dumps(document, separators=(",", ":"))


def write_stage_metadata(fs: pafs.FileSystem, root: str, instance: Any) -> None:
    filesystem.write_atomically(fs, filesystem.join(root, METADATA_FILE), stage_metadata(instance).encode())


def read_stage_metadata(fs: pafs.FileSystem, root: str) -> Optional[Dict[str, Any]]:
    """The stage line saved in directory ``root``; None where there is none (models saved by
    sparkdl before it wrote one: they load, with a new uid)."""
    path = filesystem.join(root, METADATA_FILE)
    if not filesystem.is_file(fs, path):
        return None
    return json.loads(filesystem.read_bytes(fs, path).decode().splitlines()[0])


def restore_params(instance: Any, metadata: Optional[Dict[str, Any]]) -> Any:
    """The saved uid (a ``CrossValidatorModel`` finds its param grid's owner by it) and the
    params set on the saved instance; a param this version no longer has is skipped."""
    if metadata is None:
        return instance
    instance._resetUid(metadata["uid"])
    for name, value in metadata.get("paramMap", {}).items():
        if instance.hasParam(name):
            instance._set(**{name: value})
    return instance


def choose_url(path: str, qualified: Optional[str]) -> str:
    """``path`` as given when Hadoop qualifies it to the local filesystem (or there is no Spark
    to ask), else the qualified URL (``hdfs://namenode:8020/models/x``)."""
    if qualified is None or urllib.parse.urlparse(qualified).scheme in ("", "file"):
        return path
    return qualified


def spark_resolved(path: str) -> str:
    """Where Spark ML puts ``path``: unchanged when it has a scheme, else qualified against
    ``fs.defaultFS`` when a classic SparkContext runs in this process (a Spark Connect client
    has none: its paths stay as given, see docs/training.md)."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"a Spark ML path must be a non-empty string, got {path!r}")
    if urllib.parse.urlparse(path).scheme:
        return path
    return choose_url(path, _hadoop_qualified(path))


def readable_path(path: str, marker: str) -> str:
    """Where to read a stage saved at ``path``: the path as given when ``marker`` is there
    (what ``TorchModel.save(path)`` wrote on this machine), else where Spark ML put it."""
    if urllib.parse.urlparse(path).scheme or os.path.exists(os.path.join(path, marker)):
        return path
    return spark_resolved(path)


def _hadoop_qualified(path: str) -> Optional[str]:
    try:
        from pyspark import SparkContext
    except ImportError:  # a Spark Connect-only client install
        return None
    sc = SparkContext._active_spark_context
    if sc is None:
        return None
    hadoop_path = sc._jvm.org.apache.hadoop.fs.Path(path)
    hadoop_fs = hadoop_path.getFileSystem(sc._jsc.hadoopConfiguration())
    return str(hadoop_fs.makeQualified(hadoop_path).toUri())


def _exists(url: str) -> bool:
    _, fs, root = filesystem.open_url(url, "Spark ML path")
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        return True
    selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
    return info.type == pafs.FileType.Directory and bool(fs.get_file_info(selector))


class StageWriter(MLWriter):
    """What ``write()`` of a sparkdl stage returns: Spark ML's writer contract (``overwrite()``,
    ``session()``, ``save(path)``) over ``write_files(url)``, which writes the stage's files and
    its metadata line through :mod:`sparkdl.filesystem`.

    ``save`` refuses a path that holds something unless ``overwrite()`` was called (as Spark ML's
    writers do); with it, what the path holds is deleted first.
    """

    def __init__(self, instance: Any, write_files: Callable[[str], None]) -> None:
        super().__init__()
        self.instance = instance
        self._write_files = write_files

    def save(self, path: str) -> None:
        url = spark_resolved(path)
        try:
            exists = _exists(url)
        except (ConfigError, DataError) as exc:  # no filesystem for the scheme, or none that opens
            if url == path:
                raise
            raise ConfigError(
                f"{path!r} resolves, as Spark ML resolves paths against fs.defaultFS, to {url!r}, which Python "
                f"cannot open ({exc}); save to a URL that Spark and Python both open (s3://..., gs://..., "
                f"abfss://..., file:///a/shared/mount)"
            ) from exc
        if exists:
            if not self.shouldOverwrite:
                raise FileExistsError(
                    f"{url!r} already exists: use write().overwrite().save({path!r}) to replace it, or another path"
                )
            filesystem.delete_tree(filesystem.normalize_url(url, "Spark ML path"))
        self._write_files(url)

    def saveImpl(self, path: str) -> None:
        self._write_files(spark_resolved(path))


class StageReader(MLReader):
    """What ``read()`` of a sparkdl stage returns: ``load(path)`` is the class's own ``load``."""

    def __init__(self, load: Callable[[str], Any]) -> None:
        super().__init__()
        self._load = load

    def load(self, path: str) -> Any:
        return self._load(path)
