"""Materializes a Spark DataFrame to Parquet once, so every task can stream its own shard.

Same idea as Petastorm's ``make_spark_converter`` cache: an entry is reused when the DataFrame's
analyzed plan gives the same result as a cached one (``DataFrame.sameSemantics``, Spark's
``sameResult``, which classic sessions and Spark Connect both answer), so fitting the same
DataFrame again (another epoch count, another strategy) writes nothing. Entries are deleted by
:func:`clear_cache` and when the driver process exits (which also removes its directory in the
default location).

The copy is the user's training data. On a local disk (the default location, the temp dir, or a
local ``spark.sparkdl.cacheDir``) it is written inside a directory this driver creates with a
fresh random name (``sparkdl-cache-<pid>-<random>``, made by ``mkdtemp``: it cannot exist
before, so another local user cannot pre-create or own it) and checks after creating it (ours,
not a link, no group or other permission bits): the files Spark writes with the umask's modes
are unreachable for other users from the start, and are made 0600 once written. The copies are
deleted when the driver exits (also on SIGTERM, how Airflow, Kubernetes and YARN stop a driver);
those of drivers that died without cleaning up (a SIGKILL) by the next driver's first
materialization or by :func:`clear_cache`.

Data that is not a DataFrame (a Delta table version that cannot be read in place, copied by
delta-rs) is copied by :func:`keyed_copy` into the same directories, with the same lifecycle,
reused by a key that names it (its table and version) instead of by its plan.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import shutil
import signal
import stat
import tempfile
import threading
import uuid
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from sparkdl.errors import ConfigError
from sparkdl.filesystem import delete_tree, exists, normalize_url

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

logger = logging.getLogger("sparkdl.data")

#: Spark conf key naming the directory (URL) that holds materialized DataFrames. On a real cluster
#: it must be storage every executor can read (HDFS, S3, a shared mount), not the driver's disk.
CACHE_DIR_CONF = "spark.sparkdl.cacheDir"
#: Parquet row-group size for materialized data: the unit of sharding and of Petastorm's reads.
ROW_GROUP_BYTES = 32 * 1024 * 1024
#: The smallest row group of a copy must have at least this fraction of the largest one's rows
#: (:func:`_even_row_groups`).
EVEN_ROW_GROUPS = 0.8

#: Names of the private directories (``<prefix><pid>-<random>``) that hold a driver's local copies.
PRIVATE_DIR_PREFIX = "sparkdl-cache-"

_lock = threading.Lock()
_stale_checked = False
#: parent directory -> this driver's private directory in it
_private_dirs: dict = {}
#: (the prepared DataFrame, the columns stored as float32 bytes, dataset URL)
_entries: List[Tuple["DataFrame", Tuple[str, ...], str]] = []
#: key -> URL of the copies written by keyed_copy
_keyed: Dict[str, str] = {}


def materialize(
    df: "DataFrame", columns: Sequence[str], num_workers: int, cache_dir: str | None = None, packed: Sequence[str] = ()
) -> str:
    """Returns the URL of a Parquet copy of ``df[columns]``, writing it only if not cached.

    Double feature values are written as float32 (what the trainers use), halving the bytes read;
    the array columns in ``packed`` are written as float32 bytes per row
    (:mod:`sparkdl.data.tensor_bytes`), which the Arrow reader decodes several times faster.
    The copy has a multiple of ``num_workers`` files of near-equal size (a round-robin
    repartition) and row groups of near-equal rows (:func:`_even_row_groups`), so the
    row-group shards of the tasks are balanced.
    """
    prepared = stored_columns(df, columns)
    layout = tuple(sorted(packed))
    with _lock:
        entries = list(_entries)
    for cached, cached_layout, url in entries:
        if cached_layout == layout and _same_result(cached, prepared):
            logger.info("reusing materialized DataFrame at %s", url)
            return url

    root = _private_root(normalize_url(cache_dir or _session_cache_dir(df.sparkSession), "cache_dir"))
    url = _write_copy(prepared, f"{root.rstrip('/')}/df-{uuid.uuid4().hex[:12]}", num_workers, layout)
    with _lock:
        _entries.append((prepared, layout, url))
    _clean_up_on_sigterm()
    return url


def stored_columns(df: "DataFrame", columns: Sequence[str]) -> "DataFrame":
    """``df[columns]`` as a copy stores them: doubles (and arrays of doubles) as float32."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    selected = df.select(*columns)
    casts = []
    for field in selected.schema.fields:
        if isinstance(field.dataType, T.DoubleType):
            casts.append(F.col(field.name).cast("float").alias(field.name))
        elif isinstance(field.dataType, T.ArrayType) and isinstance(field.dataType.elementType, T.DoubleType):
            casts.append(F.col(field.name).cast("array<float>").alias(field.name))
        else:
            casts.append(F.col(field.name))
    return selected.select(*casts)


