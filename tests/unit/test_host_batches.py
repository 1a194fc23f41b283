"""Where batches become host tensors (sparkdl._runtime.host_batches): the training thread itself on the
CPU, a prefetch thread on CUDA; both hand out the same batches."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from sparkdl._runtime.host_batches import InlineBatches, Prefetcher, host_batches


def _numbered(count: int, seen_by=None):
    try:
        for index in range(count):
            if seen_by is not None:
                seen_by.append(threading.current_thread())
            yield np.full((2, 3), index, np.float32), np.full(2, index, np.int64)
    finally:
        if seen_by is not None:
            seen_by.append("closed")


def test_on_the_cpu_batches_are_converted_in_the_training_thread_without_copying():
    seen = []
    stream = host_batches(_numbered(3, seen), torch.device("cpu"))
    assert isinstance(stream, InlineBatches)
    assert seen == []  # nothing is read ahead: no thread runs
    features, labels = stream.next()
    assert seen == [threading.current_thread()]
    assert isinstance(features, torch.Tensor) and features.sum() == 0 and labels.tolist() == [0, 0]
    assert [stream.poll()[1][0].item(), stream.next()[1][0].item()] == [1, 2]
    assert not [thread for thread in threading.enumerate() if thread.name == "sparkdl-prefetch"]
    with pytest.raises(StopIteration, match="the data stream ended"):
        stream.next()
    stream.close()
    assert seen[-1] == "closed"


def test_a_reader_error_raises_where_the_batch_is_taken_and_close_ends_the_reader():
    def failing():
        yield np.zeros((1, 2), np.float32), None
        raise OSError("row group 3 of part-0.parquet: unreadable")

    stream = InlineBatches(failing())
    assert stream.next()[1] is None
    with pytest.raises(OSError, match="row group 3"):
        stream.next()
    seen = []
    stream = InlineBatches(_numbered(5, seen))
    stream.next()
    stream.close()
    assert seen[-1] == "closed"


def test_inline_and_prefetched_streams_hand_out_the_same_batches():
    inline = InlineBatches(_numbered(6))
    prefetched = Prefetcher(_numbered(6), pin=False, device=torch.device("cpu"))
    try:
        for _ in range(6):
            (a, a_labels), (b, b_labels) = inline.next(), prefetched.next()
            assert torch.equal(a, b) and torch.equal(a_labels, b_labels)
    finally:
        inline.close()
        prefetched.close()


def test_on_cuda_a_prefetch_thread_pins_batches_ahead():
    stream = host_batches(_numbered(2), torch.device("cuda", 0))
    try:
        assert isinstance(stream, Prefetcher) and stream._pin and stream._thread.name == "sparkdl-prefetch"
    finally:
        stream.close()
