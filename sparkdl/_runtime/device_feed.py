"""Keeping the GPU fed: batches moved to the training device, the next one copied while the
current one trains.

On CUDA a prefetch thread writes host batches into a ring of pinned buffers (in a thread made to
use the task's GPU, :func:`pin_thread_to`; :mod:`sparkdl._runtime.host_batches`,
:mod:`sparkdl._runtime.pinned_ring`), and :class:`DeviceFeed` starts each next
batch's copy on a side stream (:class:`CudaCopier`) so it overlaps the current step's kernels. On
the CPU it passes the host batches through. Which device a task trains on is :mod:`sparkdl._runtime.device`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Protocol, Tuple

import torch

#: (inputs, labels); inputs is a tensor or a dict of named tensors.
Batch = Tuple[Any, Optional[torch.Tensor]]


def move_batch(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    """A batch's host tensors (a dict of named inputs too) on ``device``."""
    if device.type == "cpu":
        # Already there; tensor.to() would still release the GIL, handing it to another thread mid-step.
        return batch
    inputs, labels = batch
    if isinstance(inputs, dict):
        inputs = {name: value.to(device, non_blocking=non_blocking) for name, value in inputs.items()}
    else:
        inputs = inputs.to(device, non_blocking=non_blocking)
    return inputs, (labels.to(device, non_blocking=non_blocking) if labels is not None else None)


def _batch_tensors(batch: Batch) -> Iterator[torch.Tensor]:
    inputs, labels = batch
    yield from (inputs.values() if isinstance(inputs, dict) else (inputs,))
    if labels is not None:
        yield labels


class HostBatches(Protocol):
    """Where :class:`DeviceFeed` takes host batches from (:mod:`sparkdl._runtime.host_batches`)."""

    def next(self) -> Batch: ...

    def poll(self) -> Optional[Batch]: ...

    def close(self) -> None: ...

    # Optional: ``release(batch, signal)``, told after each batch's copy started, with the
    # copy's token (its CUDA event), by host batches that lend reusable buffers (a pinned ring).


class Copier(Protocol):
    """Starts a host-to-device copy and later hands its result to the training stream."""

    def start(self, batch: Batch) -> Tuple[Batch, Any]: ...

    def finish(self, batch: Batch, token: Any) -> None: ...


class CudaCopier:
    """Copies on a side CUDA stream, so a copy overlaps the kernels of the current step.

    The training stream waits for the copy's event before using the batch (no host sync), and
    ``record_stream`` tells the caching allocator that the training stream uses the memory, so
    it is not handed out again while kernels still read it.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def start(self, batch: Batch) -> Tuple[Batch, Any]:
        with torch.cuda.stream(self._stream):
            moved = move_batch(batch, self._device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return moved, event  # type: ignore[return-value]

    def finish(self, batch: Batch, token: Any) -> None:
        current = torch.cuda.current_stream(self._device)
        current.wait_event(token)
        for tensor in _batch_tensors(batch):
            tensor.record_stream(current)


class DeviceFeed:
    """Batches on the training device, the next one copied ahead while the current one trains.

    On CUDA, when batch *i* is handed out, batch *i+1* — if the prefetch thread already has it
    in pinned memory — starts its copy on a side stream at once, so the copy runs during step
    *i*'s kernels instead of after them; if it is not ready yet, nothing waits for it (the copy
    starts when it is asked for). At most two batches are on the GPU at a time. On the CPU this
    is a pass-through: exactly the host batches, as before.

    Args:
        source: host batches (pinned on CUDA).
        device: the training device.
        copier: the copy mechanism; default :class:`CudaCopier` on CUDA, none on the CPU.
    """

    def __init__(self, source: HostBatches, device: torch.device, copier: Optional[Copier] = None) -> None:
        self._source = source
        self._copier = copier if copier is not None else (CudaCopier(device) if device.type == "cuda" else None)
        self._ahead: Optional[Tuple[Batch, Any]] = None
        self._release = getattr(source, "release", None)

    def next(self) -> Batch:
        if self._copier is None:
            return self._source.next()
        if self._ahead is None:
            self._ahead = self._start(self._source.next())
        batch, token = self._ahead
        self._ahead = None
        self._copier.finish(batch, token)
        following = self._source.poll()
        if following is not None:
            self._ahead = self._start(following)
        return batch

    def _start(self, host: Batch) -> Tuple[Batch, Any]:
        """Starts ``host``'s copy; its host memory is free again once the copy's token is done."""
        started = self._copier.start(host)  # type: ignore[union-attr]
        if self._release is not None:
            self._release(host, started[1])
        return started

    def ring_stats(self) -> Optional[Dict[str, Any]]:
        """The host batches' pinned ring counters (batches written into it, served pageable,
        waits, buffers, bytes), None when they come from no ring."""
        stats = getattr(self._source, "ring_stats", None)
        return stats() if stats is not None else None

    def close(self) -> None:
        self._ahead = None
        self._source.close()


def pin_thread_to(device: Optional[torch.device]) -> None:
    """Makes ``device`` current in the calling (background) thread.

    CUDA's current device is per thread and starts at 0, and pinning host memory creates a CUDA
    context on the current device: a prefetch thread that pins without this would put a context
    (hundreds of MiB) on GPU 0 — another task's GPU — for every task. DataLoader's pin-memory
    thread does the same.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
