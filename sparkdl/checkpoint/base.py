"""The checkpoint store plug-in point: :class:`CheckpointStore`, the interface every store
implements (and ``tests/unit/test_checkpoint_store_contract.py`` checks). Stores register by URL
scheme in :mod:`sparkdl.checkpoint`."""

from __future__ import annotations

import abc
from typing import Any, Optional, Sequence, Tuple

from sparkdl import filesystem
from sparkdl.checkpoint.format import Checkpoint, PartInfo, RankState


class CheckpointStore(abc.ABC):
    """Where a run's checkpoints and its finished result live.

    Built on the driver by :func:`open_store` and pickled to every task. Every rank writes its
    own part of a checkpoint (:meth:`save_part`, in parallel, from its own copy of the store);
    one rank, once every part is written, makes it visible (:meth:`commit`); every rank reads.
    Implementations pass ``tests/unit/test_checkpoint_store_contract.py``.
    """

    #: Write in the background (``CheckpointConfig.async_write``; :func:`open_store` sets it).
    async_write: bool = True

    def __init__(self, url: str, keep: int = 3) -> None:
        #: Where the store is, for messages.
        self.url = url
        self.keep = keep

    def location(self, step: int) -> str:
        """Where the checkpoint of ``step`` is, in the user's terms (for messages)."""
        return filesystem.join(self.url, f"ckpt-{step:012d}")

    @abc.abstractmethod
    def save_part(self, step: int, world_size: int, rank: int, part: RankState) -> PartInfo:
        """Stores ``rank``'s part of checkpoint ``step`` atomically, invisible to
        :meth:`load_latest` until :meth:`commit`; every rank stores its own part at once."""

    @abc.abstractmethod
    def commit(self, step: int, world_size: int, parts: Sequence[PartInfo]) -> str:
        """Makes the checkpoint of ``step`` visible — called once every part is stored, by any
        one rank — and keeps only the newest ``keep``; returns where it is."""

    def save(self, checkpoint: Checkpoint) -> str:
        """Every part of ``checkpoint`` from this process, then the commit."""
        step, world_size = checkpoint.step, checkpoint.world_size
        parts = [self.save_part(step, world_size, rank, part) for rank, part in enumerate(checkpoint.ranks)]
        return self.commit(step, world_size, parts)

    @abc.abstractmethod
    def load_latest(self) -> Optional[Checkpoint]:
        """The newest complete, intact checkpoint, or None; damaged ones are skipped (logged),
        and so are checkpoints whose commit never happened."""

    @abc.abstractmethod
    def save_finished(self, result: Any) -> None:
        """Stores a finished run's result (rank 0's return value, any picklable object)."""

    @abc.abstractmethod
    def load_finished(self) -> Tuple[bool, Any]:
        """(True, result) when the store holds a finished run, else (False, None)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Deletes every checkpoint (complete or not) and the finished result (a fresh start)."""