def stored_rows(prepared: "DataFrame", layout: Sequence[str]) -> "DataFrame":
    """The rows of :func:`stored_columns`' DataFrame as the copy's files hold them: the array
    columns of ``layout`` packed as float32 bytes (:mod:`sparkdl.data.tensor_bytes`)."""
    if not layout:
        return prepared
    from sparkdl.data.tensor_bytes import pack_dataframe

    return pack_dataframe(prepared, layout)


def _write_copy(prepared: "DataFrame", url: str, num_workers: int, layout: Sequence[str]) -> str:
    """Writes :func:`stored_columns`' DataFrame to a new directory ``url`` as :func:`materialize`
    lays a copy out (its files, row groups and ``layout``), made private on a local disk, and
    returns the copy's URL (``url``, or ``url-even`` when its row groups were rewritten). A
    failed write leaves nothing behind."""
    from sparkdl._spark import is_connect

    # A Connect client cannot see the partitioning (no RDD): one file per rank, sharded by row group.
    spark = prepared.sparkSession
    partitions = num_workers if is_connect(spark) else max(1, prepared.rdd.getNumPartitions())
    num_files = num_workers * max(1, math.ceil(min(partitions, 256) / num_workers))
    try:
        _write(stored_rows(prepared.repartition(num_files), layout), url, layout, ROW_GROUP_BYTES)
        final = _even_row_groups(spark, url, num_workers, layout)
    except BaseException:
        for written in (url, f"{url}-even"):
            if exists(written):
                _delete(written)
        raise
    make_private(final)
    logger.info("materialized DataFrame to %s (%d files)", final, num_files)
    return final


def keyed_copy(key: str, write: Callable[[str], None], cache_dir: Optional[str] = None, spark: Any = None) -> str:
    """The URL of this driver's copy of the data ``key`` names (``"delta:<table>@<version>"``),
    written by ``write(url)`` (a directory URL it creates) only the first time: a copy that
    reuses the cache's directories and lifecycle (private local directories, deleted at exit and
    by :func:`clear_cache`). ``cache_dir`` defaults to ``spark``'s ``spark.sparkdl.cacheDir``,
    then to the temp dir. A failed write leaves nothing behind."""
    with _lock:
        url = _keyed.get(key)
    if url is not None:
        logger.info("reusing the copy of %s at %s", key, url)
        return url
    root = _private_root(normalize_url(cache_dir or _session_cache_dir(spark), "cache_dir"))
    url = f"{root.rstrip('/')}/copy-{uuid.uuid4().hex[:12]}"
    try:
        write(url)
    except BaseException:
        _delete(url)
        raise
    make_private(url)
    with _lock:
        _keyed[key] = url
    _clean_up_on_sigterm()
    logger.info("copied %s to %s", key, url)
    return url


def _write(df: "DataFrame", url: str, layout: Sequence[str], block_bytes: int) -> None:
    writer = df.write.option("parquet.block.size", block_bytes)
    for column in layout:
        # Every row's bytes differ: a dictionary would only be built to be abandoned.
        writer = writer.option(f"parquet.enable.dictionary#{column}", "false")
    writer.option("compression", "snappy").parquet(url)


