"""The ring of reusable host buffers a CUDA task's prefetch thread writes batches into
(sparkdl._runtime.pinned_ring), run on the CPU with the allocator and the "free again" signal
injected: plain ``torch.empty`` buffers and test copies that read host memory only when they
complete, as an asynchronous GPU copy does. A buffer written again too early would show up as
a copy reading another batch's values."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import tracemalloc
from typing import Any, Deque, Dict, List, Optional

import numpy as np
import pytest
import torch

from sparkdl._runtime.device_feed import DeviceFeed
from sparkdl._runtime.host_batches import InlineBatches, Prefetcher, host_batches
from sparkdl._runtime.pinned_ring import BatchRing
from sparkdl.data.batching import batches, to_tensors
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.inputs import LABEL_KEY
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers.arrow import ArrowReader
from sparkdl.data.selection import shuffled_batches
from sparkdl.data.spec import DataSpec
from tests.models import png_bytes
from tests.unit.test_arrow_reader import write_ids
from tests.unit.test_shard_cache_images import _cached as with_cache
from tests.unit.test_shard_cache_images import _info as image_info
from tests.unit.test_shard_cache_images import _write as write_images


@pytest.fixture(scope="module")
def id_rows(tmp_path_factory):
    """590 rows carrying their ids, in 7 uneven row groups."""
    return write_ids(tmp_path_factory.mktemp("ids"), [[300, 40, 17, 5], [100], [64, 64]])


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    """64 PNGs of 10 x 12 pixels, RGB and grayscale, 16 a row group."""
    rng = np.random.default_rng(4)
    shapes = [(10, 12, 3), (10, 12)]
    pictures = [png_bytes(rng.integers(0, 256, shapes[i % 2], dtype=np.uint8)) for i in range(64)]
    return write_images(tmp_path_factory.mktemp("pngs"), pictures)


def _finished_batches(count: int, batch_size: int, last: int, seed: int = 0):
    """Finished batches as ``batching.finish_batch`` makes them: named inputs (images as
    channels-last float NCHW, float features, a bool mask), int64 labels; the last one has
    ``last`` rows."""
    rng = np.random.default_rng(seed)
    for index in range(count):
        rows = last if index == count - 1 else batch_size
        pixels = rng.integers(0, 256, (rows, 6, 5, 3), dtype=np.uint8)
        images = pixels.transpose(0, 3, 1, 2).astype(np.float32) * np.float32(1 / 255)
        inputs = {
            "image": images,
            "pixels": pixels,
            "features": rng.standard_normal((rows, 7)).astype(np.float32),
            "mask": rng.random((rows, 4)) < 0.5,
        }
        yield inputs, rng.integers(0, 10, rows)


def _stream(*parts):
    """A reader's stream (a generator: the prefetch thread closes it) of ``parts`` in order."""
    yield from itertools.chain(*parts)


def _same(got: Any, expected: Any) -> bool:
    """Same values, dtypes, shapes and strides (a batch, a dict of named tensors, a tensor)."""
    if isinstance(expected, tuple):
        return len(got) == len(expected) and all(_same(a, b) for a, b in zip(got, expected))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_same(got[name], expected[name]) for name in expected)
    if expected is None or got is None:
        return got is expected
    return got.dtype == expected.dtype and got.stride() == expected.stride() and torch.equal(got, expected)


class Allocations:
    """Plain host buffers in place of pinned ones, counted; ``fail`` makes allocating raise as
    ``cudaHostAlloc`` does when page-locked memory runs out."""

    def __init__(self, fail: bool = False) -> None:
        self.sizes: List[int] = []
        self.fail = fail

    def __call__(self, nbytes: int) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


class Copy:
    """A pending copy's signal: done once the copy has read its host memory."""

    def __init__(self) -> None:
        self.done = False


def _ring(buffers: int, allocate: Optional[Allocations] = None, max_bytes: int = 1 << 30, waited=None) -> BatchRing:
    def wait(signal: Copy) -> None:  # a CUDA event's synchronize: the copy ends
        if waited is not None:
            waited.append(signal)
        signal.done = True

    return BatchRing(allocate or Allocations(), lambda s: s is None or s.done, wait, buffers, max_bytes)


