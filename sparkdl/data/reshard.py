"""Resharding the data of an interrupted epoch: finishing on M ranks an epoch that N ranks began, every row exactly once.

An epoch on N ranks is a fixed number of steps, and each rank's stream is a pure function of
the seed, the rank and N (:mod:`sparkdl.data.selection`, :func:`sparkdl.data.batching.cut_stream`).
So the rows old rank ``i`` still had to take in the interrupted epoch — its batches from its
checkpointed ``batches_taken`` to the epoch's end — are computed by replaying its stream with
positions only (no column is read, except a filter's columns to evaluate it): the same passes,
pass ends and one-pass epochs of the checkpoint's ``steps_per_epoch`` as the real stream
(:func:`~sparkdl.data.selection.shuffled_batches`).

On an N -> M resume every new rank computes the same remainder R (the union over the old ranks;
a multiset: a rank whose shard wraps around within an epoch has some rows twice, as it would
have had), orders it (seeded: row groups shuffled, then rows within windows of
``shuffle_buffer_batches`` batches, as the stream does), cuts it into M contiguous shares of
equal size ± 1 row, and splits its share into the same number of steps on every rank (batches
of ``batch_size`` rows, give or take one). It reads exactly those rows (the row groups that hold
them, through the Arrow reader's code), finishes the epoch, then continues with a fresh M-rank
stream positioned as if the run had had M ranks from the start (so later epochs are those of
an M-rank run). A checkpoint taken while such an epoch runs records the rank's share and how
many of its batches were taken (:class:`~sparkdl.checkpoint.RankState`), so a second resume, on
the same or another M, continues from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from sparkdl.data.batching import Batch, cut_stream, finish_batch, steps_per_epoch
from sparkdl.data.batching import epoch_rows as _epoch_rows
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.inputs import POSITION_KEY
from sparkdl.data.open_files import OpenFiles
from sparkdl.data.readers.base import PASS_END, Chunk
from sparkdl.data.selection import RowSelector, pass_row_groups, shard_rows
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError, DataError

#: The one column of the position-only chunks a replay cuts (the key the readers put positions under).
_POSITIONS = POSITION_KEY


@dataclasses.dataclass(frozen=True)
class StreamState:
    """Where one old rank's data stream was at a checkpoint (its :class:`RankState` fields).

    Attributes:
        batches_taken: batches the rank took from its stream.
        epoch_start: the stream's batch index where the current epoch began (None in
            checkpoints of earlier versions: the last multiple of ``steps_per_epoch``).
        steps_per_epoch: steps per epoch of the run that wrote it.
        remaining: in an epoch that is itself a resumed remainder, the rank's share of it in
            reading order; ``remaining_steps`` batches of it, ``remaining_taken`` taken.
    """

    batches_taken: int
    epoch_start: Optional[int]
    steps_per_epoch: int
    remaining: Optional[np.ndarray] = None
    remaining_steps: int = 0
    remaining_taken: int = 0


@dataclasses.dataclass
class Remainder:
    """This rank's part of the interrupted epoch on the new number of ranks."""

    share: np.ndarray  # positions, in reading order
    steps: int  # batches of it every rank runs (0: nothing left of the epoch)
    taken: int  # batches of it taken so far
    next_start: int  # the fresh stream's first batch index once it is done

    def batches(self) -> List[np.ndarray]:
        """The positions of each of its batches."""
        return np.array_split(self.share, self.steps) if self.steps else []


def position_pass(
    dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int, pass_index: int, files: Optional[OpenFiles]
) -> Iterator[Chunk]:
    """The positions of the rows one reader pass hands out, one chunk per row group — exactly
    the chunks :class:`~sparkdl.data.readers.arrow.ArrowReader` yields, positions only."""
    selector = RowSelector(dataset, spec.holdout, spec.part, spec.filters, rank, world_size)
    locations = dataset.row_group_location()
    for group in pass_row_groups(dataset.num_row_groups, rank, world_size, spec.seed + pass_index, spec.shuffle):
        if dataset.row_group_rows[group] == 0:
            continue
        file_index, row_group = locations[group]
        filter_table = None
        if selector.expression is not None:
            if not files.may_match(file_index, row_group, selector.expression):
                continue
            filter_table = files.read(file_index, row_group, dataset.filter_columns)
        positions = selector.positions(group)
        keep = selector.keep(positions, filter_table)
        if keep is not None:
            positions = positions[keep]
        if len(positions):
            yield {_POSITIONS: positions}