def _even_row_groups(spark, url: str, num_workers: int, layout: Sequence[str]) -> str:
    """The copy at ``url``, rewritten as row groups of near-equal rows where it is not.

    A file larger than ``ROW_GROUP_BYTES`` is split by Spark's writer into full row groups and a
    smaller last one (a 150,000-row file of 38 MB: 128,551 rows and 21,449). The shard unit is
    the row group, so a rank could draw both large ones and another both small ones: 6x fewer
    rows, which it then repeats 6x as often per epoch, and whose row-group reads come every few
    steps. Such a copy is read back (it is already in its final layout, so this costs a scan of
    it, not of the DataFrame's plan) and rewritten as a multiple of ``num_workers`` files of one
    row group each, at most ``ROW_GROUP_BYTES`` per group.
    """
    import pyarrow.parquet as pq

    from sparkdl.filesystem import filesystem_and_path, list_files

    fs, root = filesystem_and_path(url)
    groups: List[Tuple[int, int]] = []  # (rows, uncompressed bytes) of every row group
    split = False  # a file of several row groups: the only unevenness a rewrite removes
    for info in list_files(fs, root):
        if not info.base_name.endswith(".parquet"):
            continue
        with fs.open_input_file(info.path) as handle:
            metadata = pq.ParquetFile(handle).metadata
        split = split or metadata.num_row_groups > 1
        groups += [
            (metadata.row_group(i).num_rows, metadata.row_group(i).total_byte_size)
            for i in range(metadata.num_row_groups)
        ]
    rows = [count for count, _ in groups if count]
    # Files of one row group each are already as even as the round-robin split (a row or so
    # apart, which matters only for tiny data, where a rewrite could not do better).
    if not split or min(rows) >= EVEN_ROW_GROUPS * max(rows):
        return url
    total_rows, total_bytes = sum(rows), sum(size for _, size in groups)
    count = num_workers * max(1, math.ceil(total_bytes / (num_workers * ROW_GROUP_BYTES)))
    even = f"{url}-even"
    # Each file is one row group: the block size is above any file's bytes.
    _write(spark.read.parquet(url).repartition(min(count, total_rows)), even, layout, 2 * ROW_GROUP_BYTES)
    _delete(url)
    logger.info(
        "rewrote the materialized DataFrame as %d row groups of ~%d rows (they were %d to %d rows)",
        count,
        total_rows // count,
        min(rows),
        max(rows),
    )
    return even


def _same_result(cached: "DataFrame", candidate: "DataFrame") -> bool:
    if type(cached) is not type(candidate) or cached.sparkSession is not candidate.sparkSession:
        return False  # plans of another session (or a stopped one) cannot be compared
    try:
        return bool(cached.sameSemantics(candidate))
    except Exception:  # noqa: BLE001 - a session that went away: never reuse its entries
        return False


def cached_urls() -> List[str]:
    """URLs of the DataFrames materialized by this driver process."""
    with _lock:
        return [url for _, _, url in _entries] + list(_keyed.values())


def clear_cache() -> None:
    """Deletes every materialized DataFrame of this driver process, and the copies left behind by
    drivers of this user that are no longer running."""
    with _lock:
        urls = [url for _, _, url in _entries] + list(_keyed.values())
        _entries.clear()
        _keyed.clear()
    for url in urls:
        _delete(url)
    remove_stale_caches()


def make_private(url: str) -> None:
    """Local copies become readable by their owner only (Spark writes with the umask's modes)."""
    if not url.startswith("file://"):
        return
    root = url[len("file://") :]
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o700)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o600)


