"""One way to open a URL: every path sparkdl reads or writes goes through here (and what a
connector or a checkpoint store should use too).

Datasets, connectors, checkpoints, the DataFrame cache and saved models all take a local path
or a URL. pyarrow's own filesystems (local, HDFS, S3, GCS) come first; any other scheme that an
installed fsspec implementation knows (``memory://``, ``abfs://``, ``local://``...) is wrapped
with ``pyarrow.fs.FSSpecHandler``, so callers see one pyarrow filesystem interface whatever the
URL.
"""

from __future__ import annotations

import json
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
    """A pyarrow filesystem and the path in it for ``url`` (pyarrow's own, else fsspec's).

    Raises:
        ConfigError: nothing here implements the URL's scheme (one line naming the scheme and
            what to install), or pyarrow's HDFS client finds no Hadoop client.
    """
    scheme = urllib.parse.urlparse(url).scheme
    try:
        return pafs.FileSystem.from_uri(url)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        # Unknown to pyarrow, or this pyarrow was built without it (S3, GCS...): fsspec's turn.
        if not scheme or not any(text in str(exc) for text in ("Unrecognized filesystem type", "without")):
            raise
    except OSError as exc:
        client_missing = any(word in str(exc).lower() for word in ("libjvm", "libhdfs", "classpath", "java_home"))
        if scheme in ("hdfs", "viewfs") and client_missing:  # not a namenode that is down: no client at all
            # Its first line says what failed ("Unable to load libjvm"); the rest lists every path tried.
            raise ConfigError(f"cannot open {url!r}: {_first_line(exc)}; {_HADOOP_CLIENT}") from exc
        raise
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # fsspec: no implementation installed / none known
        if "Protocol not known" not in str(exc) and not isinstance(exc, ImportError):
            raise
        raise ConfigError(no_filesystem_message(url, scheme)) from exc
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


#: What to install for a scheme that neither pyarrow nor an installed fsspec package opens.
_PACKAGES = {
    "s3": "s3fs (pip install s3fs), or a pyarrow built with S3",
    "s3a": "s3fs (pip install s3fs)",
    "gs": "gcsfs (pip install gcsfs), or a pyarrow built with GCS",
    "gcs": "gcsfs (pip install gcsfs)",
    "abfs": "adlfs (pip install adlfs)",
    "abfss": "adlfs (pip install adlfs)",
    "az": "adlfs (pip install adlfs)",
    "adl": "adlfs (pip install adlfs)",
    "oci": "ocifs (pip install ocifs)",
    "oss": "ossfs (pip install ossfs)",
    "http": "aiohttp (pip install aiohttp)",
    "https": "aiohttp (pip install aiohttp)",
}

_HADOOP_CLIENT = (
    "hdfs:// needs a Hadoop client on this machine for pyarrow's HadoopFileSystem: "
    "JAVA_HOME, HADOOP_HOME and CLASSPATH=$(hadoop classpath --glob)"
)


def no_filesystem_message(url: str, scheme: str) -> str:
    """The one line for a URL whose scheme nothing installed here opens: the scheme and what to
    install (fsspec's own registry names the package of schemes this table lacks)."""
    if scheme in ("hdfs", "viewfs"):
        return f"no filesystem for {url!r}: {_HADOOP_CLIENT}"
    package = _PACKAGES.get(scheme)
    if package is None:
        from fsspec.registry import known_implementations

        known = known_implementations.get(scheme)
        package = (known or {}).get("err") or (
            f"the fsspec implementation of {scheme}:// (neither pyarrow nor fsspec knows this scheme)"
        )
    return f"no filesystem for URL scheme {scheme!r} ({url!r}) on this machine: install {package}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def open_url(url_or_path: str, what: str) -> Tuple[str, pafs.FileSystem, str]:
    """(normalized URL, filesystem, path) for a user's path or URL; an error names ``what``."""
    url = normalize_url(url_or_path, what)
    try:
        fs, path = filesystem_and_path(url)
    except ConfigError as exc:  # no filesystem for the scheme: a setting to change, named
        raise ConfigError(f"{what}: {exc}") from exc
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
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from exc
    try:
        probe = join(root, f".sparkdl-write-check-{uuid.uuid4().hex[:8]}")
        write_atomically(fs, probe, b"")
        fs.delete_file(probe)
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise ConfigError(
            f"{what}={url!r} cannot be written: {exc}. Pick a directory every executor and the driver can write"
        ) from exc


