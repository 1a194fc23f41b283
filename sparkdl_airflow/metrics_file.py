"""The job's ``metrics.json`` as the Airflow worker reads it: from a local path, or from a URL
(``s3://``, ``gs://``, ``hdfs://``, ``file://``...) through fsspec.

The job writes every output through sparkdl's filesystem layer, so ``output_dir`` may be object
storage (in cluster deploy mode it must be shared storage: a local folder dies with the driver's
container). The worker only needs to read one small file there: fsspec, which Airflow 3's task SDK
depends on, and the fsspec implementation of the scheme (s3fs, gcsfs, ...) on the worker. Local
paths use the standard library alone.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from typing import Any, Dict, Optional, Tuple

#: The packages that give fsspec a scheme, for the error that says what to install.
IMPLEMENTATIONS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "az": "adlfs"}


def scheme(path: str) -> str:
    """The URL scheme of ``path`` ('' for a local path)."""
    found = urllib.parse.urlparse(path).scheme
    return found if len(found) > 1 else ""  # "C:\\..." is a path, not a URL


def join(output_dir: str, name: str) -> str:
    """``name`` inside ``output_dir``: with ``/`` for a URL, as the platform joins for a path."""
    if scheme(output_dir):
        return output_dir.rstrip("/") + "/" + name
    return os.path.join(output_dir, name)


def check_readable(output_dir: str) -> None:
    """Raises ``ValueError`` naming the package to install when the worker cannot open
    ``output_dir``'s scheme; nothing for a local path."""
    protocol = scheme(output_dir)
    if not protocol:
        return
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        package = IMPLEMENTATIONS.get(protocol, f"the fsspec implementation of {protocol}://")
        raise ValueError(
            f"output_dir {output_dir!r}: the Airflow worker reads the job's metrics.json from there, but fsspec "
            f"cannot open {protocol}:// URLs on this worker ({exc}); install {package} on the worker, or give an "
            f"output_dir the worker can read"
        ) from None


def read(path: str) -> Optional[Dict[str, Any]]:
    """The JSON document at ``path``; None when there is none (or it is not whole JSON)."""
    fs, where = _filesystem(path)
    try:
        if fs is None:
            with open(where) as handle:
                return json.load(handle)
        with fs.open(where, "r") as handle:
            return json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def remove(path: str) -> None:
    """Deletes the file at ``path`` if there is one."""
    fs, where = _filesystem(path)
    if fs is None:
        if os.path.exists(where):
            os.remove(where)
    elif fs.exists(where):
        fs.rm(where)


def _filesystem(path: str) -> Tuple[Any, str]:
    """(an fsspec filesystem, the path in it) for a URL; (None, path) for a local path."""
    if not scheme(path):
        return None, path
    import fsspec

    return fsspec.core.url_to_fs(path)