def stream_positions(
    dataset: DatasetInfo,
    spec: DataSpec,
    rank: int,
    world_size: int,
    start: int,
    stop: int,
    epoch_rows: Optional[int] = None,
) -> List[np.ndarray]:
    """The positions of batches ``start..stop-1`` of rank ``rank``'s stream among ``world_size``,
    whose epochs are ``epoch_rows`` rows (default: as :func:`~sparkdl.data.batching.batches` counts them)."""
    files = OpenFiles(dataset) if spec.filters is not None else None
    if epoch_rows is None and spec.shuffle:
        epoch_rows = _epoch_rows(dataset, spec, world_size)

    def source() -> Iterator[Chunk]:
        for pass_index in itertools.count():
            rows = 0
            for chunk in position_pass(dataset, spec, rank, world_size, pass_index, files):
                rows += len(chunk[_POSITIONS])
                yield chunk
            if rows == 0:
                raise DataError(f"rank {rank} of {world_size} reads no rows from its shard of {dataset.name}")
            yield PASS_END

    out: List[np.ndarray] = []
    cuts = cut_stream(source(), spec, rank, epoch_rows)
    try:
        for index, chunk in enumerate(cuts):
            if index >= stop:
                break
            if index >= start:
                out.append(chunk[_POSITIONS])
    finally:
        cuts.close()
        if files is not None:
            files.close()
    return out