# Outputs: what a command or a function writes (metrics.json, plots, compare.json, plan.json)
# and the inputs it reads whole (a run's metrics.json), named by a local path or a URL.


def is_url(url_or_path: str) -> bool:
    """Whether ``url_or_path`` has a scheme (``s3://b/run``, ``file:///tmp/run``); a plain path,
    relative or absolute, has none."""
    if url_or_path.startswith("file:"):  # also Hadoop's file:/path
        return True
    return bool(urllib.parse.urlparse(url_or_path).scheme) and "://" in url_or_path


def url_join(root: str, *names: str) -> str:
    """``names`` inside directory ``root``, a local path or a URL: a path stays a path as the user
    wrote it (relative stays relative: what a summary line prints), a URL keeps its scheme, host
    and query (an ``?endpoint_override=`` stays with every file under it)."""
    if not is_url(root):
        return os.path.join(root, *names)
    parsed = urllib.parse.urlparse(root)
    return parsed._replace(path="/".join([parsed.path.rstrip("/"), *names])).geturl()


def basename(url_or_path: str) -> str:
    """The last name of a path or URL (``run`` of ``s3://b/runs/run?x=1``)."""
    path = urllib.parse.urlparse(url_or_path).path if is_url(url_or_path) else url_or_path
    return os.path.basename(path.rstrip("/"))


def parent(url_or_path: str) -> str:
    """The directory holding a path or URL's last name (the URL keeps its scheme, host and query)."""
    if not is_url(url_or_path):
        return os.path.dirname(url_or_path.rstrip("/"))
    parsed = urllib.parse.urlparse(url_or_path)
    return parsed._replace(path=parsed.path.rstrip("/").rsplit("/", 1)[0]).geturl()


def is_process_local(url_or_path: str) -> bool:
    """Whether the URL's store lives in this process's memory (fsspec's ``memory://``): the
    driver sees it, executors (other processes) never do."""
    return urllib.parse.urlparse(url_or_path).scheme == "memory"


def check_output(url_or_path: str, what: str) -> str:
    """Checks at the start of a command or function that an output directory can be written:
    its scheme has a filesystem here (else a one-line ConfigError naming the package to install)
    and a probe file can be written (else a ConfigError naming ``what``). Returns its URL."""
    url = normalize_url(url_or_path, what)
    check_writable(url, what)
    return url


def check_input(url_or_path: str, what: str) -> str:
    """Checks that an input's scheme has a filesystem here (a ConfigError naming ``what``, the
    scheme and the package to install, before anything starts); returns its URL."""
    return open_url(url_or_path, what)[0]


def write_file(url_or_path: str, data: bytes) -> None:
    """Writes ``data`` at a path or URL whole (atomically, see :func:`write_atomically`),
    making its directory."""
    _, fs, path = open_url(url_or_path, "output")
    write_atomically(fs, path, data)


def write_json(url_or_path: str, document: object) -> None:
    """``document`` as indented JSON at a path or URL (values JSON lacks as their ``str``)."""
    write_file(url_or_path, json.dumps(document, indent=2, default=str).encode())


def read_file(url_or_path: str, what: str) -> bytes:
    """The bytes of the file at a path or URL."""
    _, fs, path = open_url(url_or_path, what)
    return read_bytes(fs, path)


def exists(url_or_path: str) -> bool:
    """Whether a file or directory is at a path or URL."""
    _, fs, path = open_url(url_or_path, "path")
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def remove_file(url_or_path: str) -> None:
    """Deletes the file at a path or URL when there is one."""
    _, fs, path = open_url(url_or_path, "path")
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)
