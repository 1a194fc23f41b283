"""A rank's stream position (sparkdl._runtime.stream): what a checkpoint records of it is what a
resume restores, including an elastic resume's epoch in progress."""

from __future__ import annotations

import numpy as np

from sparkdl._runtime.stream import StreamPosition, stream_state
from sparkdl.data.batching import STREAM_ORDER
from sparkdl.data.reshard import Remainder


def test_an_epoch_begins_where_the_stream_is_less_the_steps_already_done():
    position = StreamPosition(batches_taken=23)
    position.begin_epoch(skip=3)
    assert position.epoch_start == 20
    position.take()
    assert position.get() == 24


def test_checkpoint_fields_read_back_restore_the_same_position():
    position = StreamPosition(batches_taken=17, epoch_start=12)
    fields = position.checkpoint_fields(None, steps_per_epoch=6)
    assert fields == {"epoch_start": 12, "steps_per_epoch": 6}
    restored = StreamPosition()
    restored.restore(stream_state(17, fields, None))
    assert (restored.batches_taken, restored.epoch_start, restored.remainder) == (17, 12, None)


def test_a_resharded_epoch_in_progress_survives_a_checkpoint():
    share = np.arange(40, 60, dtype=np.int64)
    position = StreamPosition(
        batches_taken=30, epoch_start=30, remainder=Remainder(share, steps=5, taken=2, next_start=30)
    )
    fields = position.checkpoint_fields(None, steps_per_epoch=10)
    restored = StreamPosition()
    restored.restore(stream_state(30, fields, None))
    assert restored.remainder is not None
    assert np.array_equal(restored.remainder.share, share) and (restored.remainder.steps, restored.remainder.taken) == (
        5,
        2,
    )


def test_a_finished_resharded_epoch_is_not_restored():
    share = np.arange(4, dtype=np.int64)
    fields = StreamPosition(8, 8, Remainder(share, steps=2, taken=2, next_start=8)).checkpoint_fields(None, 4)
    restored = StreamPosition()
    restored.restore(stream_state(8, fields, None))
    assert restored.remainder is None and restored.epoch_start == 8


def test_checkpoints_of_earlier_versions_start_the_epoch_at_the_last_whole_epoch():
    restored = StreamPosition()
    restored.restore(stream_state(14, {}, default_steps=5))
    assert restored.epoch_start == 10


def test_a_position_on_data_records_its_fingerprint_and_stream_order():
    class Data:
        fingerprint = "abc123"

    fields = StreamPosition().checkpoint_fields(Data(), 3)
    assert fields["data"] == "abc123" and fields["order"] == STREAM_ORDER


def test_skipping_the_rest_of_an_epoch_happens_once():
    position = StreamPosition(end_epoch_early=True)
    assert position.skips_epoch() is True and position.skips_epoch() is False
