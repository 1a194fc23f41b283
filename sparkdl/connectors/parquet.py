"""Parquet by path: a directory, one file, a list of files, or a glob."""

from __future__ import annotations

import fnmatch
from typing import Any, List, Sequence, Union

import pyarrow.fs as pafs

from sparkdl.connectors.base import Source
from sparkdl.data.dataset import ParquetFiles
from sparkdl.errors import DataError
from sparkdl.filesystem import child_url, filesystem_and_path, normalize_url

_GLOB_CHARS = "*?["


class ParquetSource(Source):
    """Parquet files by URL or path, read in place.

    Args:
        path: a directory (every Parquet file under it, as for a plain URL), one file, a list
            of file URLs (read in that order), or a glob such as ``s3://b/data/2024-*/*.parquet``
            (matches sorted by path). Any scheme pyarrow or an installed fsspec package knows.
    """

    def __init__(self, path: Union[str, Sequence[str]]) -> None:
        if isinstance(path, str):
            self.path: Union[str, List[str]] = path
        else:
            self.path = list(path)
            if not self.path:
                raise DataError("ParquetSource got an empty list of files")

    def resolve(self, spark: Any = None, columns: Sequence[str] = ()) -> ParquetFiles:
        if isinstance(self.path, list):
            files = [normalize_url(p) for p in self.path]
            return ParquetFiles(url=files[0], files=tuple(files), description=f"{len(files)} Parquet files")
        url = normalize_url(self.path)
        if not any(c in url for c in _GLOB_CHARS):
            return ParquetFiles(url=url, description=f"Parquet at {url}")
        files = _glob(url)
        if not files:
            raise DataError(f"no files match {url!r}")
        return ParquetFiles(url=url, files=tuple(files), description=f"Parquet files matching {url}")


def _glob(url: str) -> List[str]:
    """File URLs matching a glob URL: the directory before the first wildcard is listed
    recursively and every path is matched with ``fnmatch`` (``*`` also crosses ``/``)."""
    first = min(url.index(c) for c in _GLOB_CHARS if c in url)
    base_url = url[:first].rsplit("/", 1)[0]
    fs, base_path = filesystem_and_path(base_url)
    pattern = base_path.rstrip("/") + url[len(base_url) :]
    try:
        infos = fs.get_file_info(pafs.FileSelector(base_path, recursive=True))
    except OSError as exc:
        raise DataError(f"cannot list {base_url!r} for {url!r}: {exc}") from exc
    matches = sorted(
        (i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, pattern)),
        key=lambda p: p.split("/"),
    )
    return [child_url(base_url, base_path, p) for p in matches]