def remove_stale_caches(parent: str | None = None) -> List[str]:
    """Deletes the default-location copies (``sparkdl-cache-<pid>-<random>``, and the
    ``sparkdl-cache-<pid>`` of earlier versions) of this user's drivers that are no longer
    running; returns what was deleted."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(PRIVATE_DIR_PREFIX) :].split("-")[0]
        path = os.path.join(parent, name)
        if not name.startswith(PRIVATE_DIR_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if os.lstat(path).st_uid != os.getuid() or _running(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        logger.info("deleted %s, the materialized data of driver %s that is no longer running", path, pid)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user: alive
        return True
    return True


def _delete(url: str) -> None:
    try:
        delete_tree(url)
    except Exception as exc:  # noqa: BLE001 - cleanup at exit must not raise
        logger.warning("could not delete materialized data at %s: %s", url, exc)


def _session_cache_dir(spark: Any) -> str:
    """``spark.sparkdl.cacheDir`` of the session, else this driver's local directory (with a
    warning when the session's executors are on other hosts)."""
    if spark is None:
        return local_cache_dir()
    configured = spark.conf.get(CACHE_DIR_CONF, None)
    if configured:
        return configured
    from sparkdl._spark import Session

    master = Session(spark).master
    if not master.startswith(("local", "spark://127.", "spark://localhost")):
        logger.warning(
            "materializing the DataFrame on the driver's local disk; executors on other hosts cannot "
            "read it. Set %s to storage every executor reads (hdfs://..., s3a://...)",
            CACHE_DIR_CONF,
        )
    return local_cache_dir()


def local_cache_dir() -> str:
    """This driver's private directory for copies on its own disk (in the temp dir); the first
    call also deletes what drivers that are no longer running left behind."""
    global _stale_checked
    if not _stale_checked:
        _stale_checked = True
        remove_stale_caches()
    return private_directory(tempfile.gettempdir())


def _private_root(root: str) -> str:
    """Where this driver writes its copies under ``root``: a private directory of its own when
    ``root`` is on a local disk (other users of the host could read files in it as Spark writes
    them); remote storage (hdfs://, s3a://...) is the store's to protect."""
    if not root.startswith("file://"):
        return root
    parent = os.path.normpath(root[len("file://") :])
    with _lock:
        known, own = parent in _private_dirs, parent in _private_dirs.values()
    if own:
        return root  # already this driver's own (local_cache_dir)
    if not known:
        remove_stale_caches(parent)  # what dead drivers left in a configured directory
    return "file://" + private_directory(parent)


def private_directory(parent: str) -> str:
    """This driver's directory in ``parent``, created on first use with a random name that
    cannot exist before (``mkdtemp``: ``mkdir`` with mode 0700, which fails on anything already
    there, a link included), and checked once created: see :func:`check_private`.

    Raises:
        ConfigError: the directory cannot be created in ``parent``, or is not private.
    """
    parent = os.path.normpath(parent)
    with _lock:
        path = _private_dirs.get(parent)
        if path is None or not os.path.isdir(path):
            try:
                os.makedirs(parent, exist_ok=True)
                path = tempfile.mkdtemp(prefix=f"{PRIVATE_DIR_PREFIX}{os.getpid()}-", dir=parent)
            except OSError as exc:
                raise ConfigError(
                    f"cannot create a directory for the DataFrame's copy in {parent!r}: {exc}. "
                    f"Set {CACHE_DIR_CONF} to a directory this user can write"
                ) from exc
            _private_dirs[parent] = path
    check_private(path)
    return path


def check_private(path: str, fix: str = f"set {CACHE_DIR_CONF} to a directory only this user can write") -> None:
    """Refuses a directory for the training data's copy that another local user could read or
    replace: a link, not a directory, owned by another user, or with group/other permissions.
    ``fix`` says which setting to change instead."""
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a link or a file took its place)"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):o}: other users have access"
    if problem:
        raise ConfigError(
            f"the directory for the DataFrame's copy {path!r} {problem}; sparkdl does not write training data "
            f"there. Remove it, or {fix}"
        )


def _at_exit() -> None:
    """The driver exits: its copies go, and so do its own private directories (left empty,
    they would otherwise wait for the next driver's stale-cache sweep)."""
    clear_cache()
    with _lock:
        paths = list(_private_dirs.values())
        _private_dirs.clear()
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _clean_up_on_sigterm() -> None:
    """SIGTERM is how Airflow, Kubernetes and YARN stop a driver, and it skips ``atexit``: once
    this driver holds a copy, SIGTERM deletes it first and then ends the process with the
    signal's status, as the default action would. A handler the application installed itself
    is left alone (its own exit runs ``atexit``); so is a process where this is not the main
    thread (only it may install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # an interpreter without signals (embedded)
        pass


def _on_sigterm(signum, _frame) -> None:
    try:
        _at_exit()
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


atexit.register(_at_exit)
