"""A stream that gathers into pinned buffers has the shuffle buffer gather each batch's rows
when it cuts the batch (sparkdl.data.shuffled_rows.ShuffledRows) instead of permuting the
whole buffer up front: the batches must be exactly the ones the whole-buffer permutation gives
for the same seed (the implementation before the per-batch gather, kept below as the
reference), for every dtype and shape a chunk carries, with passes, leads and leave-outs,
whether the destination gives arrays or not; and a batch gathered into the arrays a destination
gives (a pinned ring's buffer) is those arrays."""

from __future__ import annotations

import itertools
from typing import Dict, Iterator, List, Optional

import numpy as np
import pytest

from sparkdl.data.inputs import LABEL_KEY, POSITION_KEY
from sparkdl.data.readers.base import PASS_END
from sparkdl.data.selection import EpochPasses, shuffled_batches

Chunk = Dict[str, np.ndarray]


def _eager_shuffled_batches(source, batch_size, buffer_rows, rng, passes) -> Iterator[Chunk]:
    """The reference: shuffled_batches as it was before the per-batch gather (the whole buffer
    permuted into one array, batches sliced from it), verbatim but for names."""
    pending: List[Chunk] = []
    pending_rows = 0
    lead: Optional[Chunk] = None
    earlier = 0
    for chunk in source:
        if chunk:
            if passes is not None and (chunk := passes.admit(chunk)) is None:
                continue
            pending.append(chunk)
            pending_rows += _rows(chunk)
            if pending_rows < buffer_rows:
                continue
        merged: Optional[Chunk] = None
        if pending:
            order = rng.permutation(pending_rows)
            merged = (
                {key: values[order] for key, values in pending[0].items()}
                if len(pending) == 1
                else _eager_concatenation(pending, order)
            )
            pending, pending_rows = [], 0
        if merged is not None and lead is not None:
            need = batch_size - _rows(lead)
            head = {key: np.concatenate([lead[key], values[:need]]) for key, values in merged.items()}
            if _rows(merged) < need:
                lead, earlier, merged = head, _rows(lead), None
            else:
                _served(passes, head, _rows(lead))
                yield head
                lead, merged = None, {key: values[need:] for key, values in merged.items()}
        rest = None
        if merged is not None:
            full = _rows(merged) - _rows(merged) % batch_size
            for start in range(0, full, batch_size):
                batch = {key: values[start : start + batch_size] for key, values in merged.items()}
                _served(passes, batch, 0)
                yield batch
            rest = {key: values[full:] for key, values in merged.items()} if full < _rows(merged) else None
        if chunk:
            pending, pending_rows = ([rest], _rows(rest)) if rest is not None else ([], 0)
            continue
        if merged is not None:
            lead, earlier = rest, 0
        elif lead is not None:
            earlier = _rows(lead)
        if passes is not None:
            own = lead.get(POSITION_KEY) if lead is not None else None
            passes.end_pass(_rows(lead) if lead is not None else 0, own[earlier:] if own is not None else None)


def _served(passes, batch, earlier) -> None:
    if passes is not None:
        passes.served_batch(batch.get(POSITION_KEY), _rows(batch), earlier)


def _rows(chunk) -> int:
    return len(next(iter(chunk.values()))) if chunk else 0


def _eager_concatenation(chunks, order):
    places = np.empty_like(order)
    places[order] = np.arange(len(order))
    merged = {}
    for key in chunks[0]:
        parts = [chunk[key] for chunk in chunks]
        values = np.empty((len(order),) + parts[0].shape[1:], dtype=np.result_type(*parts))
        start = 0
        for part in parts:
            values[places[start : start + len(part)]] = part
            start += len(part)
        merged[key] = values
    return merged


def _passes(groups: List[int], count: int, seed: int, mixed_ids: bool) -> Iterator[Chunk]:
    """``count`` passes over a shard of row groups of ``groups`` rows, each pass in a shuffled
    group order and followed by PASS_END; every row carries what a chunk may: its position,
    an int64 label, float32 features, uint8 NHWC pixels, a Python object, and (``mixed_ids``)
    ids stored int32 in some row groups and int64 in others."""
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(groups)[:-1]])
    for _ in range(count):
        for group in rng.permutation(len(groups)):
            positions = np.arange(starts[group], starts[group] + groups[group], dtype=np.int64)
            chunk = {
                POSITION_KEY: positions,
                "features": np.stack([positions, -positions, positions * 0.5], 1).astype(np.float32),
                "pixels": (positions[:, None, None, None] + np.arange(60).reshape(1, 4, 5, 3)).astype(np.uint8),
                "note": np.array([f"row {p}" for p in positions], dtype=object),
                LABEL_KEY: positions % 3,
            }
            if mixed_ids:
                chunk["ids"] = positions.astype(np.int32 if group % 2 else np.int64)
            yield chunk
        yield PASS_END


def _same(got: Chunk, want: Chunk) -> None:
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert np.array_equal(got[key], want[key]), key


