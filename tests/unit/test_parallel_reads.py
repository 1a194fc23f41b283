"""The Arrow reader's decode workers: several row groups read and decoded at once
(``DataSpec.decode_threads``), with exactly the batches, in exactly the order, of one worker:
shuffled or not, from Parquet or the shard cache, resumed with ``skip=``; and every thread and
file released on close."""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import pytest

from sparkdl.data import selection
from sparkdl.data.batching import batches, steps_per_epoch
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers import arrow
from sparkdl.data.readers.arrow import ArrowReader
from sparkdl.data.readers.base import chunk_rows
from sparkdl.data.shard_cache import Decision
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError
from tests.unit.test_arrow_reader import write_ids

#: 12 row groups of uneven sizes (777 rows) in 3 files.
ROW_GROUPS = [[90, 40, 17, 5, 64], [100, 33, 128], [64, 64, 150, 22]]
BATCH = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("parallel") / "ids")
    write_ids(path, ROW_GROUPS)
    return inspect_dataset(path, ["id", "vec"], "label")


def _cache(enabled: bool):
    return Decision("memory", 1 << 30, 0, 1 << 30, "test") if enabled else None


def _take(dataset, spec: DataSpec, count: int, skip: int = 0):
    steps = steps_per_epoch(dataset.num_rows, spec.batch_size, 1)
    stream = batches(ArrowReader(), dataset, spec, 0, 1, skip=skip, epoch_steps=steps)
    try:
        return [next(stream) for _ in range(count)]
    finally:
        stream.close()


def _ids(taken):
    return [features[:, 0].astype(int).tolist() for features, _ in taken]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("workers", [2, 5])
