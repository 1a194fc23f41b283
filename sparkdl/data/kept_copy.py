"""A DataFrame's copy kept beside a run's checkpoints, so that a new driver resumes on the same rows.

A checkpoint's stream positions index the rows of the copy the run trained on. The copy of the
DataFrame cache (:mod:`sparkdl.data.cache`) is private to one driver process and deleted when
it exits; a new driver would materialize the DataFrame again, and Spark does not promise the
same rows in the same order twice, so the positions could not be replayed. A fit with a
``checkpoint_dir`` therefore copies the cached copy, file by file, into
``<checkpoint_dir>/dataframe-copy/`` and trains on that, next to a record (``record.json``)
that names it and says what it holds: the columns, how array columns are stored, their types,
the row count and a fingerprint of the rows' contents (:func:`content_fingerprint`). A driver
that fits a DataFrame with the same ``checkpoint_dir`` reuses the copy when its DataFrame holds
the same rows (in any order, with any plan); otherwise it says why, writes a new copy, and the
resume goes on at the next epoch (:mod:`sparkdl._runtime.resume`).

The copy is not this driver's to delete at exit: it outlives the driver (a crash, SIGTERM,
SIGKILL) and is removed when the run completes (:func:`remove_copy`) or starts from scratch
(``resume=False``). On a local disk the directory is made 0700 (refused when another user owns
it or could read it) and the files 0600, as the cache's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import uuid
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

import pyarrow.fs as pafs

from sparkdl import filesystem
from sparkdl.data.cache import check_private, make_private, materialize, stored_columns, stored_rows

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

logger = logging.getLogger("sparkdl.data")

#: The directory under ``checkpoint_dir`` that holds the copy and its record.
DIRECTORY = "dataframe-copy"
RECORD = "record.json"
#: The record's format; a record of another format is not reused.
FORMAT = 1
#: The names of the copies :func:`kept_copy` writes (``-even``: rewritten as even row groups).
_COPY_NAME = re.compile(r"^df-[0-9a-f]{12}(-even)?$")


@dataclasses.dataclass(frozen=True)
class CopyRecord:
    """What the copy beside the checkpoints holds.

    Attributes:
        copy: the copy's directory name in :data:`DIRECTORY`.
        columns: the DataFrame's columns it stores, in order.
        layout: the array columns stored as float32 bytes (:mod:`sparkdl.data.tensor_bytes`).
        schema: every stored column's name and Spark type (after the float32 casts).
        rows: how many rows it holds.
        content: :func:`content_fingerprint` of its rows.
    """

    copy: str
    columns: Tuple[str, ...]
    layout: Tuple[str, ...]
    schema: Tuple[Tuple[str, str], ...]
    rows: int
    content: str

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Optional["CopyRecord"]:
        """The record in ``data``, or None for one of another format or a damaged one."""
        try:
            fields = json.loads(data)
            if fields.pop("format") != FORMAT or not _COPY_NAME.match(str(fields["copy"])):
                return None
            return cls(
                copy=str(fields["copy"]),
                columns=tuple(fields["columns"]),
                layout=tuple(fields["layout"]),
                schema=tuple((str(name), str(kind)) for name, kind in fields["schema"]),
                rows=int(fields["rows"]),
                content=str(fields["content"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def differs(
        self, columns: Sequence[str], layout: Sequence[str], schema: Sequence[Tuple[str, str]]
    ) -> Optional[str]:
        """Why a copy of ``columns`` stored as ``layout`` and ``schema`` is not this one, or None."""
        if tuple(columns) != self.columns:
            return f"the run reads the columns {list(columns)}, the copy holds {list(self.columns)}"
        if tuple(schema) != self.schema:
            changed = [f"{n} {k}" for n, k in schema if (n, k) not in self.schema]
            return f"the columns' types differ ({', '.join(changed)}; the copy has {_types(self.schema)})"
        if tuple(layout) != self.layout:
            return (
                f"the reader stores array columns {list(layout)} as float32 bytes, the copy {list(self.layout)} "
                f"(another reader=)"
            )
        return None

    def holds(self, rows: int, content: str) -> Optional[str]:
        """Why rows of count ``rows`` and fingerprint ``content`` are not the copy's, or None."""
        if rows != self.rows:
            return f"it has {rows} rows, the copy {self.rows}"
        if content != self.content:
            return f"it has {rows} rows like the copy, but not the same values"
        return None


def _types(schema: Sequence[Tuple[str, str]]) -> str:
    return ", ".join(f"{name} {kind}" for name, kind in schema)


def schema_of(df: "DataFrame") -> Tuple[Tuple[str, str], ...]:
    """Each column's name and Spark type, as a record stores them."""
    return tuple((field.name, field.dataType.simpleString()) for field in df.schema.fields)


def content_fingerprint(rows: "DataFrame") -> Tuple[int, str]:
    """The row count and a fingerprint of ``rows``' values that does not depend on their order
    or on the plan that makes them: the sums of every row's 64-bit xxHash and 32-bit Murmur3
    hash of all columns (exact, as decimals). One Spark job that scans the rows."""
    from pyspark.sql import functions as F

    columns = [F.col("`" + name.replace("`", "``") + "`") for name in rows.columns]
    hashes = rows.select(F.xxhash64(*columns).alias("x"), F.hash(*columns).alias("m"))
    total = hashes.agg(
        F.count(F.lit(1)).alias("n"),
        F.sum(F.col("x").cast("decimal(38,0)")).alias("x"),
        F.sum(F.col("m").cast("decimal(38,0)")).alias("m"),
    ).first()
    return int(total["n"]), f"{total['x']}:{total['m']}"


