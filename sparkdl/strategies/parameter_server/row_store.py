"""The rows a rank holds of one sparse table, in a few flat numpy arrays: an id -> slot index and
the values and optimizer state by slot.

A Python dict of ``id -> slot`` costs about 100 bytes a row (its entry plus two int objects),
more than the 64 bytes of a dim-16 float32 row; a table sized to fill the ranks' memory would
not fit beside it. Here a row costs its values and state plus 16-24 bytes:

* ``ids[slot]`` (int64, 8 bytes a row): the id of each held row, in the order rows were created;
  it is also what a snapshot or a checkpoint lists.
* ``buckets`` (int32 slots, -1 for empty): an open-addressing hash table with linear probing,
  kept between a quarter and half full, so 8-16 bytes a row. A bucket holds a slot, not an id:
  the id is read back from ``ids``, which halves the table. Rows are never removed, so a probe
  stops at the first empty bucket, and a batch of ids is looked up and inserted with vectorized
  numpy steps (one per probe distance, a handful at this load), not one Python step per id.
* ``values[slot]`` and each optimizer state array: ``[capacity, dim]``, each in an anonymous
  memory map grown by a quarter when full with ``mremap``: pages are moved, not copied (no
  second copy of the shard at the moment it grows, which matters for a shard sized near the
  budget), and the spare capacity costs address space, not resident memory, until rows are
  written into it. (``ndarray.resize`` would zero-fill the spare capacity, making it resident.)

Nothing outside holds a view of these arrays: every method returns copies. A view kept by
mistake would make the next growth fail (``BufferError``), never read freed memory.
"""

from __future__ import annotations

import math
import mmap
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from sparkdl.strategies.parameter_server.rows import RowOptimizer, mix64

__all__ = ["RowStore", "likely_most_rows"]

_EMPTY = -1
#: A salt for the bucket hash: ``owners`` hashes ``id + golden ratio`` and takes it modulo the
#: ranks, so with a power-of-two world every row of a rank shares its low hash bits; the buckets
#: use another hash of the id (and its high bits).
_SALT = np.uint64(0xD1B54A32D192ED03)
_MIN_BUCKET_BITS = 6
_MIN_CAPACITY = 64
_MAX_SLOTS = 2**31 - 1  # slots are int32 in the buckets


def likely_most_rows(num_rows: int, world_size: int) -> int:
    """A bound on the rows of a ``num_rows`` table one of ``world_size`` ranks owns under the
    id hash: each id is its with probability ``1/world_size``, so the count is binomial; its
    mean plus six standard deviations is passed about once in a billion tables (and then the
    store grows past it as usual)."""
    share = 1.0 / world_size
    bound = num_rows * share + 6.0 * math.sqrt(num_rows * share * (1.0 - share)) + _MIN_CAPACITY
    return min(num_rows, int(math.ceil(bound)))


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


