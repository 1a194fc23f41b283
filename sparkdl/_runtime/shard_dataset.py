"""``sparkdl.shard_dataset()``: this rank's shard as a torch ``IterableDataset``.

For code that iterates a DataLoader-style object instead of ``ctx.epoch_batches()``: a launched
script, a foreign framework (Lightning, Accelerate), or a ``sparkdl.run`` function. It is built
on the same endless stream (:func:`sparkdl.data.batching.batches`, converted to tensors as
:mod:`sparkdl._runtime.host_batches` says: ahead of use on a prefetch thread where the task has a GPU,
when taken on the CPU), so it keeps the same guarantees: ``steps_per_epoch`` batches per
``iter()`` on every rank (balanced steps), the remainder rows open the next epoch, and the
position (batches taken) is checkpointable — resuming replays the seeded stream to it, cut but
not decoded, exactly as ``ctx.load_checkpoint`` does for ``ctx.epoch_batches``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from sparkdl._runtime.rank import Rank
from sparkdl._runtime.stream import StreamPosition
from sparkdl.reporting import get_current_task, notify_progress

__all__ = ["ShardDataset", "shard_dataset"]

#: A launched child's data payload: a 0600 file in the task's private directory (set by the runner).
SHARD_DATA = "SPARKDL_SHARD_DATA"
#: Set in every child of ``sparkdl.launch``.
LAUNCHED = "SPARKDL_LAUNCHED"
#: A child reports stream progress to its task at most this often (the watchdog needs little).
_CHILD_PROGRESS_EVERY_S = 0.25

_OUTSIDE = (
    "sparkdl.shard_dataset() works only inside a sparkdl task: a function run by sparkdl.run or "
    "sparkdl.launch, or a script started by sparkdl.launch / `sparkdl launch`"
)


class ShardDataset(IterableDataset):
    """This rank's shard of the run's ``data=``, one epoch per ``iter()``.

    Each item is a batch ``(inputs, labels)`` of CPU tensors, already collated: ``inputs`` is a
    tensor with ``feature_cols=`` or a dict of named tensors with ``inputs=``; ``labels`` is
    None for unlabeled data. Use it directly, or as ``DataLoader(ds, batch_size=None)``
    (``num_workers=0``: the stream reads ahead on its own thread, and iterating it in a
    DataLoader worker process raises).

    ``iter(ds)`` yields the batches from the current position to the end of the current epoch:
    ``steps_per_epoch`` of them from an epoch's start, the same count on every rank. An epoch
    abandoned midway (``break``) goes on where it stopped at the next ``iter()``.

    Attributes:
        steps_per_epoch: batches per epoch, identical on every rank (also ``len(ds)``).
        rank: this rank. world_size: the number of ranks.
    """

    def __init__(
        self,
        reader: Any,
        dataset: Any,
        spec: Any,
        rank: int,
        world_size: int,
        steps_per_epoch: int,
        position: Optional[StreamPosition] = None,
    ) -> None:
        super().__init__()
        self._reader, self._dataset, self._spec = reader, dataset, spec
        self.rank, self.world_size, self.steps_per_epoch = rank, world_size, int(steps_per_epoch)
        self._position = position if position is not None else StreamPosition()
        self._stream: Any = None
        self._stream_at = -1  # the position the open stream's next batch is at
        self._last_notice = 0.0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Tuple[Any, Optional[torch.Tensor]]]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "sparkdl.ShardDataset was iterated in a DataLoader worker process: it streams this rank's shard "
                "from one reader that already reads ahead on a thread of its own; use "
                "DataLoader(dataset, batch_size=None, num_workers=0)"
            )
        return self._epoch()

    def _epoch(self) -> Iterator[Tuple[Any, Optional[torch.Tensor]]]:
        first = self._position.get() % self.steps_per_epoch
        for step in range(first, self.steps_per_epoch):
            self._notice(f"loading data (step {step + 1})")
            batch = self._open().next()
            self._stream_at += 1
            self._position.set(self._position.get() + 1)
            self._notice(f"training step {step + 1}")
            yield batch

    def _open(self) -> Any:
        """The stream, positioned at ``self._position`` (rebuilt after ``load_state_dict`` or a
        restored checkpoint moved the position)."""
        position = self._position.get()
        if self._stream is None or self._stream_at != position:
            from sparkdl._runtime.host_batches import host_batches
            from sparkdl.data.batching import batches

            self.close()
            source = batches(
                self._reader,
                self._dataset,
                self._spec,
                self.rank,
                self.world_size,
                skip=position,
                epoch_steps=self.steps_per_epoch,
            )
            # Unpinned: the framework moves batches to its device itself.
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self._stream, self._stream_at = host_batches(source, device, pin=False), position
        return self._stream

    def _notice(self, phase: str) -> None:
        if get_current_task() is None:  # a launched child: a pipe write, so not every batch
            now = time.monotonic()
            if now - self._last_notice < _CHILD_PROGRESS_EVERY_S:
                return
            self._last_notice = now
        notify_progress(phase)

    def state_dict(self) -> Dict[str, int]:
        """The stream position: batches taken so far (the same on every rank at the same step,
        so rank 0's copy in a framework's checkpoint resumes every rank)."""
        taken = self._position.get()
        return {"batches_taken": taken, "epoch": taken // self.steps_per_epoch, "steps_per_epoch": self.steps_per_epoch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes at ``state``'s position: the next batch is the one that followed it.

        Raises:
            ValueError: ``state`` holds no ``batches_taken`` count.
        """
        try:
            taken = int(state["batches_taken"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"ShardDataset.load_state_dict: {state!r} is not a ShardDataset.state_dict()") from None
        if taken < 0:
            raise ValueError(f"ShardDataset.load_state_dict: batches_taken={taken} must be >= 0")
        self._position.set(taken)

    def close(self) -> None:
        """Stops the read-ahead thread (the next ``iter()`` opens the stream again)."""
        if self._stream is not None:
            stream, self._stream = self._stream, None
            stream.close()

    def __getstate__(self) -> Dict[str, Any]:
        # A DataLoader worker gets a copy without the stream's thread, so it raises the clear
        # error above instead of a pickling one.
        state = dict(self.__dict__)
        state["_stream"], state["_stream_at"] = None, -1
        state["_position"] = StreamPosition(self._position.get())
        return state


def of_rank(rank: Rank) -> ShardDataset:
    """``ctx.shard_dataset()``: one per rank, at the position the rank's checkpoints record."""
    if rank.dataset is None:
        raise RuntimeError("this run has no dataset: pass data=... to sparkdl.run")
    if rank.feed is not None:
        raise RuntimeError(
            "this rank reads its shard through ctx.epoch_batches(): use it or ctx.shard_dataset(), not both"
        )
    if rank.shard_dataset is None:
        rank.shard_dataset = ShardDataset(
            rank.reader,
            rank.dataset,
            rank.data_spec,
            rank.rank,
            rank.world_size,
            rank.steps_per_epoch,
            rank.position,
        )
    return rank.shard_dataset


_child_dataset: Optional[ShardDataset] = None


def shard_dataset() -> ShardDataset:
    """This rank's shard of the run's ``data=`` as a :class:`ShardDataset` (one per task: every
    call returns the same object, in a ``sparkdl.run`` function the one ``ctx.shard_dataset()`` returns).

    Raises:
        RuntimeError: outside a sparkdl task, or the run has no ``data=``.
    """
    global _child_dataset
    task = get_current_task()
    if task is not None:
        if task.context is None:
            raise RuntimeError(_OUTSIDE)
        return task.context.shard_dataset()
    if not os.environ.get(LAUNCHED):
        raise RuntimeError(_OUTSIDE)
    if _child_dataset is None:
        path = os.environ.get(SHARD_DATA)
        if not path:
            raise RuntimeError(
                "this launch has no dataset: pass data=... to sparkdl.launch for sparkdl.shard_dataset()"
            )
        import cloudpickle

        # The task wrote it for this process, in its own 0700 directory: a local file, never the network.
        with open(path, "rb") as handle:
            fields = cloudpickle.load(handle)
        _child_dataset = ShardDataset(**fields)
    return _child_dataset
