"""Checkpoints: what one holds, and the store plug-in point that keeps them.

One concern per module: :mod:`.config` (:class:`CheckpointConfig`), :mod:`.format` (what a
checkpoint holds and its bytes), :mod:`.base` (the :class:`CheckpointStore` interface),
:mod:`.file_store` (:class:`FileCheckpointStore`); the registry of stores by URL scheme is here.

**Contents.** A :class:`Checkpoint` is every rank's :class:`RankState` at one step: the user's
part (model and optimizer ``state_dict``\\ s, loop counters), a share of the state identical on
every rank (stored once, split over the ranks), the strategy's state, the RNG and the data
stream's position — plain containers of tensors, so loading never runs code
(``torch.load(weights_only=True)``).

**Stores.** A :class:`CheckpointStore` stores one rank's part, commits a checkpoint once every
part is stored, loads the newest complete one, and keeps a finished run's result.
:func:`open_store` picks the store registered for the URL's scheme (:func:`register_store`),
else :class:`FileCheckpointStore` (any URL :mod:`sparkdl.filesystem` opens). Stores are built on
the driver and pickled to the tasks. How a rank writes in the background, and how the ranks
learn that every part is stored, is :mod:`sparkdl._runtime.checkpoint_writer`.

**Layout** (:class:`FileCheckpointStore`; torch DCP's): ``ckpt-<step>/`` holds one
``rank-<r>.pt`` per rank (each written by its rank, atomically, with a magic string and the
SHA-256 of its payload) and ``manifest.json`` (step, world size, each part's name, size and
checksum), written last. A part keeps its strategy state in a section of its own: loading reads
every part's head and checks every strategy section's checksum a chunk at a time, and hands out
:class:`StoredRankState`\\ s, which read their strategy state when it is taken — an elastic
resume holds one old part's at a time, a same-size resume reads its own only. Parts that hold
their strategy state inline (format 2) load whole, as before. A directory without a manifest
is incomplete and ignored; a damaged manifest or part falls back to the previous checkpoint. The
last ``keep`` are kept. Single-file checkpoints of earlier versions (``ckpt-<step>.pt``) still
load. ``finished.pkl`` holds a
finished run's result: the same job run again returns it instead of training again.
"""

from __future__ import annotations

import urllib.parse
from typing import Callable, Dict, Type

from sparkdl import filesystem
from sparkdl.checkpoint.base import CheckpointStore
from sparkdl.checkpoint.config import CheckpointConfig
from sparkdl.checkpoint.file_store import MANIFEST, FileCheckpointStore
from sparkdl.checkpoint.format import (
    Checkpoint,
    PartInfo,
    RankState,
    StoredRankState,
    decode,
    decode_part,
    encode,
    encode_part,
    part_digest,
    tree_leaves,
    tree_rebuild,
)

__all__ = [
    "MANIFEST",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointStore",
    "FileCheckpointStore",
    "PartInfo",
    "RankState",
    "StoredRankState",
    "decode",
    "decode_part",
    "encode",
    "encode_part",
    "open_store",
    "part_digest",
    "register_store",
    "tree_leaves",
    "tree_rebuild",
]


_STORES: Dict[str, Type[CheckpointStore]] = {}


def register_store(scheme: str) -> Callable[[Type[CheckpointStore]], Type[CheckpointStore]]:
    """Class decorator: ``checkpoint_dir`` URLs of ``scheme`` (``"myscheme"`` for
    ``myscheme://...``) use the decorated store."""

    def register(cls: Type[CheckpointStore]) -> Type[CheckpointStore]:
        _STORES[scheme] = cls
        return cls

    return register


def open_store(config: CheckpointConfig) -> CheckpointStore:
    """The store for ``config.url``: the one registered for its scheme, else the file store."""
    url = filesystem.normalize_url(config.url, "checkpoint_dir")
    cls = _STORES.get(urllib.parse.urlparse(url).scheme, FileCheckpointStore)
    store = cls(url, keep=config.keep)
    store.async_write = config.async_write
    return store
