"""A small ring of reusable host buffers that finished batches are written into: on CUDA,
page-locked (pinned) memory the side-stream copy reads without staging
(:mod:`sparkdl._runtime.device_feed`), so no batch pays a fresh pinned allocation.

Before the ring, the prefetch thread pinned each batch with ``tensor.pin_memory()``: a new
page-locked block from torch's caching host allocator plus a copy into it, per tensor. The ring
keeps a few byte buffers instead (the prefetch queue's depth plus the batches a copy may still
be reading) and writes each finished batch straight into a free one: one copy into memory the
GPU copy reads as it is, the same count as ``pin_memory()``, without the per-tensor allocation,
and with a hard bound on the page-locked bytes a task holds (:data:`PINNED_BYTES_LIMIT`).

A shuffled stream whose input plan hands the gathered rows on as they are (dense features and
plain columns: :func:`sparkdl.data.batching.batches`) saves that copy too: its shuffle buffer
gathers each batch's rows straight into a buffer the ring gives it (:meth:`BatchRing.gather_arrays`),
and :meth:`BatchRing.fill` then hands those out as they are. A batch from the shard cache then
costs one gather into pinned memory, nothing else.

A buffer is reused only after whoever took its batch *released* it with a signal, and that
signal reports done: on CUDA the copy's CUDA event (the copy read the buffer), so a buffer is
never overwritten while a copy still reads it. A batch taken and never released keeps its
buffer: the ring then serves pageable batches rather than overwrite one in use.

The ring is the same code on every device; what differs is injected: the allocator (pinned
``torch.empty`` on CUDA, :func:`cuda_ring`) and the signal's ``is_done``/``wait`` (the event's
``query``/``synchronize``). Nothing on the CPU uses it: a CPU task converts batches without a
copy (:mod:`sparkdl._runtime.host_batches`). Page-locked memory is a scarce OS resource: when
pinning fails or the limit is reached, the batches are pageable tensors (as
``torch.from_numpy`` gives), said once in the log; the copy to the GPU is then staged by the
driver, slower but correct.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from sparkdl.data.batching import to_tensors

logger = logging.getLogger("sparkdl.train")

#: The page-locked bytes one task's ring may hold at most (all its buffers together).
PINNED_BYTES_LIMIT = 4 << 30
#: Where each tensor starts in a buffer: a multiple of any element size, and of a cache line.
_ALIGN = 64

#: Where a gather's arrays go in a buffer: (byte offset, tensor dtype, shape, element strides) each.
_Places = List[Tuple[int, torch.dtype, Tuple[int, ...], Tuple[int, ...]]]
#: (inputs, labels) of numpy arrays; inputs a dict of named arrays or one array.
HostBatch = Tuple[Any, Optional[np.ndarray]]


class _Buffer:
    """One batch's memory: a flat byte tensor, and the signal of whoever last read it."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.signal: Any = None
        self._typed: Dict[torch.dtype, torch.Tensor] = {}

    def carve(self, offset: int, dtype: torch.dtype, shape: Sequence[int], strides: Tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` with ``strides``, from byte ``offset`` on (a
        multiple of the element size: :data:`_ALIGN`)."""
        typed = self._typed.get(dtype)
        if typed is None:  # the whole buffer as that dtype, once: its size is a multiple of _ALIGN
            typed = self._typed[dtype] = self.data.view(dtype)
        return typed.as_strided(tuple(shape), strides, offset // typed.element_size())

    @property
    def key(self) -> int:
        return self.data.untyped_storage().data_ptr()


class BatchRing:
    """At most ``buffers`` reusable byte buffers that :meth:`fill` writes batches into.

    Thread-safe in the way it is used: one thread fills (the prefetch thread), another releases
    (the training thread, after starting each batch's copy).

    Args:
        allocate: a flat ``torch.uint8`` tensor of the given bytes (pinned on CUDA); may raise
            ``RuntimeError`` when the memory cannot be had.
        is_done: whether a release signal says the buffer is no longer read (never waits).
        wait: waits until a release signal is done.
        buffers: the most buffers the ring keeps.
        max_bytes: the most bytes all its buffers take together.
        what: what the memory is, for the log ("pinned").
    """

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor],
        is_done: Callable[[Any], bool],
        wait: Callable[[Any], None],
        buffers: int,
        max_bytes: int = PINNED_BYTES_LIMIT,
        what: str = "pinned",
    ) -> None:
        if buffers < 1:
            raise ValueError(f"a batch ring needs at least one buffer, got {buffers}")
        self._allocate, self._is_done, self._wait = allocate, is_done, wait
        self._most, self._max_bytes, self._what = buffers, max_bytes, what
        self._lock = threading.Lock()
        self._free: List[_Buffer] = []
        self._lent: Dict[int, _Buffer] = {}  # handed out with a batch, not released yet
        self._reading: Deque[_Buffer] = collections.deque()  # released; their signal may be pending
        self._can_grow = True
        self._said_pageable = False
        self.held_bytes = 0
        self.filled = 0  # batches written into a ring buffer
        self.gathered = 0  # of those, gathered there by the shuffle buffer (no copy)
        # The buffer of the batch gather_arrays last gave arrays for, and those arrays (by id)
        # with their tensors, until fill hands them out (or drops them: the batch never came).
        self._gathering: Optional[Tuple[_Buffer, Dict[int, Tuple[np.ndarray, torch.Tensor]]]] = None
        self._gather_shapes: Tuple[Any, ...] = ()  # the shapes gather_arrays was last asked for
        self._gather_layout: Optional[Tuple[_Places, int]] = None  # and where its arrays go
        self.pageable = 0  # batches served pageable (no buffer could be had)
        self.waits = 0  # fills that waited for a copy to finish reading a buffer

    def gather_arrays(self, shapes: Mapping[str, Tuple[Tuple[int, ...], np.dtype]]) -> Optional[Dict[str, np.ndarray]]:
        """Empty arrays of these shapes and dtypes, side by side in one free buffer, for a
        batch's rows to be gathered into (:data:`sparkdl.data.shuffled_rows.GatherInto`); None when
        no buffer can be had or a dtype has no tensor (the rows are then gathered pageable).

        The next :meth:`fill` hands out a batch made of exactly these arrays without a copy;
        any other batch it gets means this one was dropped (a resume's skipped batches), and so
        does asking again first: the buffer is free again. So one thread gathers and fills,
        one batch at a time, and the finished batch holds the arrays themselves or none of them.
        """
        self._drop_gathering()
        wanted = tuple(shapes.items())
        if wanted != self._gather_shapes:  # every batch of a stream has the same: laid out once
            self._gather_shapes, self._gather_layout = wanted, _gather_layout(shapes)
        if self._gather_layout is None:
            return None
        places, nbytes = self._gather_layout
        buffer = self._take(nbytes)
        if buffer is None:
            return None
        arrays, handed = {}, {}
        for key, (offset, dtype, shape, strides) in zip(shapes, places):
            tensor = buffer.carve(offset, dtype, shape, strides)
            arrays[key] = tensor.numpy()
            handed[id(arrays[key])] = (arrays[key], tensor)
        with self._lock:
            self._gathering = (buffer, handed)
        return arrays

    def fill(self, batch: HostBatch) -> Tuple[Any, Optional[torch.Tensor]]:
        """The batch as tensors written into a free buffer (the same values, shapes, dtypes and
        strides), or, when no buffer can be had, as pageable tensors sharing its arrays. A batch
        of the arrays :meth:`gather_arrays` gave is handed out from its buffer as it is."""
        inputs, labels = batch
        names = list(inputs) if isinstance(inputs, dict) else [None]
        arrays = [inputs[name] for name in names] if isinstance(inputs, dict) else [inputs]
        if labels is not None:
            arrays.append(labels)
        tensors = self._gathered(arrays)
        if tensors is None:
            self._drop_gathering()
            tensors = self._copied(arrays)
            if tensors is None:
                return to_tensors(batch)
        out_labels = tensors.pop() if labels is not None else None
        out_inputs = dict(zip(names, tensors)) if isinstance(inputs, dict) else tensors[0]
        return out_inputs, out_labels

    def _gathered(self, arrays: List[np.ndarray]) -> Optional[List[torch.Tensor]]:
        """The tensors of ``arrays`` when they are exactly those :meth:`gather_arrays` last gave
        (their buffer is then lent with them), else None."""
        with self._lock:
            if self._gathering is None:
                return None
            buffer, handed = self._gathering
            if len(arrays) != len(handed) or not all(id(array) in handed for array in arrays):
                return None
            self._gathering = None
            self._lent[buffer.key] = buffer
            self.filled += 1
            self.gathered += 1
            return [handed[id(array)][1] for array in arrays]

    def _copied(self, arrays: List[np.ndarray]) -> Optional[List[torch.Tensor]]:
        """``arrays`` copied into a free buffer (lent with them), or None when none can be had."""
        sources = [torch.from_numpy(array) for array in arrays]
        layout, nbytes = _layout(sources)
        buffer = self._take(nbytes)
        if buffer is None:
            with self._lock:
                self.pageable += 1
            return None
        tensors = []
        for source, (offset, strides) in zip(sources, layout):
            view = buffer.carve(offset, source.dtype, source.shape, strides)
            view.copy_(source)
            tensors.append(view)
        with self._lock:
            self._lent[buffer.key] = buffer
            self.filled += 1
        return tensors

    def _drop_gathering(self) -> None:
        """The arrays gather_arrays gave last will not be filled: their buffer is free again."""
        with self._lock:
            if self._gathering is not None:
                self._free.append(self._gathering[0])
                self._gathering = None

    def release(self, batch: Tuple[Any, Optional[torch.Tensor]], signal: Any = None) -> None:
        """Nothing but ``signal``'s reader uses ``batch``'s memory any more: its buffer is free
        once ``is_done(signal)``. A batch not from this ring (pageable) is ignored."""
        inputs, labels = batch
        first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs  # at the buffer's start
        with self._lock:
            buffer = self._lent.pop(first.untyped_storage().data_ptr(), None)
            if buffer is not None:
                buffer.signal = signal
                self._reading.append(buffer)

    def stats(self) -> Dict[str, Any]:
        """Batches written into the ring and served pageable, waits, buffers and bytes held."""
        with self._lock:
            return {
                "memory": self._what,
                "filled_batches": self.filled,
                "gathered_batches": self.gathered,
                "pageable_batches": self.pageable,
                "waits": self.waits,
                "buffers": len(self._free) + len(self._lent) + len(self._reading) + (self._gathering is not None),
                "held_bytes": self.held_bytes,
            }

    def _take(self, nbytes: int) -> Optional[_Buffer]:
        """A buffer of at least ``nbytes`` no one reads: a free one, else a new one (or a free
        one too small, replaced), else the oldest one a copy reads, once it is done; None when
        none can be had (the batch goes pageable)."""
        while True:
            with self._lock:
                self._collect_done()
                fitting = [buffer for buffer in self._free if buffer.data.numel() >= nbytes]
                if fitting:
                    buffer = min(fitting, key=lambda b: b.data.numel())
                    self._free.remove(buffer)
                    return buffer
                why = self._why_not_grow(nbytes)
                if why is None:
                    replaced = self._free.pop(0) if self._free else None  # only ever too small here
                    break
                oldest = self._reading[0] if self._reading else None
                if oldest is None:
                    self._go_pageable(why)
                    return None
                self.waits += 1
            self._wait(oldest.signal)  # outside the lock: the training thread keeps releasing
        return self._grow(nbytes, replaced)

    def _collect_done(self) -> None:
        """Frees every released buffer whose signal is done (not only the oldest: a batch
        released with no reader is free at once, behind one a copy still reads)."""
        for buffer in [buffer for buffer in self._reading if self._is_done(buffer.signal)]:
            self._reading.remove(buffer)
            buffer.signal = None
            self._free.append(buffer)

    def _why_not_grow(self, nbytes: int) -> Optional[str]:
        """None when a new buffer of ``nbytes`` may be allocated (replacing a free one too
        small, if any), else why not."""
        if not self._can_grow:
            return "page-locked memory could not be allocated earlier"
        replaced = self._free[0].data.numel() if self._free else 0
        if not self._free and len(self._lent) + len(self._reading) >= self._most:
            return f"all {self._most} buffers are held by batches not released yet"
        if self.held_bytes - replaced + nbytes > self._max_bytes:
            return f"a batch of {nbytes:,} bytes would take the ring past its limit of {self._max_bytes:,} bytes"
        return None

    def _grow(self, nbytes: int, replaced: Optional[_Buffer]) -> Optional[_Buffer]:
        """A new buffer of ``nbytes`` in place of ``replaced`` (if any; dropped either way),
        allocated outside the lock: pinning memory may take milliseconds."""
        try:
            data = self._allocate(nbytes)
        except RuntimeError as exc:
            with self._lock:
                self._can_grow = False
                if replaced is not None:
                    self._free.append(replaced)
                self._go_pageable(f"allocating {nbytes:,} bytes failed ({exc})")
            return None
        with self._lock:
            self.held_bytes += nbytes - (replaced.data.numel() if replaced is not None else 0)
        return _Buffer(data)

    def _go_pageable(self, why: str) -> None:
        if not self._said_pageable:
            self._said_pageable = True
            logger.warning(
                "the %s batch ring hands out a pageable batch (and does so whenever it has no buffer to "
                "write one into): %s; the copies of those to the GPU are staged, slower",
                self._what,
                why,
            )


def _gather_layout(shapes: Mapping[str, Tuple[Tuple[int, ...], np.dtype]]) -> Optional[Tuple[_Places, int]]:
    """Where contiguous arrays of these shapes and dtypes go in one buffer (byte offset, tensor
    dtype, shape, element strides, as :func:`_layout` places them) and the bytes in all; None
    when a dtype has no tensor (objects, strings)."""
    places = []
    offset = 0
    for shape, dtype in shapes.values():
        try:
            tensor_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
        except TypeError:
            return None
        shape = tuple(shape)
        places.append((offset, tensor_dtype, shape, _contiguous_strides(shape)))
        offset += -(-math.prod(shape) * tensor_dtype.itemsize // _ALIGN) * _ALIGN
    return places, max(offset, _ALIGN)


def _layout(sources: List[torch.Tensor]) -> Tuple[List[Tuple[int, Tuple[int, ...]]], int]:
    """Where each tensor goes in one buffer (byte offset, element strides) and the bytes in
    all. A dense tensor keeps its strides (a channels-last image stays channels-last, as
    ``pin_memory()`` keeps it); any other is laid out contiguously."""
    places = []
    offset = 0
    for source in sources:
        dense = source.is_contiguous() or _dense(source)
        strides = tuple(source.stride()) if dense else _contiguous_strides(source.shape)
        places.append((offset, strides))
        offset += -(-source.numel() * source.element_size() // _ALIGN) * _ALIGN
    return places, max(offset, _ALIGN)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill exactly ``numel`` places, in some order of the dimensions."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def cuda_ring(buffers: int, max_bytes: int = PINNED_BYTES_LIMIT) -> BatchRing:
    """The ring of a CUDA task's prefetch thread: page-locked buffers, free again once the
    CUDA event recorded after a batch's copy has completed. Allocates nothing until the first
    batch (in the prefetch thread, on the task's GPU: ``pin_thread_to``)."""

    def pinned(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_done(event: Any) -> bool:
        return event is None or bool(event.query())

    def wait(event: Any) -> None:
        if event is not None:
            event.synchronize()

    return BatchRing(pinned, is_done, wait, buffers, max_bytes, what="pinned")
