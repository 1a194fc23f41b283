"""Which rows of a dataset a rank reads, in which order: the rules every reader shares.

* **Row-group order.** Global row group ``i`` is the ``i``-th row group of the dataset's files
  in :attr:`DatasetInfo.files` order. Rank ``r`` of ``n`` reads the row groups with
  ``i % n == r``; with shuffling, each pass's order is exactly the one Petastorm 0.12 produces
  for ``seed = spec.seed + pass`` (its shard shuffle with ``random.Random(seed)``, then its
  ventilator's ``numpy.random.RandomState(seed)`` shuffle); without, it is ascending. So the
  Petastorm and Arrow readers hand out the same rows in the same order. With fewer row groups than ranks every rank reads
  every row group and keeps the rows whose position ``p`` has ``p % n == r``.
* **Positions.** A row's position is its index in the whole dataset in that file order. The
  striding fallback and the validation hold-out are functions of the position only, so they do
  not depend on the seed, the shuffle or the reader.
* **Hold-out.** ``DataSpec.holdout = f`` sends the rows whose hashed position falls below
  ``f`` to validation (a splitmix64 hash: a fixed, even spread over the file, the same split
  for every seed and ``num_workers``). Training skips them, the validation pass reads only them.
* **Filters.** A pyarrow filter (DNF or expression) keeps rows; the readers evaluate it on the
  rows of each row group, after skipping row groups whose statistics rule it out.
* **Deleted rows.** A table's deleted rows (:mod:`sparkdl.data.table_layout`) keep their
  positions and are left out like rows a filter drops.
* **Epochs are passes.** A shuffled training stream leaves out of a pass the rows that the
  epoch in progress already took from the pass before (:class:`EpochPasses`), so an epoch takes
  no row twice while the shard holds rows it has not taken.
"""

from __future__ import annotations

import random
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import pyarrow as pa

from sparkdl.data.dataset import DatasetInfo, to_expression
from sparkdl.data.inputs import POSITION_KEY
from sparkdl.data.open_files import OpenFiles
from sparkdl.data.shuffled_rows import GatherInto, ShuffledRows
from sparkdl.errors import ConfigError, DataError

#: Row-aligned arrays of some rows (:data:`sparkdl.data.readers.base.Chunk`).
Chunk = Dict[str, np.ndarray]
#: Added to positions before hashing, so the split is not the one other tools derive from
#: hashing plain row numbers.
_SALT = np.uint64(0x9E3779B97F4A7C15)
_ROW_INDEX = "__sparkdl_row__"


def pass_row_groups(num_row_groups: int, rank: int, world_size: int, seed: int, shuffle: bool) -> List[int]:
    """Global row groups rank ``rank`` reads in one pass, in reading order (Petastorm's order)."""
    indexes = list(range(num_row_groups))
    if num_row_groups >= world_size:
        # Petastorm shuffles the list with its seed before sharding (the readers pass it no
        # seed when not shuffling), then keeps the indexes (not positions) of the shard.
        if shuffle:
            random.Random(seed).shuffle(indexes)
        indexes = [i for i in indexes if i % world_size == rank]
    if shuffle:
        # Petastorm's ventilator: RandomState(seed).shuffle of its item list, which permutes a
        # list the same way whatever its items are.
        np.random.RandomState(seed).shuffle(indexes)
    return indexes


def holdout_mask(positions: np.ndarray, fraction: float) -> np.ndarray:
    """True for the positions that belong to the validation hold-out."""
    if fraction <= 0:
        return np.zeros(len(positions), dtype=bool)
    x = positions.astype(np.uint64) + _SALT
    # splitmix64's finalizer: consecutive positions land far apart, so held-out rows are spread
    # evenly over every file and row group.
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return x < np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))


