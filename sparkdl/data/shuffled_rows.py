"""The rows of a shuffle buffer (:func:`sparkdl.data.selection.shuffled_batches`), permuted,
handed out a batch at a time: sliced from one permuted copy of the whole buffer, or gathered
per batch into arrays the caller gives (a pinned ring's buffer).

The buffer's rows are permuted as a whole either way (one ``rng.permutation``), so the batches
depend only on the seed and the chunks' row counts, not on how they are gathered. A pageable
stream (a CPU task's) permutes the whole buffer into one copy and slices its batches from it:
one large ``numpy`` gather costs less per batch than many small ones (``benchmarks/gather_batches.py``).
A stream that gathers into pinned buffers does it per batch, so each batch is written once,
straight where its copy to the GPU reads it (:mod:`sparkdl._runtime.pinned_ring`).
"""

from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from sparkdl.data.inputs import POSITION_KEY

#: Row-aligned arrays of some rows (:data:`sparkdl.data.readers.base.Chunk`).
Chunk = Dict[str, np.ndarray]
#: Where a batch's rows may be gathered: given each key's (shape, dtype), empty arrays of those
#: to write them into (views of a pinned buffer: :meth:`BatchRing.gather_arrays
#: <sparkdl._runtime.pinned_ring.BatchRing.gather_arrays>`), or None (new arrays, then).
GatherInto = Callable[[Dict[str, Tuple[Tuple[int, ...], np.dtype]]], Optional[Chunk]]


class ShuffledRows:
    """The rows of ``chunks``, concatenated then permuted by ``order``: :meth:`take` hands out
    rows ``start:stop`` of that. Without ``gather_into`` it is made once (a copy of the whole
    buffer, each chunk's rows written straight to their places) and batches are slices of it;
    with it, rows ``order[start:stop]`` of the concatenation are gathered per batch, into the
    arrays ``gather_into`` gives when it gives some.
    """

    def __init__(self, chunks: List[Chunk], order: np.ndarray, gather_into: Optional[GatherInto] = None) -> None:
        self.rows = len(order)
        self._gather_into = gather_into
        self._permuted: Optional[Chunk] = None
        if gather_into is None:
            self._permuted = (
                {key: values[order] for key, values in chunks[0].items()}
                if len(chunks) == 1
                else _permuted_concatenation(chunks, order)
            )
            return
        self._chunks = chunks
        self._dtypes = {key: np.result_type(*[chunk[key] for chunk in chunks]) for key in chunks[0]}
        self._source: Optional[np.ndarray] = None  # each permuted row's chunk (None: all the one's)
        self._local = order  # and its row in that chunk
        self._switches: List[int] = []  # where the permuted rows' chunk changes
        if len(chunks) > 1:
            sizes = np.array([len(next(iter(chunk.values()))) for chunk in chunks], dtype=np.int64)
            ends = np.cumsum(sizes)
            self._source = np.searchsorted(ends, order, side="right")
            self._local = order - (ends - sizes)[self._source]
            self._switches = (np.flatnonzero(np.diff(self._source)) + 1).tolist()

    def take(self, start: int, stop: int, into: bool = False) -> Chunk:
        """Rows ``start:stop`` of the permuted rows; ``into``: in the arrays ``gather_into``
        gives, when it gives some (positions never: :class:`~sparkdl.data.selection.EpochPasses`
        keeps them)."""
        if self._permuted is not None:
            return {key: values[start:stop] for key, values in self._permuted.items()}
        local = self._local[start:stop]
        primary, others, sources = 0, None, None
        if self._source is not None:
            primary = int(self._source[start])
            switch = bisect.bisect_right(self._switches, start)
            if switch < len(self._switches) and self._switches[switch] < stop:  # rows of several chunks
                source = self._source[start:stop]
                primary = int(np.bincount(source).argmax())
                others = np.flatnonzero(source != primary)
                sources = source[others]
        chunk = self._chunks[primary]
        given = None
        if into and self._gather_into is not None:
            shapes = {key: ((stop - start,) + values.shape[1:], self._dtypes[key]) for key, values in chunk.items()}
            shapes.pop(POSITION_KEY, None)
            given = self._gather_into(shapes)
        out: Chunk = {}
        for key, values in chunk.items():
            target = given.get(key) if given is not None else None
            if target is None and others is None and values.dtype == self._dtypes[key]:
                out[key] = np.take(values, local, axis=0)
                continue
            if target is None:
                target = np.empty((stop - start,) + values.shape[1:], self._dtypes[key])
            _take_into(values, local, target)  # the rows of another chunk, clipped, are put in next
            if others is not None:
                for index in set(sources.tolist()):
                    rows = others[sources == index]
                    target[rows] = self._chunks[index][key][local[rows]]
            out[key] = target
        return out


def _take_into(values: np.ndarray, rows: np.ndarray, target: np.ndarray) -> None:
    """``target[:] = values[rows]``, rows past the end clipped to the last one."""
    if values.dtype == target.dtype:
        # mode="clip" also keeps numpy from gathering into a temporary first (it does with "raise").
        np.take(values, rows, axis=0, out=target, mode="clip")
    else:
        target[...] = np.take(values, rows, axis=0, mode="clip")


def _permuted_concatenation(chunks: List[Chunk], order: np.ndarray) -> Chunk:
    """The chunks concatenated, then rows ``order`` taken, in one copy: each chunk's rows are
    written straight to their places. A row group's chunk arrives with the rows left from the
    last one; concatenating them first would copy the whole row group twice (measured: 3-9 ms
    for 75,000 rows of 256 bytes, beside the permutation's 3.5 ms)."""
    places = np.empty_like(order)
    places[order] = np.arange(len(order))
    merged: Chunk = {}
    for key in chunks[0]:
        parts = [chunk[key] for chunk in chunks]
        values = np.empty((len(order),) + parts[0].shape[1:], dtype=np.result_type(*parts))
        start = 0
        for part in parts:
            values[places[start : start + len(part)]] = part
            start += len(part)
        merged[key] = values
    return merged
