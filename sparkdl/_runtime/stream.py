"""A rank's position in its data stream: what ``ctx.epoch_batches``, ``ctx.shard_dataset()`` and
checkpoints share.

The stream is endless and seeded (:mod:`sparkdl.data.batching`): a position is the number of
batches taken from it, plus where the current epoch began, plus — in an epoch resumed on a new
number of ranks — this rank's share of the rows that epoch had left (:mod:`sparkdl.data.reshard`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import numpy as np
import torch

from sparkdl.data.batching import STREAM_ORDER
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.reshard import Remainder, StreamState


@dataclasses.dataclass
class StreamPosition:
    """Where a rank is in its stream; checkpoints record it and resumes restore it.

    Attributes:
        batches_taken: batches taken from the stream so far (the reader position).
        epoch_start: the stream's batch index where the current epoch began.
        remainder: the rest of an epoch resumed on another number of ranks, or None.
        end_epoch_early: the rest of the current epoch is to be skipped (resumed mid-epoch on
            other data: :mod:`sparkdl._runtime.resume`).
    """

    batches_taken: int = 0
    epoch_start: int = 0
    remainder: Optional[Remainder] = None
    end_epoch_early: bool = False

    # The two methods a ShardDataset moves its position with (sparkdl._runtime.shard_dataset).
    def get(self) -> int:
        return self.batches_taken

    def set(self, taken: int) -> None:
        self.batches_taken = taken

    def begin_epoch(self, skip: int) -> None:
        """An epoch starts, ``skip`` of its steps already done (a mid-epoch resume)."""
        self.epoch_start = self.batches_taken - skip

    def take(self) -> None:
        self.batches_taken += 1

    def start_epoch_at(self, start: int, remainder: Optional[Remainder] = None) -> None:
        """The next epoch begins at batch ``start``; ``remainder``: a resharded epoch before it."""
        self.batches_taken = self.epoch_start = start
        self.remainder = remainder

    def skips_epoch(self) -> bool:
        """Whether the epoch about to be read is to end at once (and it then will not again)."""
        skip, self.end_epoch_early = self.end_epoch_early, False
        return skip

    def restore(self, state: StreamState) -> None:
        """A same-size resume: the stream's epoch start, and a resharded epoch still in progress."""
        taken = state.batches_taken
        self.batches_taken = taken
        self.epoch_start = state.epoch_start if state.epoch_start is not None else taken - taken % state.steps_per_epoch
        self.remainder = None
        if state.remaining is not None and state.remaining_taken < state.remaining_steps:
            self.remainder = Remainder(state.remaining, state.remaining_steps, state.remaining_taken, taken)

    def checkpoint_fields(self, dataset: Optional[DatasetInfo], steps_per_epoch: Optional[int]) -> Dict[str, Any]:
        """What a checkpoint's ``stream`` holds: ``epoch_start``, ``steps_per_epoch``, which data
        and stream order the positions index, and in an epoch resumed on a new number of ranks
        this rank's share of it (``remaining``: positions, int64, in reading order) split into
        ``remaining_steps`` batches of which ``remaining_taken`` were taken."""
        stream: Dict[str, Any] = {"epoch_start": self.epoch_start, "steps_per_epoch": steps_per_epoch}
        if dataset is not None:
            stream["data"] = dataset.fingerprint  # which rows the positions index
            stream["order"] = STREAM_ORDER  # and in which order they were taken
        remainder = self.remainder
        if remainder is not None:
            stream.update(
                remaining=torch.from_numpy(remainder.share.copy()),
                remaining_steps=remainder.steps,
                remaining_taken=remainder.taken,
            )
        return stream


def stream_state(batches_taken: int, stream: Optional[Dict[str, Any]], default_steps: Optional[int]) -> StreamState:
    """A checkpoint part's stream fields (:meth:`StreamPosition.checkpoint_fields`) read back."""
    stream = stream or {}
    remaining = stream.get("remaining")
    return StreamState(
        int(batches_taken),
        None if stream.get("epoch_start") is None else int(stream["epoch_start"]),
        int(stream.get("steps_per_epoch") or default_steps or 1),
        remaining.numpy().astype(np.int64) if remaining is not None else None,
        int(stream.get("remaining_steps", 0)),
        int(stream.get("remaining_taken", 0)),
    )