def filter_mask(table: pa.Table, expression) -> np.ndarray:
    """The rows of ``table`` the filter keeps (null counts as false, as in Parquet pushdown)."""
    indexed = table.append_column(_ROW_INDEX, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    kept = indexed.filter(expression).column(_ROW_INDEX).to_numpy()
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[kept] = True
    return mask


class RowSelector:
    """Decides which rows of a row group (or of a run of rows) a rank keeps.

    Args:
        dataset: the dataset.
        holdout: fraction of rows held out for validation.
        part: ``"train"`` keeps the rows that are not held out, ``"holdout"`` only those.
        filters: the row filter, or None.
        rank, world_size: this rank, and the number of ranks.
    """

    def __init__(self, dataset: DatasetInfo, holdout: float, part: str, filters, rank: int, world_size: int) -> None:
        if part not in ("train", "holdout"):
            raise ConfigError(f"part={part!r} must be 'train' or 'holdout'")
        self.striding = dataset.num_row_groups < world_size
        self.holdout = holdout
        self.part = part
        self.expression = to_expression(filters) if filters is not None else None
        if self.expression is not None and not dataset.filter_columns:
            # The readers read dataset.filter_columns to evaluate the filter.
            raise ConfigError("the dataset was inspected without these filters: pass filters= to inspect_dataset too")
        self.rank = rank
        self.world_size = world_size
        rows = np.asarray(dataset.row_group_rows, dtype=np.int64)
        #: First position of every global row group.
        self.starts = np.concatenate([[0], np.cumsum(rows)[:-1]]) if len(rows) else rows
        self.rows = rows
        #: Positions of a table's deleted rows, sorted (None: no row is deleted).
        self.deleted = (
            dataset.layout.deleted_positions([sum(f.row_groups) for f in dataset.files])
            if dataset.layout is not None
            else None
        )

    @property
    def needs_positions(self) -> bool:
        return self.striding or self.holdout > 0 or self.deleted is not None

    def positions(self, row_group: int) -> np.ndarray:
        return np.arange(self.starts[row_group], self.starts[row_group] + self.rows[row_group], dtype=np.int64)

    def live(self, positions: np.ndarray) -> Optional[np.ndarray]:
        """Which ``positions`` are not deleted rows of a table (None: all of them)."""
        if self.deleted is None or not len(positions):
            return None
        low, high = np.searchsorted(self.deleted, [positions.min(), positions.max() + 1])
        return ~np.isin(positions, self.deleted[low:high]) if high > low else None

    def keep(self, positions: Optional[np.ndarray], filter_table: Optional[pa.Table]) -> Optional[np.ndarray]:
        """A boolean mask of the rows to keep, or None to keep them all. ``positions`` are the
        rows' positions (needed when :attr:`needs_positions`), ``filter_table`` their filter
        columns (needed with a filter)."""
        mask: Optional[np.ndarray] = None
        if self.striding:
            mask = (positions % self.world_size) == self.rank
        live = self.live(positions)
        if live is not None:
            mask = live if mask is None else mask & live
        if self.holdout > 0:
            held = holdout_mask(positions, self.holdout)
            part = held if self.part == "holdout" else ~held
            mask = part if mask is None else mask & part
        if self.expression is not None:
            passed = filter_mask(filter_table, self.expression)
            mask = passed if mask is None else mask & passed
        return mask


class PositionCursor:
    """Positions of a stream of rows that is the concatenation of row groups in ``order``
    (Petastorm's ``make_reader`` hands out rows, not row groups)."""

    def __init__(self, selector: RowSelector, order: Sequence[int]) -> None:
        self._selector = selector
        self._order = list(order)
        self._index = 0
        self._offset = 0

    def take(self, count: int) -> np.ndarray:
        out = []
        while count > 0:
            if self._index >= len(self._order):
                raise DataError("the reader returned more rows than the row groups of its shard hold")
            group = self._order[self._index]
            start = self._selector.starts[group] + self._offset
            available = int(self._selector.rows[group]) - self._offset
            taken = min(available, count)
            out.append(np.arange(start, start + taken, dtype=np.int64))
            count -= taken
            self._offset += taken
            if self._offset == self._selector.rows[group]:
                self._index += 1
                self._offset = 0
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class EpochPasses:
    """Makes each epoch of a shuffled stream one pass over the shard, remainder rule aside.

    The stream is pass after pass over the shard, each shuffled within itself (the shuffle
    buffer is emptied at a pass's end), cut into epochs of ``epoch_rows`` rows. When a pass that
    began in an earlier epoch ends inside the epoch in progress, the rows it gave that epoch
    (its last ones) are left out of the next pass: the epoch takes the rest of the shard, not
    those rows again. They return in the pass after. So a shard of ``S >= epoch_rows`` rows
    gives every epoch distinct rows, ``S - epoch_rows`` left out (the rows that open the next
    epoch are the ones the last one left), and a smaller shard gives each row
    ``epoch_rows // S`` or one more times an epoch. A pure function of the rows' positions
    (chunks carry them under ``POSITION_KEY``), so a replay of positions follows it exactly.

    Memory: the positions of the rows a pass gave the epoch in which it may end (8 bytes a row;
    in the first pass, whose length is not known yet, those of each epoch in progress).
    """

    def __init__(self, epoch_rows: int) -> None:
        self.epoch_rows = epoch_rows
        self.served = 0  # rows handed out in batches
        self.pass_start = 0  # the stream position of the current pass's first row
        self.pass_rows: Optional[int] = None  # rows the current pass hands out, once known
        self.shard: Optional[int] = None  # rows of a whole pass (counted in the first)
        self.admitted = 0  # rows of the current pass admitted so far
        self.leave_out = np.zeros(0, dtype=np.int64)  # sorted positions the current pass skips
        self.recent: List[np.ndarray] = []  # this pass's rows in the epoch in progress (recorded when it may end there)
        self.enabled = True  # off for good once a chunk comes without positions

    def admit(self, chunk: Dict[str, np.ndarray]) -> Optional[Dict[str, np.ndarray]]:
        """The chunk without the rows this pass leaves out (None if none is left)."""
        if not self.enabled:
            return chunk
        positions = chunk.get(POSITION_KEY)
        if positions is None:  # a reader that does not tell positions: passes are only flushed
            self.enabled, self.recent, self.leave_out = False, [], self.leave_out[:0]
            return chunk
        if len(self.leave_out) and len(positions):
            low = np.searchsorted(self.leave_out, positions.min(), side="left")
            high = np.searchsorted(self.leave_out, positions.max(), side="right")
            if high > low:
                chunk = _without(chunk, positions, self.leave_out[low:high])
        rows = len(next(iter(chunk.values())))
        self.admitted += rows
        return chunk if rows else None

    def served_batch(self, positions: Optional[np.ndarray], rows: int, earlier: int) -> None:
        """A batch of ``rows`` was handed out; its first ``earlier`` rows belong to earlier passes."""
        start, self.served = self.served, self.served + rows
        if not self.enabled or positions is None:
            return
        if start % self.epoch_rows == 0:
            self.recent = []
        epoch_end = (start // self.epoch_rows + 1) * self.epoch_rows
        if self.pass_rows is None or self.pass_start + self.pass_rows < epoch_end:
            self.recent.append(positions[earlier:])

    def end_pass(self, held: int, held_own: Optional[np.ndarray]) -> None:
        """The pass ended; ``held`` rows are not in a batch yet (they open the next one),
        ``held_own`` the positions of those that belong to this pass."""
        if not self.enabled:
            return
        if self.shard is None:
            self.shard = self.admitted
        end = self.served + held
        epoch_start = end - end % self.epoch_rows
        leave_out = self.leave_out[:0]
        if self.pass_start < epoch_start < end:
            # No batch of the epoch in progress handed out yet: ``recent`` holds the last one's rows.
            parts = (self.recent if self.served > epoch_start else []) + ([held_own] if held_own is not None else [])
            leave_out = np.sort(np.concatenate(parts)) if parts else leave_out
        self.leave_out, self.recent = leave_out, []
        self.pass_start, self.pass_rows, self.admitted = end, self.shard - len(leave_out), 0


def _without(chunk: Chunk, positions: np.ndarray, dropped: np.ndarray) -> Chunk:
    """The chunk without the rows at positions ``dropped`` (sorted, within the chunk's range)."""
    if np.all(positions[1:] > positions[:-1]):  # a row group's rows, in order: a lookup per dropped row
        places = np.searchsorted(positions, dropped)
        places = places[positions[places] == dropped]
        keep = np.ones(len(positions), dtype=bool)
        keep[places] = False
    else:
        keep = ~np.isin(positions, dropped)
    return chunk if keep.all() else {key: values[keep] for key, values in chunk.items()}


def shuffled_batches(
    source: Iterator[Chunk],
    batch_size: int,
    buffer_rows: int,
    rng: np.random.Generator,
    passes: Optional[EpochPasses],
    gather_into: Optional[GatherInto] = None,
) -> Iterator[Chunk]:
    """Batches of ``batch_size`` rows of ``source``'s chunks, shuffled in a bounded buffer:
    whenever ``buffer_rows`` rows are pending they are permuted, full batches are cut and the
    rest stays pending. An empty chunk (``PASS_END``) ends a pass: the pending rows are permuted
    and cut then, and the last of them (fewer than a batch, ``lead``) open the next batch ahead
    of the next pass's rows, so rows of two passes never mix. ``passes`` (positions in the
    chunks) also keeps each epoch one pass (:class:`EpochPasses`).

    With ``gather_into``, each full batch's rows are gathered when it is cut, into the arrays
    it gives when it gives some (a pinned buffer: :class:`~sparkdl.data.shuffled_rows.ShuffledRows`)."""
    pending: List[Chunk] = []
    pending_rows = 0
    lead: Optional[Chunk] = None  # rows a pass left, fewer than a batch: they open the next one
    earlier = 0  # of those, the rows of passes before the last (one shorter than a batch)
    for chunk in source:
        if chunk:
            if passes is not None and (chunk := passes.admit(chunk)) is None:
                continue
            pending.append(chunk)
            pending_rows += _rows(chunk)
            if pending_rows < buffer_rows:
                continue
        shuffled: Optional[ShuffledRows] = None
        if pending:
            shuffled = ShuffledRows(pending, rng.permutation(pending_rows), gather_into)
            pending, pending_rows = [], 0
        start = 0  # the first of the shuffled rows not in a batch yet
        if shuffled is not None and lead is not None:
            need = batch_size - _rows(lead)
            taken = shuffled.take(0, min(need, shuffled.rows))
            head = {key: np.concatenate([lead[key], values]) for key, values in taken.items()}
            if shuffled.rows < need:  # a pass shorter than the batch still needed (only at its end)
                lead, earlier, shuffled = head, _rows(lead), None
            else:
                _served(passes, head, _rows(lead))
                yield head
                lead, start = None, need
        rest = None
        if shuffled is not None:
            full = shuffled.rows - (shuffled.rows - start) % batch_size
            for begin in range(start, full, batch_size):
                batch = shuffled.take(begin, begin + batch_size, into=True)
                _served(passes, batch, 0)
                yield batch
            rest = shuffled.take(full, shuffled.rows) if full < shuffled.rows else None
        if chunk:  # the buffer was full: the rest stays in it
            pending, pending_rows = ([rest], _rows(rest)) if rest is not None else ([], 0)
            continue
        if shuffled is not None:
            lead, earlier = rest, 0
        elif lead is not None:  # the pass gave no row
            earlier = _rows(lead)
        if passes is not None:
            own = lead.get(POSITION_KEY) if lead is not None else None
            passes.end_pass(_rows(lead) if lead is not None else 0, own[earlier:] if own is not None else None)


def _served(passes: Optional[EpochPasses], batch: Chunk, earlier: int) -> None:
    if passes is not None:
        passes.served_batch(batch.get(POSITION_KEY), _rows(batch), earlier)


def _rows(chunk: Chunk) -> int:
    return len(next(iter(chunk.values()))) if chunk else 0


def shard_rows(
    dataset: DatasetInfo, world_size: int, holdout: float = 0.0, part: str = "train", filters=None
) -> List[int]:
    """Rows each rank's shard holds after the filter and hold-out: computed on the driver, so
    that steps per epoch are exact and an empty shard fails before launch.

    Without a filter this is arithmetic on footer row counts (plus hashing positions for a
    hold-out); with one, it reads the filter's columns once, skipping row groups whose
    statistics rule the filter out.
    """
    counts = np.zeros(world_size, dtype=np.int64)
    striding = dataset.num_row_groups < world_size
    rows = dataset.row_group_rows
    deletes = dataset.layout is not None and dataset.layout.deleted_count > 0
    if filters is None and holdout <= 0 and not deletes:
        if striding:
            return [max(0, (dataset.num_rows - r + world_size - 1) // world_size) for r in range(world_size)]
        for g, n in enumerate(rows):
            counts[g % world_size] += n
        return counts.tolist()
    selector = RowSelector(dataset, holdout, part, filters, rank=0, world_size=world_size)
    files = OpenFiles(dataset) if filters is not None else None
    try:
        for g, (file_index, row_group) in enumerate(dataset.row_group_location()):
            positions = selector.positions(g)
            mask = np.ones(len(positions), dtype=bool)
            if holdout > 0:
                held = holdout_mask(positions, holdout)
                mask &= held if part == "holdout" else ~held
            live = selector.live(positions)
            if live is not None:
                mask &= live
            if files is not None and mask.any():
                if files.may_match(file_index, row_group, selector.expression):
                    table = files.read(file_index, row_group, dataset.filter_columns)
                    mask &= filter_mask(table, selector.expression)
                else:
                    mask[:] = False
            if striding:
                counts += np.bincount(positions[mask] % world_size, minlength=world_size)
            else:
                counts[g % world_size] += int(mask.sum())
    finally:
        if files is not None:
            files.close()
    return counts.tolist()