class _Column:
    """A growable ``[capacity, *shape]`` array in an anonymous memory map."""

    def __init__(self, dtype: np.dtype, shape: Tuple[int, ...]) -> None:
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)
        self._map: Optional[mmap.mmap] = None
        self.array = np.empty((0, *self.shape), dtype=self.dtype)

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` rows; the rows held keep their values.

        Raises:
            MemoryError: the process may not map that much (under Spark's Python memory limit,
                ``RLIMIT_AS``); the column keeps its rows and its old capacity.
        """
        size = max(1, capacity * math.prod(self.shape) * self.dtype.itemsize)
        held = len(self.array)
        self.array = np.empty((0, *self.shape), dtype=self.dtype)  # drops the view of the old map
        try:
            if self._map is None:
                self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            else:
                try:
                    self._map.resize(size)
                except SystemError:  # no mremap (macOS): a new map, the rows copied once
                    old, self._map = self._map, mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
                    np.frombuffer(self._map, dtype=np.uint8, count=len(old))[:] = np.frombuffer(old, dtype=np.uint8)
                    old.close()
        except OSError as exc:  # ENOMEM: the old map is intact
            self._view(held)
            raise MemoryError(
                f"cannot map {size / 2**20:,.0f} MiB for {capacity:,} rows of a sparse table's shard ({exc})"
            ) from exc
        self._view(capacity)

    def _view(self, capacity: int) -> None:
        if self._map is None:
            return
        count = capacity * math.prod(self.shape)
        self.array = np.frombuffer(self._map, dtype=self.dtype, count=count).reshape(capacity, *self.shape)


class RowStore:
    """The rows of one table held by one rank: ``dim`` values of ``dtype`` and ``optimizer``'s
    state per row. Not thread-safe: the shard calls it under its lock."""

    def __init__(self, dim: int, dtype: torch.dtype, optimizer: RowOptimizer, most_rows: Optional[int] = None) -> None:
        self.dim, self.dtype, self.optimizer = dim, dtype, optimizer
        #: The most rows this rank will likely ever hold (:func:`likely_most_rows`): growth stops
        #: there rather than a quarter past it. Spare capacity is address space, which is what
        #: Spark's Python memory limit (``RLIMIT_AS``) counts: a shard near the budget must not
        #: reserve a quarter more than it can hold.
        self.most_rows = most_rows
        self.count = 0
        self._columns: Dict[str, _Column] = {
            "ids": _Column(np.int64, ()),
            "values": _Column(_numpy_dtype(dtype), (dim,)),
        }
        for key, value in optimizer.new_state(0, dim, dtype).items():
            self._columns[f"state.{key}"] = _Column(value.numpy().dtype, tuple(value.shape[1:]))
        self._bits = _MIN_BUCKET_BITS
        self._buckets = np.full(1 << self._bits, _EMPTY, dtype=np.int32)

    @property
    def _ids(self) -> np.ndarray:
        return self._columns["ids"].array

    @property
    def _values(self) -> np.ndarray:
        return self._columns["values"].array

    @property
    def _state(self) -> Dict[str, np.ndarray]:
        return {key[len("state.") :]: c.array for key, c in self._columns.items() if key.startswith("state.")}

    @property
    def nbytes(self) -> int:
        """Bytes of every array the store holds (capacity included: address space, of which
        only the rows written and the index are resident)."""
        return self._buckets.nbytes + sum(column.array.nbytes for column in self._columns.values())

    @property
    def capacity(self) -> int:
        """Rows every array has room for before they grow (after a failed growth some columns
        may have more)."""
        return min(len(column.array) for column in self._columns.values())

    def ids(self) -> torch.Tensor:
        """The ids held, in slot order (a copy)."""
        return torch.from_numpy(self._ids[: self.count].copy())

    # ---- the index ------------------------------------------------------------------------

    def _home(self, ids: np.ndarray) -> np.ndarray:
        hashed = mix64(ids.view(np.uint64) ^ _SALT)
        return (hashed >> np.uint64(64 - self._bits)).astype(np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each of ``ids`` (int64), -1 where the row is not held."""
        slots, _ = self._probe(np.ascontiguousarray(ids, dtype=np.int64))
        return slots

    def _probe(self, ids: np.ndarray):
        """``(slots, where)``: each id's slot (-1 if absent) and, for the absent ones, the empty
        bucket its probe ended at (where it would be inserted)."""
        mask = len(self._buckets) - 1
        where = self._home(ids)
        slots = np.full(len(ids), _EMPTY, dtype=np.int64)
        todo = np.arange(len(ids))
        while len(todo):
            found = self._buckets[where[todo]].astype(np.int64)
            occupied = found >= 0
            hit = np.zeros(len(todo), dtype=bool)
            hit[occupied] = self._ids[found[occupied]] == ids[todo[occupied]]
            slots[todo[hit]] = found[hit]
            todo = todo[occupied & ~hit]
            where[todo] = (where[todo] + 1) & mask
        return slots, where

    def _place(self, slots: np.ndarray, where: np.ndarray) -> None:
        """Writes ``slots`` (of rows not in the table yet) into the first empty bucket at or
        after ``where`` (each id's home or a bucket its probe passed by occupied ones)."""
        mask = len(self._buckets) - 1
        todo = np.arange(len(slots))
        while len(todo):
            free = todo[self._buckets[where[todo]] < 0]
            # Two rows of the batch may want one bucket: one write lands (whichever numpy keeps),
            # and reading back tells each which.
            self._buckets[where[free]] = slots[free]
            placed = np.zeros(len(slots), dtype=bool)
            placed[free[self._buckets[where[free]] == slots[free]]] = True
            todo = todo[~placed[todo]]
            where[todo] = (where[todo] + 1) & mask

    def _rehash(self, rows: int) -> None:
        """A table with room for ``rows`` at most half full, every held row placed again."""
        self._bits = max(_MIN_BUCKET_BITS, int(2 * rows - 1).bit_length())
        self._buckets = np.full(1 << self._bits, _EMPTY, dtype=np.int32)
        self._place(np.arange(self.count, dtype=np.int64), self._home(self._ids[: self.count]))

    # ---- rows -----------------------------------------------------------------------------

    def _reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in the arrays (grown by a quarter at least) and the index."""
        if rows > _MAX_SLOTS:
            raise MemoryError(f"a sparse table shard of {rows} rows: at most {_MAX_SLOTS} rows per rank")
        capacity = self.capacity
        if rows > capacity:
            grown = max(rows, capacity + capacity // 4, _MIN_CAPACITY)
            capacity = min(grown, self.most_rows) if self.most_rows is not None and rows <= self.most_rows else grown
            for column in self._columns.values():
                if len(column.array) < capacity:  # one that grew before a failed attempt keeps its room
                    column.grow(capacity)
        if 2 * rows > len(self._buckets):
            self._rehash(rows)

    def slots_for(self, ids: torch.Tensor, initial: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The slots of ``ids`` (distinct), creating the rows not held yet, in the order of
        ``ids``, with values ``initial(new_ids)`` and the optimizer's fresh state."""
        keys = np.ascontiguousarray(ids.numpy(), dtype=np.int64)
        slots, where = self._probe(keys)
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            new_ids = keys[missing]
            first, last = self.count, self.count + len(missing)
            grows = 2 * last > len(self._buckets)
            self._reserve(last)
            self._ids[first:last] = new_ids
            self._values[first:last] = initial(torch.from_numpy(new_ids)).numpy()
            for key, value in self.optimizer.new_state(len(missing), self.dim, self.dtype).items():
                self._state[key][first:last] = value.numpy()
            slots[missing] = np.arange(first, last)
            # After a rehash the probes' buckets are stale: place from the new homes.
            self._place(slots[missing], self._home(new_ids) if grows else where[missing])
            self.count = last
        return torch.from_numpy(slots)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The values of ``slots`` (a copy)."""
        return torch.from_numpy(self._values)[slots]

    def update(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """Applies the row optimizer to ``slots`` (distinct) with gradients ``grads``."""
        values = torch.from_numpy(self._values)
        state = {key: torch.from_numpy(array) for key, array in self._state.items()}
        rows = values[slots]
        picked = {key: array[slots] for key, array in state.items()}
        self.optimizer.apply(rows, picked, grads)
        values[slots] = rows
        for key, value in picked.items():
            state[key][slots] = value

    def export(self) -> Dict[str, torch.Tensor]:
        """Copies of the rows held: ``ids``, ``values`` and the optimizer state by key."""
        count = self.count
        out = {"ids": self.ids(), "values": torch.from_numpy(self._values[:count].copy())}
        out.update({f"state.{key}": torch.from_numpy(array[:count].copy()) for key, array in self._state.items()})
        return out

    def load(self, ids: torch.Tensor, values: torch.Tensor, state: Optional[Dict[str, torch.Tensor]]) -> None:
        """Replaces every row held by ``ids`` (distinct) with ``values`` and ``state``."""
        self.__init__(self.dim, self.dtype, self.optimizer)
        count = len(ids)
        self._reserve(count)
        self._ids[:count] = ids.numpy()
        self._values[:count] = values.numpy()
        for key, value in (state or {}).items():
            self._state[key][:count] = value.numpy()
        self.count = count
        self._place(np.arange(count, dtype=np.int64), self._home(self._ids[:count]))