def test_decode_workers_give_one_workers_batches_in_its_order(dataset, shuffle, cached, workers):
    """Three epochs (the later ones from the cache when it is on): the same rows, features and
    labels, batch for batch; a resumed stream (``skip=``) goes on with the same batches too."""
    epochs = 3 * steps_per_epoch(dataset.num_rows, BATCH, 1)
    one = DataSpec(batch_size=BATCH, seed=7, shuffle=shuffle, decode_threads=1, shard_cache=_cache(cached))
    several = DataSpec(batch_size=BATCH, seed=7, shuffle=shuffle, decode_threads=workers, shard_cache=_cache(cached))
    expected = _take(dataset, one, epochs)
    got = _take(dataset, several, epochs)
    assert _ids(got) == _ids(expected)
    for (features, labels), (want_features, want_labels) in zip(got, expected):
        np.testing.assert_array_equal(features, want_features)
        np.testing.assert_array_equal(labels, want_labels)
    # An epoch has every row once (a sanity check that the comparison saw real epochs).
    first_epoch = sorted(itertools.chain.from_iterable(_ids(got[: epochs // 3])))
    assert len(set(first_epoch)) == len(first_epoch)
    resumed = _take(dataset, several, 10, skip=epochs // 3 + 2)
    assert _ids(resumed) == _ids(expected[epochs // 3 + 2 : epochs // 3 + 12])


def _record_concurrency(monkeypatch, wanted: int):
    """Patches the reads to count how many run at once; each read waits (bounded) until
    ``wanted`` have been in flight together, so that reads that could overlap do."""
    state = {"active": 0, "most": 0}
    changed = threading.Condition()
    original = selection.OpenFiles.read

    def counting(self, index, row_group, columns):
        with changed:
            state["active"] += 1
            state["most"] = max(state["most"], state["active"])
            changed.notify_all()
            changed.wait_for(lambda: state["most"] >= wanted, timeout=10.0)
        try:
            return original(self, index, row_group, columns)
        finally:
            with changed:
                state["active"] -= 1

    monkeypatch.setattr(selection.OpenFiles, "read", counting)
    return state


@pytest.mark.parametrize("workers", [1, 3])
def test_decode_workers_read_that_many_row_groups_at_once(dataset, monkeypatch, workers):
    state = _record_concurrency(monkeypatch, workers)
    spec = DataSpec(batch_size=BATCH, shuffle=False, decode_threads=workers)
    rows = sum(chunk_rows(chunk) for chunk in ArrowReader().read_pass(dataset, spec, 0, 1, 0))
    assert rows == dataset.num_rows
    assert state["most"] == workers  # that many at once, and never more


def _files_open_under(root: str):
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root + os.sep):
            held.append(target)
    return sorted(held)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to list open files")
def test_closing_releases_every_reading_threads_files_and_threads(dataset):
    root = os.path.dirname(dataset.files[0].url.replace("file://", ""))
    before_threads = set(threading.enumerate())
    before_files = _files_open_under(root)
    stream = ArrowReader().chunks(dataset, DataSpec(batch_size=BATCH, decode_threads=4), 0, 1)
    taken = [next(stream) for _ in range(len(ROW_GROUPS[0]) + len(ROW_GROUPS[1]))]
    assert all(chunk_rows(chunk) for chunk in taken)
    assert len(_files_open_under(root)) > len(before_files)  # the threads opened files of their own
    stream.close()
    started = [t for t in threading.enumerate() if t not in before_threads]
    for thread in started:
        thread.join(timeout=10)
    assert not [t.name for t in started if t.is_alive()], "reading threads left running after close()"
    assert _files_open_under(root) == before_files, "files of a reading thread left open after close()"


def test_the_read_ahead_covers_every_decode_worker_unless_set():
    assert DataSpec(batch_size=1, decode_threads=1).read_ahead() == 2
    assert DataSpec(batch_size=1, decode_threads=6).read_ahead() == 6
    assert DataSpec(batch_size=1, decode_threads=6, prefetch_row_groups=1).read_ahead() == 1
    with pytest.raises(ConfigError, match="prefetch_row_groups=0"):
        DataSpec(batch_size=1, prefetch_row_groups=0)


def test_a_cached_row_group_is_read_once_though_the_read_ahead_reaches_it_again_in_flight(tmp_path, monkeypatch):
    """Three row groups, five in flight: the next pass's row groups are asked for while this
    pass's reads of them still run; they wait for those reads instead of reading again."""
    path = str(tmp_path / "three")
    write_ids(path, [[40, 24, 32]])
    small = inspect_dataset(path, ["id", "vec"], "label")
    counts: dict = {}
    lock = threading.Lock()
    original = selection.OpenFiles.read

    def counting(self, index, row_group, columns):
        with lock:
            counts[(index, row_group)] = counts.get((index, row_group), 0) + 1
        return original(self, index, row_group, columns)

    monkeypatch.setattr(selection.OpenFiles, "read", counting)
    spec = DataSpec(batch_size=8, seed=1, decode_threads=4, prefetch_row_groups=4, shard_cache=_cache(True))
    stream = ArrowReader().chunks(small, spec, 0, 1)
    try:
        rows = sum(chunk_rows(next(stream)) for _ in range(5 * 3))
    finally:
        stream.close()
    assert rows == 5 * small.num_rows
    assert counts == {(0, 0): 1, (0, 1): 1, (0, 2): 1}


def test_the_read_ahead_stays_within_its_bytes_unless_set(dataset, monkeypatch):
    """One row group in flight per decode thread, unless that many of the largest row groups
    would take more than READ_AHEAD_BYTES decoded (then as many as fit, two at least)."""
    largest = max(dataset.row_group_bytes)
    assert arrow.in_flight(dataset, DataSpec(batch_size=1, decode_threads=6)) == 7
    monkeypatch.setattr(arrow, "READ_AHEAD_BYTES", 4 * largest)
    assert arrow.in_flight(dataset, DataSpec(batch_size=1, decode_threads=6)) == 5
    monkeypatch.setattr(arrow, "READ_AHEAD_BYTES", 1)
    assert arrow.in_flight(dataset, DataSpec(batch_size=1, decode_threads=6)) == 3
    assert arrow.in_flight(dataset, DataSpec(batch_size=1, decode_threads=6, prefetch_row_groups=5)) == 6
    spec = DataSpec(batch_size=BATCH, shuffle=False, decode_threads=6)
    assert sum(chunk_rows(chunk) for chunk in ArrowReader().read_pass(dataset, spec, 0, 1, 0)) == dataset.num_rows