def rows_left(dataset: DatasetInfo, spec: DataSpec, old: Sequence[StreamState]) -> Tuple[np.ndarray, int]:
    """The interrupted epoch's rows no old rank took yet (a multiset of positions, unordered),
    and the index of the epoch after it (0-based: the number of epochs then done)."""
    world_size = len(old)
    parts: List[np.ndarray] = []
    next_epochs = set()
    for rank, state in enumerate(old):
        steps = state.steps_per_epoch
        if state.remaining is not None:
            batches = (
                np.array_split(np.asarray(state.remaining, dtype=np.int64), state.remaining_steps)
                if state.remaining_steps
                else []
            )
            parts.extend(batches[state.remaining_taken :])
            next_epochs.add(state.batches_taken // steps)
            continue
        start = (
            state.epoch_start if state.epoch_start is not None else state.batches_taken - state.batches_taken % steps
        )
        parts.extend(
            stream_positions(
                dataset, spec, rank, world_size, state.batches_taken, start + steps, steps * spec.batch_size
            )
        )
        next_epochs.add(start // steps + 1)
    if len(next_epochs) != 1:
        raise ValueError(
            f"the checkpoint's ranks are in different epochs ({sorted(next_epochs)}): it cannot be resharded"
        )
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return rows.astype(np.int64, copy=False), next_epochs.pop()


def order_rows(dataset: DatasetInfo, spec: DataSpec, rows: np.ndarray, world_size: int, epoch_index: int) -> np.ndarray:
    """The remainder's reading order, the same on every new rank: by position without shuffle;
    with it, row groups in a seeded order and rows mixed within windows of
    ``shuffle_buffer_batches`` batches (so each rank's contiguous share spans few row groups)."""
    ordered = np.sort(rows, kind="stable")
    if not spec.shuffle or len(ordered) == 0:
        return ordered
    rng = np.random.default_rng([spec.seed, world_size, epoch_index, 0xE1A5])
    groups = _groups_of(dataset, ordered)
    distinct = np.unique(groups)
    rank_of = np.empty(int(distinct.max()) + 1, dtype=np.int64)
    rank_of[distinct] = rng.permutation(len(distinct))
    ordered = ordered[np.argsort(rank_of[groups], kind="stable")]
    window = spec.batch_size * spec.shuffle_buffer_batches
    for low in range(0, len(ordered), window):
        ordered[low : low + window] = ordered[low : low + window][rng.permutation(len(ordered[low : low + window]))]
    return ordered


def plan_remainder(
    dataset: DatasetInfo,
    spec: DataSpec,
    old: Sequence[StreamState],
    rank: int,
    world_size: int,
    new_steps_per_epoch: int,
) -> Remainder:
    """Rank ``rank``'s part of the interrupted epoch when ``len(old)`` ranks resume as ``world_size``.

    Raises:
        ConfigError: fewer rows are left than new workers (a rank would have an empty batch).
    """
    rows, next_epoch = rows_left(dataset, spec, old)
    next_start = next_epoch * new_steps_per_epoch
    if len(rows) == 0:
        return Remainder(np.zeros(0, dtype=np.int64), 0, 0, next_start)
    if len(rows) < world_size:
        raise ConfigError(
            f"the interrupted epoch has {len(rows)} row(s) left, fewer than num_workers={world_size}: "
            f"resume it on at most {len(rows)} workers (or on the {len(old)} that wrote the checkpoint)"
        )
    ordered = order_rows(dataset, spec, rows, world_size, next_epoch)
    shares = np.array_split(ordered, world_size)
    # As many steps on every rank, so no rank waits in a collective for another; the smallest
    # share sets it, so no batch is empty and none holds more than batch_size + 1 rows.
    steps = max(1, math.ceil(min(len(s) for s in shares) / spec.batch_size))
    return Remainder(shares[rank].copy(), steps, 0, next_start)


def remainder_batches(dataset: DatasetInfo, spec: DataSpec, remainder: Remainder, rank: int) -> Iterator[Batch]:
    """The finished batches of ``remainder`` not taken yet, reading only the row groups that hold
    its rows, each once (kept while a later batch still needs it)."""
    parts = remainder.batches()[remainder.taken :]
    groups = [_groups_of(dataset, part) for part in parts]
    last_use = {}
    for index, part_groups in enumerate(groups):
        for group in np.unique(part_groups).tolist():
            last_use[group] = index
    starts = _starts(dataset)
    locations = dataset.row_group_location()
    files = OpenFiles(dataset)
    loaded: dict = {}
    plan = dataset.plan
    try:
        for index, (part, part_groups) in enumerate(zip(parts, groups)):
            order = np.argsort(part_groups, kind="stable")
            pieces: List[Chunk] = []
            for group in np.unique(part_groups).tolist():
                if group not in loaded:
                    loaded[group] = _load(dataset, files, locations, starts, group)
                local = part[order][part_groups[order] == group] - starts[group]
                pieces.append({key: values[local] for key, values in loaded[group].items()})
            merged = {key: np.concatenate([piece[key] for piece in pieces]) for key in pieces[0]}
            back = np.empty_like(order)
            back[order] = np.arange(len(order))
            arrays = {key: values[back] for key, values in merged.items()}
            for group in [g for g, last in last_use.items() if last == index]:
                loaded.pop(group, None)
            batch_index = remainder.taken + index
            augment = np.random.default_rng([spec.seed, rank, 0xE1A5, batch_index]) if plan.augments else None
            yield finish_batch(plan, arrays, augment, spec.transform_fn, dataset.locate)
    finally:
        files.close()


def _load(dataset: DatasetInfo, files: OpenFiles, locations, starts: np.ndarray, group: int) -> Chunk:
    file_index, row_group = locations[group]
    table = files.read(file_index, row_group, dataset.columns)
    positions = np.arange(starts[group], starts[group] + table.num_rows, dtype=np.int64)
    source = dataset.origin or f"row group {row_group} of file {files.urls[file_index]!r}"
    return dataset.plan.extract({c: table.column(c) for c in dataset.columns}, dataset.infos, source, positions)


def _starts(dataset: DatasetInfo) -> np.ndarray:
    rows = np.asarray(dataset.row_group_rows, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(rows)[:-1]]) if len(rows) else rows


def _groups_of(dataset: DatasetInfo, positions: np.ndarray) -> np.ndarray:
    return np.searchsorted(_starts(dataset), positions, side="right") - 1


def check_reader(reader_name: str, why: str = "") -> None:
    """Elastic resume reads through the Arrow reader's code: a reader that is not
    ``reshardable`` (Petastorm's, a user's own unless it subclasses the Arrow reader) refuses it.
    ``why``: what would need it, for the message (default: resuming on another worker count)."""
    from sparkdl.data.readers import reader_class

    if not reader_class(reader_name).reshardable:
        raise ConfigError(
            f"reader={reader_name!r} cannot resume a checkpoint on a different number of workers{why}: its rows are "
            f"not the Arrow reader's in its order (DataReader.reshardable is False); use reader='arrow' or a reader that "
            f"subclasses it, or keep the num_workers the checkpoint was written with"
        )


def steps_for(dataset: DatasetInfo, spec: DataSpec, num_workers: int) -> int:
    """Steps per epoch on ``num_workers`` ranks (the driver's computation for a smaller relaunch).

    Raises:
        DataError: a rank's shard would hold no rows.
    """
    counts = shard_rows(dataset, num_workers, spec.holdout, "train", spec.filters)
    empty = [rank for rank, rows in enumerate(counts) if rows == 0]
    if empty:
        raise DataError(
            f"on {num_workers} workers the shard of rank(s) {empty} in {dataset.name} holds no rows (rows per rank: {counts})"
        )
    return steps_per_epoch(sum(counts), spec.batch_size, num_workers)


StepsFor = Callable[[int], int]
