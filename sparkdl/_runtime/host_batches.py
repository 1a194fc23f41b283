"""Where a rank's finished batches become host tensors: on a prefetch thread, or in the
training thread itself.

On CUDA a prefetch thread converts and pins batches ahead, so host work overlaps the GPU's
kernels. On the CPU the training thread *is* the compute: a second Python thread there only
trades the GIL with it (every torch op releases the GIL, the prefetch thread takes it, and the
step waits to get it back): on one core, ``benchmarks/step_overhead.py`` measured the loop at
0.89 of in-memory DDP's speed with the thread and 0.94 without it (the 85k-parameter MLP,
batch 64), 0.89 and 0.95 for a data-bound ``Linear(64, 10)`` at batch 1024. The work that is worth overlapping on the
CPU already has threads of its own: the reader's row-group read-ahead and the decode threads
(images, ``transform_fn``), which run ahead of whoever takes the batches.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Dict, Iterator, Optional

import torch

from sparkdl._runtime.device_feed import Batch, HostBatches, pin_thread_to
from sparkdl._runtime.pinned_ring import BatchRing, cuda_ring
from sparkdl.data.batching import to_tensors

#: Buffers a pinned ring keeps beyond the queue's depth: the batch the prefetch thread fills
#: while the queue is full, and the two whose copies may still read them (the one copied
#: ahead, the current one); with more, a fill waits for the oldest copy's event.
_RING_BEYOND_DEPTH = 3


#: Batches the prefetch thread's queue holds.
PREFETCH_DEPTH = 4


def batch_ring(device: torch.device) -> Optional[BatchRing]:
    """The ring of pinned buffers a CUDA task's batches are written (or gathered) into; None on
    the CPU. Give it to :func:`host_batches`, and its ``gather_arrays`` to the stream
    (:func:`sparkdl.data.batching.batches`) so shuffled batches are gathered straight into it."""
    return cuda_ring(PREFETCH_DEPTH + _RING_BEYOND_DEPTH) if device.type == "cuda" else None


def host_batches(
    source: Iterator, device: torch.device, pin: bool = True, ring: Optional[BatchRing] = None
) -> HostBatches:
    """The host-batch stream for a rank training on ``device``: a :class:`Prefetcher` on CUDA
    (writing batches into a ring of pinned buffers, ``ring`` or a new one, unless ``pin`` is
    False: a framework that moves batches itself), batches converted when they are taken
    (:class:`InlineBatches`) on the CPU."""
    if device.type == "cuda":
        return Prefetcher(source, pin=pin, device=device, ring=ring if pin else None)
    return InlineBatches(source)


class InlineBatches:
    """Batches converted to tensors in the calling thread, when they are taken."""

    def __init__(self, source: Iterator) -> None:
        self._source = source

    def next(self) -> Batch:
        try:
            batch = next(self._source)
        except StopIteration:
            raise StopIteration("the data stream ended") from None
        return to_tensors(batch)

    def poll(self) -> Optional[Batch]:
        """The next batch: taking it is what makes it ready, so this is ``next``."""
        return self.next()

    def release(self, batch: Batch, signal: Any = None) -> None:
        """Nothing to do: the batch's tensors share the reader's arrays, no buffer is lent."""

    def ring_stats(self) -> Optional[Dict[str, Any]]:
        return None

    def close(self) -> None:
        self._source.close()


class Prefetcher:
    """Converts batches to tensors on a background thread so reading overlaps compute.

    The queue is bounded (a few batches), so memory stays bounded; an error in the reader
    re-raises in the training thread at the next ``next()``. Pinning on CUDA writes each batch
    into a :class:`~sparkdl._runtime.pinned_ring.BatchRing` of pinned buffers (``ring``: another
    one, e.g. a test's); whoever takes a batch passes it to :meth:`release` once its copy
    started.
    """

    def __init__(
        self,
        source: Iterator,
        pin: bool,
        depth: int = PREFETCH_DEPTH,
        device: Optional[torch.device] = None,
        ring: Optional[BatchRing] = None,
    ) -> None:
        self._source = source
        self._pin = pin
        self._device = device
        if ring is None and pin and device is not None and device.type == "cuda":
            ring = cuda_ring(depth + _RING_BEYOND_DEPTH)
        self._ring = ring
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="sparkdl-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            if self._pin:
                pin_thread_to(self._device)  # else pinning puts a CUDA context on GPU 0
            for batch in self._source:
                tensors = self._ring.fill(batch) if self._ring is not None else to_tensors(batch, self._pin)
                if not self._put(tensors):
                    return
            self._put(StopIteration("the data stream ended"))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer thread
            self._put(exc)
        finally:
            self._source.close()

    def _put(self, item: Any) -> bool:
        """Waits for room in the queue, unless the consumer stopped; False when it did."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> Batch:
        item = self.poll()  # the usual case, a batch is waiting: no timed wait on the queue's lock
        while item is None:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data reader thread stopped without an error") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def poll(self) -> Optional[Batch]:
        """The next batch if one is ready now, else None (never waits); errors as ``next``."""
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self, batch: Batch, signal: Any = None) -> None:
        """``batch``'s host memory is read by nothing but ``signal`` (the copy's CUDA event; None:
        by nothing): its ring buffer may be written again once the signal is done."""
        if self._ring is not None:
            self._ring.release(batch, signal)

    def ring_stats(self) -> Optional[Dict[str, Any]]:
        """The ring's counters (:meth:`BatchRing.stats`), None without one."""
        return self._ring.stats() if self._ring is not None else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