def kept_copy(
    df: "DataFrame",
    columns: Sequence[str],
    num_workers: int,
    checkpoint_url: str,
    fresh: bool,
    packed: Sequence[str] = (),
    cache_dir: Optional[str] = None,
) -> str:
    """The URL of the copy of ``df[columns]`` beside the checkpoints in ``checkpoint_url``: the
    one there when its record says it holds the same rows (unless ``fresh``: a run from
    scratch), else a new one, recorded once complete.

    A new one is this driver's cached copy (:func:`sparkdl.data.cache.materialize`, written
    only if this driver has none of the DataFrame yet), copied file by file: so every fit of
    the DataFrame in this driver trains on the same rows in the same order, with checkpoints or
    without, as the cache promises."""
    directory = filesystem.url_join(checkpoint_url, DIRECTORY)
    fs, root = filesystem.filesystem_and_path(directory)
    prepared = stored_columns(df, columns)
    layout = tuple(sorted(packed))
    if not fresh:
        record = _reusable(fs, root, directory, prepared, layout)
        if record is not None:
            _sweep(fs, root, keep=record.copy)
            url = filesystem.url_join(directory, record.copy)
            logger.info("reusing the DataFrame's copy kept beside the checkpoints at %s (%d rows)", url, record.rows)
            return url
    cached = materialize(df, columns, num_workers, cache_dir, packed=layout)
    _make_directory(fs, root, directory)
    _sweep(fs, root, keep=None)
    url = filesystem.url_join(directory, f"df-{uuid.uuid4().hex[:12]}")
    _copy_files(cached, url)
    # Of the cached copy (the same bytes): Spark reads the driver's cache, not checkpoint_dir.
    rows, content = content_fingerprint(prepared.sparkSession.read.parquet(cached))
    record = CopyRecord(filesystem.basename(url), tuple(prepared.columns), layout, schema_of(prepared), rows, content)
    filesystem.write_atomically(fs, filesystem.join(root, RECORD), record.to_json())
    make_private(directory)
    logger.info("the DataFrame's copy is kept beside the checkpoints at %s until the run completes", url)
    return url


def _copy_files(source: str, target: str) -> None:
    """The copy at ``source``, byte for byte at ``target`` (its file names and row groups, which
    a checkpoint's positions index): hard links on one local disk, else pyarrow's copy (within
    one object store, a copy the store makes itself). A failed copy leaves nothing behind."""
    if source.startswith("file://") and target.startswith("file://"):
        try:
            shutil.copytree(source[len("file://") :], target[len("file://") :], copy_function=os.link)
            return
        except OSError:  # another device, or links not allowed: copy the bytes
            shutil.rmtree(target[len("file://") :], ignore_errors=True)
    source_fs, source_path = filesystem.filesystem_and_path(source)
    target_fs, target_path = filesystem.filesystem_and_path(target)
    try:
        target_fs.create_dir(target_path, recursive=True)  # not every fsspec store makes it as files arrive
        pafs.copy_files(source_path, target_path, source_filesystem=source_fs, destination_filesystem=target_fs)
    except BaseException:
        if target_fs.get_file_info(target_path).type != pafs.FileType.NotFound:
            target_fs.delete_dir(target_path)
        raise


def _reusable(
    fs: pafs.FileSystem, root: str, directory: str, prepared: "DataFrame", layout: Tuple[str, ...]
) -> Optional[CopyRecord]:
    """The record of the copy in ``root`` when it holds ``prepared``'s rows stored as ``layout``;
    None when there is none, or (saying why) when it holds other data."""
    path = filesystem.join(root, RECORD)
    if not filesystem.is_file(fs, path):
        return None
    record = CopyRecord.from_json(filesystem.read_bytes(fs, path))
    why = "its record is damaged or of another sparkdl version" if record is None else None
    if why is None:
        why = record.differs(prepared.columns, layout, schema_of(prepared))
    if why is None and fs.get_file_info(filesystem.join(root, record.copy)).type != pafs.FileType.Directory:
        why = "the copy it names is gone"
    if why is None:
        why = record.holds(*content_fingerprint(stored_rows(prepared, layout)))
    if why is None:
        return record
    logger.warning(
        "the DataFrame is not the one whose copy is kept beside the checkpoints in %s: %s. It is materialized again; "
        "a resume from those checkpoints goes on at the start of the epoch after the interrupted one",
        directory,
        why,
    )
    return None


def _make_directory(fs: pafs.FileSystem, root: str, directory: str) -> None:
    """The copy's directory: on a local disk made 0700 (a new one) and checked to be private."""
    if not directory.startswith("file://"):
        fs.create_dir(root, recursive=True)
        return
    os.makedirs(os.path.dirname(root), exist_ok=True)
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    check_private(root, fix=f"use a checkpoint_dir whose {DIRECTORY} directory only this user can read")


def _sweep(fs: pafs.FileSystem, root: str, keep: Optional[str]) -> None:
    """Deletes what the directory holds besides the record and the copy ``keep``: earlier
    copies, and what a driver killed while writing one left."""
    selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
    for info in fs.get_file_info(selector):
        if info.base_name in (RECORD, keep):
            continue
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(info.path)
        else:
            fs.delete_file(info.path)


def remove_copy(checkpoint_url: str) -> bool:
    """Deletes the copy beside the checkpoints in ``checkpoint_url`` and its record (the run
    completed); whether there was one."""
    directory = filesystem.url_join(checkpoint_url, DIRECTORY)
    fs, root = filesystem.filesystem_and_path(directory)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        return False
    fs.delete_dir(root)
    logger.info("deleted the DataFrame's copy kept beside the checkpoints at %s: the run completed", directory)
    return True
