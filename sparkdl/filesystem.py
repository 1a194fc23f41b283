"""One way to open a URL: every path sparkdl reads or writes goes through here (and what a
connector or a checkpoint store should use too).

Datasets, connectors, checkpoints, the DataFrame cache and saved models all take a local path
or a URL. pyarrow's own filesystems (local, HDFS, S3, GCS) come first; any other scheme that an
installed fsspec implementation knows (``memory://``, ``abfs://``, ``local://``...) is wrapped
with ``pyarrow.fs.FSSpecHandler``, so callers see one pyarrow filesystem interface whatever the
URL.
"""

from __future__ import annotations

import os
import shutil
import urllib.parse
import uuid
from typing import List, Sequence, Tuple

import pyarrow as pa
import pyarrow.fs as pafs

from sparkdl.errors import ConfigError, DataError


def normalize_url(url_or_path: str, what: str = "dataset URL") -> str:
    """Plain paths become ``file://`` URLs (Petastorm needs a scheme); URLs pass unchanged.

    ``what`` names the argument in the error (``"checkpoint_dir"``, ``"model path"``...)."""
    if not isinstance(url_or_path, str) or not url_or_path:
        raise DataError(f"{what} must be a non-empty string, got {url_or_path!r}")
    if urllib.parse.urlparse(url_or_path).scheme in ("", "file") and not url_or_path.startswith("file://"):
        # Hadoop writes local URIs as file:/path (one slash): that is a path, not a relative name.
        path = url_or_path[len("file:") :] if url_or_path.startswith("file:/") else url_or_path
        return "file://" + os.path.abspath(path)
    return url_or_path


def filesystem_and_path(url: str) -> Tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path in it for ``url`` (pyarrow's own, else fsspec's)."""
    try:
        return pafs.FileSystem.from_uri(url)
    except pa.ArrowInvalid as exc:
        scheme = urllib.parse.urlparse(url).scheme
        if not scheme or "Unrecognized filesystem type" not in str(exc):
            raise
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def open_url(url_or_path: str, what: str) -> Tuple[str, pafs.FileSystem, str]:
    """(normalized URL, filesystem, path) for a user's path or URL; an error names ``what``."""
    url = normalize_url(url_or_path, what)
    try:
        fs, path = filesystem_and_path(url)
    except Exception as exc:  # noqa: BLE001 - pyarrow and fsspec raise several types for bad URLs
        raise DataError(f"cannot open a filesystem for {what} {url!r}: {exc}") from exc
    return url, fs, path


def file_paths(fs: pafs.FileSystem, urls: Sequence[str]) -> List[str]:
    """Paths in ``fs`` of file URLs that share one filesystem (one scheme and host)."""
    if isinstance(fs, pafs.PyFileSystem):
        handler_fs = fs.handler.fs
        return [handler_fs._strip_protocol(u) for u in urls]
    paths = []
    for url in urls:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme in ("", "file", "hdfs", "viewfs"):
            paths.append(urllib.parse.unquote(parsed.path))
        else:  # object stores: the bucket is part of the path
            paths.append(parsed.netloc + urllib.parse.unquote(parsed.path))
    return paths


def child_url(root_url: str, root_path: str, file_path: str) -> str:
    """The URL of a file found under the directory at ``root_url`` (whose path in its filesystem
    is ``root_path``): same scheme, host and query, so every reader resolves it the same way."""
    root = root_path.rstrip("/")
    if file_path == root_path or not file_path.startswith(root + "/"):
        return root_url if file_path == root_path else file_path
    if "?" not in root_url and "#" not in root_url:
        return root_url.rstrip("/") + file_path[len(root) :]
    parsed = urllib.parse.urlparse(root_url)  # keep a query (e.g. an endpoint) after the path
    return parsed._replace(path=parsed.path.rstrip("/") + file_path[len(root) :]).geturl()


def join(root: str, name: str) -> str:
    """``name`` inside directory path ``root``."""
    return f"{root.rstrip('/')}/{name}"


def is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as stream:
        return stream.read()


def write_atomically(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Writes ``data`` to a temporary name beside ``path`` and renames it, so a reader sees the
    old file or the whole new one, never half of it (on object stores, where a rename is a copy,
    a reader never sees a partial object either)."""
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(temporary) as out:
        out.write(data)
    fs.move(temporary, path)


def list_files(fs: pafs.FileSystem, root: str) -> List[pafs.FileInfo]:
    """The files directly inside directory ``root`` (none when it does not exist)."""
    selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
    return [info for info in fs.get_file_info(selector) if info.type == pafs.FileType.File]


def delete_tree(url: str) -> None:
    """Deletes the directory at ``url`` and everything in it."""
    fs, path = filesystem_and_path(url)
    if isinstance(fs, pafs.LocalFileSystem):
        shutil.rmtree(path, ignore_errors=True)
    else:
        fs.delete_dir(path)


def check_writable(url: str, what: str) -> None:
    """Fails at once when ``url`` (a directory, made if missing) cannot be written: a probe file
    is written there and deleted. Checked on the driver before training, so a path that is a
    file, read-only or on a missing mount is named before an epoch is spent, not at the first
    checkpoint (on every relaunch)."""
    try:
        fs, root = filesystem_and_path(url)
        probe = join(root, f".sparkdl-write-check-{uuid.uuid4().hex[:8]}")
        write_atomically(fs, probe, b"")
        fs.delete_file(probe)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise ConfigError(
            f"{what}={url!r} cannot be written: {exc}. Pick a directory every executor and the driver can write"
        ) from exc