def _key(batch) -> int:
    inputs = batch[0]
    return (next(iter(inputs.values())) if isinstance(inputs, dict) else inputs).untyped_storage().data_ptr()


def test_the_ring_hands_out_the_batches_to_tensors_gives_including_a_smaller_last_one():
    ring = _ring(buffers=2)
    count = 0
    for batch in _finished_batches(25, batch_size=8, last=3):
        filled = ring.fill(batch)
        assert _same(filled[0], to_tensors(batch)[0]) and _same(filled[1], to_tensors(batch)[1])
        assert filled[0]["image"].stride() == (90, 1, 15, 3)  # channels-last stays channels-last
        ring.release(filled)
        count += 1
    assert count == 25
    stats = ring.stats()
    assert stats["filled_batches"] == 25 and stats["pageable_batches"] == 0 and stats["buffers"] == 1


def test_a_buffer_is_written_again_only_after_its_batch_was_released_and_its_copy_is_done(caplog):
    allocate, waited = Allocations(), []
    ring = _ring(buffers=2, allocate=allocate, waited=waited)
    batches = list(_finished_batches(5, batch_size=4, last=4))
    first, second = ring.fill(batches[0]), ring.fill(batches[1])
    assert _key(first) != _key(second) and len(allocate.sizes) == 2
    with caplog.at_level(logging.WARNING, logger="sparkdl.train"):
        third = ring.fill(batches[2])  # both buffers lent and not released: never overwritten
    assert _same(first[0], to_tensors(batches[0])[0]) and _same(second[0], to_tensors(batches[1])[0])
    assert np.shares_memory(third[0]["features"].numpy(), batches[2][0]["features"])  # pageable: no copy
    assert "pageable" in caplog.text and ring.stats()["pageable_batches"] == 1
    copy = Copy()
    ring.release(first, copy)  # a copy still reads it: the next fill waits for that copy
    fourth = ring.fill(batches[3])
    assert waited == [copy] and _key(fourth) == _key(first) and _same(fourth[0], to_tensors(batches[3])[0])
    ring.release(third)  # a pageable batch: not the ring's, ignored
    ring.release(second, Copy())
    ring.release(fourth, None)  # read by nothing: free at once, no wait
    assert _key(ring.fill(batches[4])) == _key(first) and len(waited) == 1 and len(allocate.sizes) == 2


def test_a_larger_batch_replaces_a_free_buffer_too_small_and_the_bytes_stay_bounded(caplog):
    allocate = Allocations()
    ring = _ring(buffers=2, allocate=allocate, max_bytes=4096)
    small = ({"x": np.ones((4, 8), np.float32)}, None)
    large = ({"x": np.full((16, 8), 2.0, np.float32)}, None)
    ring.release(ring.fill(small))
    filled = ring.fill(large)  # the small buffer is free but too small: replaced, not kept beside it
    assert allocate.sizes == [128, 512] and ring.stats()["held_bytes"] == 512 and _same(filled, to_tensors(large))
    ring.release(filled)
    ring.release(ring.fill(small))  # fits the large one: no allocation
    assert allocate.sizes == [128, 512]
    huge = ({"x": np.zeros((200, 8), np.float32)}, np.zeros(200, np.int64))
    with caplog.at_level(logging.WARNING, logger="sparkdl.train"):
        out = ring.fill(huge)
        ring.fill(huge)
    assert np.shares_memory(out[0]["x"].numpy(), huge[0]["x"]) and ring.stats()["held_bytes"] == 512
    assert caplog.text.count("pageable") == 1 and "limit of 4,096 bytes" in caplog.text


def test_when_pinning_fails_batches_are_pageable_said_once_and_nothing_is_retried(caplog):
    allocate = Allocations(fail=True)
    ring = _ring(buffers=3, allocate=allocate)
    with caplog.at_level(logging.WARNING, logger="sparkdl.train"):
        for batch in _finished_batches(4, batch_size=4, last=2):
            filled = ring.fill(batch)
            assert _same(filled[0], to_tensors(batch)[0]) and _same(filled[1], to_tensors(batch)[1])
            ring.release(filled)
    assert caplog.text.count("pageable") == 1 and "cudaHostAlloc" in caplog.text
    assert ring.stats()["pageable_batches"] == 4 and ring.stats()["buffers"] == 0


