"""A filesystem only fsspec knows (pyarrow has no ``sparkdltest://``), backed by a local folder.

It stands for the fsspec-only stores users point sparkdl at (``abfs://``, ``oci://``, ...): the
same code path (``pyarrow.fs.PyFileSystem`` over an fsspec instance), on storage every process
of a local cluster shares. The instance pickles with its root, so executors need no setup.
"""

from __future__ import annotations

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

SCHEME = "sparkdltest"


class FolderFileSystem(DirFileSystem):
    """``sparkdltest://a/b`` is ``<root>/a/b``; the root is given when registering."""

    protocol = SCHEME
    root: str = ""

    def __init__(self, path: str = "", fs=None, **kwargs) -> None:
        super().__init__(path=path or type(self).root, fs=fs or LocalFileSystem(), **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return path[len(SCHEME) + 3 :] if path.startswith(f"{SCHEME}://") else path

    @classmethod
    def _get_kwargs_from_urls(cls, path):
        return {"path": cls.root}  # stored with the instance: it pickles with its root


def register(root: str) -> None:
    FolderFileSystem.root = root
    fsspec.register_implementation(SCHEME, FolderFileSystem, clobber=True)
