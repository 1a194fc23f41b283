"""Where a fit's training DataFrame is kept when the run has a ``checkpoint_dir``: a copy of the
driver's cached copy beside the checkpoints (:mod:`sparkdl.data.kept_copy`), so a new driver
resuming them trains on the same rows, removed when the run completes. Without a
``checkpoint_dir``, or where the tasks could not read a copy beside the checkpoints, the
driver's own cache (:mod:`sparkdl.data.cache`) alone holds it."""

from __future__ import annotations

import logging
import urllib.parse
from typing import TYPE_CHECKING, Optional, Sequence

from sparkdl import filesystem
from sparkdl.checkpoint import CheckpointConfig, FileCheckpointStore, open_store
from sparkdl.data import kept_copy

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

logger = logging.getLogger("sparkdl.data")


def copy_root(checkpoint: Optional[CheckpointConfig]) -> Optional[str]:
    """The ``checkpoint_dir`` URL the DataFrame's copy is kept in, or None: no checkpoints, a
    store registered for its own scheme (it keeps its checkpoints where sparkdl does not write
    files), storage in this driver's memory (``memory://``, which executors never see), or a
    filesystem the tasks cannot open by its scheme (:func:`_executors_open`). A directory that
    cannot be written fails here, as the launch would, before the DataFrame is written.

    Raises:
        ConfigError: ``checkpoint_dir`` cannot be written.
    """
    url = _file_checkpoints(checkpoint)
    if url is None:
        return None
    filesystem.check_writable(url, "checkpoint_dir")
    if not _executors_open(url):
        logger.warning(
            "checkpoint_dir=%r is on a filesystem registered in this driver only (fsspec.register_implementation): "
            "the tasks could not read the DataFrame's copy there, so it stays in this driver's cache and a new "
            "driver resuming these checkpoints resumes at the next epoch. Install the filesystem's package on the "
            "executors (an fsspec entry point) for exact resumes",
            url,
        )
        return None
    return url


def _file_checkpoints(checkpoint: Optional[CheckpointConfig]) -> Optional[str]:
    """The URL of the run's checkpoints when they are files executors see, else None."""
    if checkpoint is None:
        return None
    store = open_store(checkpoint)
    if type(store) is not FileCheckpointStore or filesystem.is_process_local(store.url):
        return None
    return store.url


def _executors_open(url: str) -> bool:
    """Whether the tasks can open files under ``url`` by its scheme, as the data readers do:
    pyarrow's own filesystems, and fsspec's known implementations. A scheme registered at run
    time in this driver only (``fsspec.register_implementation``) is not: the checkpoint store
    ships its filesystem to the tasks, the readers open dataset URLs themselves."""
    import pyarrow.fs as pafs
    from fsspec.registry import known_implementations

    fs, _ = filesystem.filesystem_and_path(url)
    return not isinstance(fs, pafs.PyFileSystem) or urllib.parse.urlparse(url).scheme in known_implementations


def copy_for_run(
    df: "DataFrame",
    columns: Sequence[str],
    num_workers: int,
    checkpoint: Optional[CheckpointConfig],
    packed: Sequence[str] = (),
    cache_dir: Optional[str] = None,
) -> Optional[str]:
    """The URL of ``df[columns]``'s copy beside the run's checkpoints (reused when it holds the
    same rows, else copied from this driver's cache in ``cache_dir``: see
    :func:`sparkdl.data.kept_copy.kept_copy`), or None when the run keeps none there
    (:func:`copy_root`)."""
    root = copy_root(checkpoint)
    if root is None:
        return None
    return kept_copy.kept_copy(
        df, columns, num_workers, root, fresh=not checkpoint.resume, packed=packed, cache_dir=cache_dir
    )


def remove_after_run(checkpoint: Optional[CheckpointConfig]) -> None:
    """The run completed (its result is stored with the checkpoints): its DataFrame's copy goes.
    A failure to delete it is logged, never raised over a trained model."""
    url = _file_checkpoints(checkpoint)
    if url is None:
        return
    try:
        kept_copy.remove_copy(url)
    except Exception as exc:  # noqa: BLE001 - the run's result matters more than the clean-up
        logger.warning(
            "could not delete the DataFrame's copy beside the checkpoints in %s: %s; delete %s yourself",
            url,
            exc,
            filesystem.url_join(url, kept_copy.DIRECTORY),
        )