class Destination:
    """Hands out fresh arrays to gather into (as a pinned ring's buffer would), recording them;
    ``refuse`` answers None (no buffer: the rows are gathered into new arrays)."""

    def __init__(self, refuse: bool = False) -> None:
        self.given: List[Chunk] = []
        self.refuse = refuse

    def __call__(self, shapes) -> Optional[Chunk]:
        assert POSITION_KEY not in shapes  # positions stay the stream's own (EpochPasses keeps them)
        if self.refuse:
            return None
        arrays = {key: np.full(shape, 77, dtype) for key, (shape, dtype) in shapes.items()}
        self.given.append(arrays)
        return arrays


CASES = {
    # groups of rows, batch size, buffer rows (a multiple of the batch), epoch rows
    "groups-beyond-the-buffer": ([300, 40, 17, 5, 100, 64, 64], 32, 96, 512),
    "groups-within-the-buffer": ([7, 11, 13, 9, 3, 20], 8, 40, 48),
    "one-group": ([250], 16, 32, 224),
    "batch-beyond-the-shard": ([5, 6, 4], 32, 64, 32),
}


@pytest.mark.parametrize("gather", ["whole-buffer", "per-batch", "per-batch-into-given-arrays"])
@pytest.mark.parametrize("mixed_ids", [False, True], ids=["one-dtype", "int32-and-int64-ids"])
@pytest.mark.parametrize("with_passes", [True, False], ids=["epoch-passes", "no-passes"])
@pytest.mark.parametrize("case", list(CASES))
def test_batches_are_those_of_the_whole_buffer_permuted_at_once(case, with_passes, mixed_ids, gather):
    groups, batch, buffer_rows, epoch_rows = CASES[case]
    destination = {
        "whole-buffer": None,
        "per-batch": Destination(refuse=True),
        "per-batch-into-given-arrays": Destination(),
    }[gather]
    for seed in (0, 1, 7):
        want = list(
            _eager_shuffled_batches(
                _passes(groups, 4, seed, mixed_ids),
                batch,
                buffer_rows,
                np.random.default_rng(seed),
                EpochPasses(epoch_rows) if with_passes else None,
            )
        )
        got = list(
            shuffled_batches(
                _passes(groups, 4, seed, mixed_ids),
                batch,
                buffer_rows,
                np.random.default_rng(seed),
                EpochPasses(epoch_rows) if with_passes else None,
                destination,
            )
        )
        assert len(got) == len(want) >= max(1, 2 * sum(groups) // batch)
        for got_batch, want_batch in zip(got, want):
            _same(got_batch, want_batch)


@pytest.mark.parametrize("refuse", [False, True], ids=["given-arrays", "refused"])
def test_a_full_batch_is_gathered_into_the_arrays_given_and_equals_the_pageable_one(refuse):
    groups, batch, buffer_rows, epoch_rows = CASES["groups-beyond-the-buffer"]
    numeric = lambda chunks: ({k: v for k, v in c.items() if k != "note"} if c else c for c in chunks)  # noqa: E731
    want = list(
        shuffled_batches(
            numeric(_passes(groups, 3, 5, True)), batch, buffer_rows, np.random.default_rng(5), EpochPasses(epoch_rows)
        )
    )
    destination = Destination(refuse)
    got = list(
        shuffled_batches(
            numeric(_passes(groups, 3, 5, True)),
            batch,
            buffer_rows,
            np.random.default_rng(5),
            EpochPasses(epoch_rows),
            destination,
        )
    )
    assert len(got) == len(want)
    given = {id(arrays["features"]): arrays for arrays in destination.given}  # filled with 77 when given
    gathered = 0
    for got_batch, want_batch in zip(got, want):
        _same(got_batch, want_batch)
        arrays = given.get(id(got_batch["features"]))
        if arrays is not None:
            assert all(got_batch[key] is arrays[key] for key in arrays)  # written in place, no other array
            gathered += 1
    # Every batch but those a pass's lead opens (concatenated: new arrays), 2 in 3 passes.
    assert gathered == len(destination.given) == (0 if refuse else len(got) - 2)


def test_a_batch_gathered_from_two_chunks_keeps_every_row_in_its_place():
    """Rows of the rest of one chunk and of the next one mixed in one batch."""
    rest = {"x": np.arange(5, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)}
    chunk = {"x": (100 + np.arange(27, dtype=np.float32))[:, None] * np.ones((1, 3), np.float32)}
    got = list(shuffled_batches(iter([rest, chunk]), 8, 8, np.random.default_rng(3), None))
    order = np.random.default_rng(3).permutation(32)
    want = np.concatenate([rest["x"], chunk["x"]])[order]
    assert np.array_equal(np.concatenate([b["x"] for b in got]), want)
    assert sum(1 for b in got if (b["x"][:, 0] < 100).any() and (b["x"][:, 0] >= 100).any()) >= 1
    assert list(itertools.chain.from_iterable(b["x"].shape for b in got)) == [8, 3] * 4