def test_a_positional_batch_without_labels_round_trips():
    ring = _ring(buffers=1)
    features = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]  # not contiguous: laid out anew
    filled = ring.fill((features, None))
    assert filled[1] is None and filled[0].is_contiguous() and torch.equal(filled[0], torch.from_numpy(features))


class LateCopier:
    """A copier whose copies read the host batch only when they complete, as a GPU far behind
    the host does: the training stream waiting for a copy (``finish``) tells the host nothing,
    a copy completes only when the ring waits for it (a CUDA event's ``synchronize``) or at
    :meth:`drain`, every copy started before it too, in order."""

    def __init__(self) -> None:
        self.pending: Deque[Dict[str, Any]] = collections.deque()
        self.lock = threading.Lock()
        self.reading: Dict[int, int] = collections.Counter()  # buffer -> copies reading it

    def start(self, batch):
        copy = {"host": batch, "signal": Copy(), "moved": {}}
        with self.lock:
            self.pending.append(copy)
            self.reading[_key(batch)] += 1
            assert self.reading[_key(batch)] == 1, "a buffer was handed out while a copy still reads it"
        return copy["moved"], copy["signal"]

    def finish(self, moved, signal) -> None:
        pass  # the GPU's training stream waits for the copy; the host is not told

    def complete(self, signal: Copy) -> None:
        with self.lock:
            while not signal.done:
                copy = self.pending.popleft()
                inputs, labels = copy["host"]
                inputs = {k: v.clone() for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.clone()
                copy["moved"].update(inputs=inputs, labels=labels.clone() if labels is not None else None)
                self.reading[_key(copy["host"])] -= 1
                copy["signal"].done = True

    def drain(self) -> None:
        if self.pending:
            self.complete(self.pending[-1]["signal"])


def test_through_the_device_feed_every_batch_reaches_its_copy_intact_and_no_buffer_is_lent_twice():
    copier = LateCopier()
    ring = BatchRing(Allocations(), lambda s: s is None or s.done, copier.complete, buffers=7)
    count = 60
    # A training stream never ends (DeviceFeed polls past the batch it hands out): after the
    # smaller batch, full ones again.
    source = _stream(_finished_batches(count, 16, last=5, seed=3), _finished_batches(10**9, 16, 16, seed=4))
    feed = DeviceFeed(Prefetcher(source, pin=False, ring=ring), torch.device("cuda", 0), copier=copier)
    try:
        moved = [feed.next() for _ in range(count)]
        stats = feed.ring_stats()
    finally:
        feed.close()
    copier.drain()
    for got, expected in zip(moved, _finished_batches(count, batch_size=16, last=5, seed=3)):
        assert _same((got["inputs"], got["labels"]), to_tensors(expected))
    assert stats["filled_batches"] >= count and stats["pageable_batches"] == 0
    assert stats["waits"] > 0 and 1 <= stats["buffers"] <= 7  # buffers were reused, each after its copy


@pytest.mark.parametrize("skip", [0, 7], ids=["from-the-start", "resumed"])
@pytest.mark.parametrize("data", ["images", "dense", "positional"])
def test_later_epochs_from_the_shard_cache_reach_the_copy_exactly_as_the_cpu_path_hands_them_out(
    data, skip, pngs, id_rows
):
    """The real pipeline (Arrow reader, shard cache, shuffle buffer, decode threads, crops and
    flips), wired as a CUDA task is (the stream gathers into the ring): three passes through
    the ring and a late copier equal the CPU path's batches. Dense batches are gathered
    straight into the ring's buffers (all but the one each pass's lead opens); decoded images
    are made by finishing, and copied in. A resume's skipped batches give their buffers back."""
    if data == "images":
        info = image_info(pngs, random_crop=2, random_flip=True, mean=0.5, std=0.25)
        spec, count = DataSpec(batch_size=8, seed=9, shuffle_buffer_batches=2, decode_threads=2), 3 * 64 // 8
    else:
        named = InputPlan.from_inputs({"id": ["id"], "vec": "vec"}, "label")  # two inputs: a dict
        info = inspect_dataset(id_rows, named) if data == "dense" else inspect_dataset(id_rows, ["id", "vec"], "label")
        spec, count = DataSpec(batch_size=32, seed=5, shuffle_buffer_batches=3), 3 * 590 // 32
    spec = with_cache(spec)
    inline = InlineBatches(batches(ArrowReader(), info, spec, 0, 1, skip=skip))
    try:
        expected = [inline.next() for _ in range(count)]
    finally:
        inline.close()
    copier = LateCopier()
    ring = BatchRing(Allocations(), lambda s: s is None or s.done, copier.complete, buffers=7)
    stream = batches(ArrowReader(), info, spec, 0, 1, skip=skip, gather_into=ring.gather_arrays)
    feed = DeviceFeed(Prefetcher(stream, pin=False, ring=ring), torch.device("cuda", 0), copier=copier)
    try:
        moved = [feed.next() for _ in range(count)]
        stats = feed.ring_stats()
    finally:
        feed.close()
    copier.drain()
    for got, wanted in zip(moved, expected):
        assert _same((got["inputs"], got["labels"]), wanted)
    assert stats["pageable_batches"] == 0 and stats["filled_batches"] >= count and stats["buffers"] <= 7
    if data == "images":
        assert stats["gathered_batches"] == 0
    else:  # the first pass's batches too: the pipeline gathers from the reader's chunks alike
        assert stats["gathered_batches"] >= stats["filled_batches"] - 4


def _chunk(rows: int, start: int = 0) -> Dict[str, np.ndarray]:
    """A chunk as a shard cache holds one: float features, uint8 NHWC pixels (images kept
    decoded), int64 labels; every value tells its row."""
    ids = np.arange(start, start + rows)
    return {
        "features": (ids[:, None] * np.ones((1, 784))).astype(np.float32),
        "pixels": (ids[:, None, None, None] + np.arange(48).reshape(1, 4, 4, 3)).astype(np.uint8),
        LABEL_KEY: ids % 10,
    }


def _finished(arrays: Dict[str, np.ndarray]):
    """What finishing does to a plan of plain columns: hands the arrays on as they are."""
    return {"features": arrays["features"], "pixels": arrays["pixels"]}, arrays[LABEL_KEY]


def _shuffled(chunks, gather_into=None):
    return shuffled_batches(iter(chunks), 64, 256, np.random.default_rng(11), None, gather_into)


def test_a_batch_gathered_into_the_ring_is_handed_out_from_its_buffer_as_gathered():
    allocate = Allocations()
    ring = _ring(buffers=3, allocate=allocate)
    chunks = [_chunk(300), _chunk(500, 300)]
    expected = [to_tensors(_finished(arrays)) for arrays in _shuffled(chunks)]
    count = 0
    for arrays, wanted in zip(_shuffled(chunks, ring.gather_arrays), expected):
        filled = ring.fill(_finished(arrays))
        assert _same(filled, wanted)
        # The tensors are the gathered arrays, in a ring buffer (whose start releasing finds).
        assert all(np.shares_memory(filled[0][name].numpy(), arrays[name]) for name in ("features", "pixels"))
        assert np.shares_memory(filled[1].numpy(), arrays[LABEL_KEY])
        assert {t.untyped_storage().data_ptr() for t in (*filled[0].values(), filled[1])} == {_key(filled)}
        ring.release(filled)
        count += 1
    assert count == len(expected) == 800 // 64
    stats = ring.stats()
    assert stats["gathered_batches"] == stats["filled_batches"] == count and stats["pageable_batches"] == 0
    assert len(allocate.sizes) == 1  # one buffer, reused


def test_gathering_into_the_ring_makes_no_pageable_batch_on_the_way():
    """numpy's allocations, traced over a stream's first batches: the pageable path permutes
    the buffer (1,000 rows, about 3 MB) into new memory, the ring path makes no array of rows
    (they go straight into the ring's buffer; only the permutation's indexes are new)."""
    chunks = [_chunk(1000)]
    ring = _ring(buffers=2)

    def peak(batches) -> int:
        tracemalloc.start()
        try:
            for _ in range(3):
                ring.release(ring.fill(_finished(next(batches))))
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    batch_bytes = 64 * (784 * 4 + 48 + 8)
    assert peak(_shuffled(chunks)) >= 1000 * 784 * 4
    assert peak(_shuffled(chunks, ring.gather_arrays)) < batch_bytes // 5
    assert ring.stats()["gathered_batches"] == 3


@pytest.mark.parametrize("fallback", ["pinning-fails", "byte-limit", "all-buffers-held"])
def test_when_the_ring_has_no_buffer_the_rows_are_gathered_pageable_and_hand_out_the_same_batches(fallback, caplog):
    ring = {
        "pinning-fails": lambda: _ring(buffers=3, allocate=Allocations(fail=True)),
        "byte-limit": lambda: _ring(buffers=3, max_bytes=4096),
        "all-buffers-held": lambda: _ring(buffers=1),
    }[fallback]()
    chunks = [_chunk(200), _chunk(300, 200)]
    expected = [to_tensors(_finished(arrays)) for arrays in _shuffled(chunks)]
    kept = []
    with caplog.at_level(logging.WARNING, logger="sparkdl.train"):
        for arrays, wanted in zip(_shuffled(chunks, ring.gather_arrays), expected):
            filled = ring.fill(_finished(arrays))
            assert _same(filled, wanted)
            kept.append(filled)  # never released: a held buffer is never written again
            if fallback != "all-buffers-held":
                ring.release(filled)
    for filled, wanted in zip(kept, expected):
        assert _same(filled, wanted)
    stats = ring.stats()
    pageable = len(expected) - (1 if fallback == "all-buffers-held" else 0)
    assert stats["pageable_batches"] == pageable and stats["gathered_batches"] == len(expected) - pageable
    assert caplog.text.count("pageable") == 1


def test_arrays_gathered_for_a_batch_that_never_comes_give_their_buffer_back():
    ring = _ring(buffers=1)
    shapes = {"x": ((4, 3), np.dtype(np.float32)), "y": ((4,), np.dtype(np.int64))}
    first = ring.gather_arrays(shapes)
    second = ring.gather_arrays(shapes)  # the first batch was dropped (a resume skips it)
    assert first is not None and second is not None and np.shares_memory(first["x"], second["x"])
    other = ({"x": np.ones((4, 3), np.float32)}, np.zeros(4, np.int64))
    filled = ring.fill(other)  # not the gathered arrays: copied, into the same (only) buffer
    assert _same(filled, to_tensors(other)) and np.shares_memory(filled[0]["x"].numpy(), second["x"])
    assert ring.gather_arrays({"s": ((4,), np.dtype(object))}) is None  # strings have no tensor
    stats = ring.stats()
    assert (stats["filled_batches"], stats["gathered_batches"], stats["buffers"]) == (1, 0, 1)


def test_cpu_tasks_get_no_ring_and_cuda_prefetchers_one_that_allocates_nothing_until_a_batch():
    inline = host_batches(_stream(), torch.device("cpu"))
    assert inline.ring_stats() is None
    inline.close()
    unpinned = host_batches(_stream(), torch.device("cuda", 0), pin=False)  # a framework moves batches itself
    pinned = Prefetcher(_stream(), pin=True, device=torch.device("cuda", 0))
    try:
        assert unpinned.ring_stats() is None
        # Made without touching CUDA (this torch has none: its thread fails at set_device).
        assert pinned.ring_stats() == {
            "memory": "pinned",
            "filled_batches": 0,
            "gathered_batches": 0,
            "pageable_batches": 0,
            "waits": 0,
            "buffers": 0,
            "held_bytes": 0,
        }
    finally:
        unpinned.close()
        pinned.close()


@pytest.mark.parametrize("buffers", [0, -1])
def test_a_ring_needs_a_buffer(buffers):
    with pytest.raises(ValueError, match="at least one buffer"):
        _ring(buffers=buffers)
