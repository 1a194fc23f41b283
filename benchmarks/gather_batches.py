"""What a batch of a cached epoch costs the host before its copy to the device: the shuffle
buffer's gather and, on CUDA, the write into the pinned ring, per batch. No Spark, no reader.

    .venv/bin/python benchmarks/gather_batches.py [--rounds 5] [--batches 2000]

The chunks are what the shard cache serves after the first pass (row groups of about 25 MB,
already in memory, the same arrays every pass), cut by the training stream's shuffle buffer
(:func:`sparkdl.data.selection.shuffled_batches`, its default buffer of 8 batches) into batches
of two shapes: 64 x 784 float32 (dense features) and 256 x 64 x 64 x 3 uint8 (images as the
shard cache keeps them decoded); both with an int64 label. Four paths:

* **pageable, whole buffer**: the whole buffer permuted into one copy, batches sliced from it,
  then ``to_tensors``: what a CPU task does (before and after the per-batch gather);
* **pageable, per batch**: each batch's rows gathered into a new array when it is cut (what a
  CPU task would do with the per-batch gather: the reason it does not);
* **ring, copied**: the whole-buffer batches written into the ring, one copy each: what a CUDA
  task did before the per-batch gather (and does for plans whose finishing makes new arrays);
* **ring, gathered**: each batch's rows gathered straight into a ring buffer and handed out as
  they are: what a CUDA task does now with dense inputs and plain columns.

The ring's buffers are ordinary host memory here (pinned ones change no host copy). The figure
is the training thread's CPU time per batch (``time.thread_time``: other tenants of a shared
machine mostly do not count), min and median over rounds; the paths alternate within a round.
A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from typing import Dict, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparkdl._runtime.pinned_ring import BatchRing  # noqa: E402
from sparkdl.data.batching import to_tensors  # noqa: E402
from sparkdl.data.inputs import LABEL_KEY  # noqa: E402
from sparkdl.data.selection import shuffled_batches  # noqa: E402

#: name -> (batch size, row shape, dtype)
SHAPES = {
    "64 x 784 float32": (64, (784,), np.float32),
    "256 x 64x64x3 uint8": (256, (64, 64, 3), np.uint8),
}
PATHS = ["pageable, whole buffer", "pageable, per batch", "ring, copied", "ring, gathered"]
CHUNK_BYTES = 25 << 20


def cached_chunks(row_shape, dtype) -> Iterator[Dict[str, np.ndarray]]:
    """Endless passes over two cached row groups of about CHUNK_BYTES each."""
    rows = CHUNK_BYTES // (int(np.prod(row_shape)) * np.dtype(dtype).itemsize)
    rng = np.random.default_rng(0)
    groups = [
        {"x": rng.integers(0, 100, (rows,) + row_shape).astype(dtype), LABEL_KEY: np.arange(rows) % 10}
        for _ in range(2)
    ]
    return itertools.cycle(groups)


def per_batch_us(path: str, batch: int, row_shape, dtype, count: int) -> float:
    """CPU microseconds per batch of ``path`` (one of :data:`PATHS`)."""
    ring = BatchRing(lambda n: torch.empty(n, dtype=torch.uint8), lambda s: True, lambda s: None, buffers=7)
    gather_into = {"pageable, per batch": lambda shapes: None, "ring, gathered": ring.gather_arrays}.get(path)
    stream = shuffled_batches(
        cached_chunks(row_shape, dtype), batch, batch * 8, np.random.default_rng(1), None, gather_into
    )
    to_host = ring.fill if path.startswith("ring") else to_tensors
    for _ in range(50):  # warm: buffers allocated, the row groups touched
        ring.release(to_host(_finished(next(stream))))
    start = time.thread_time()
    for _ in range(count):
        ring.release(to_host(_finished(next(stream))))
    return (time.thread_time() - start) / count * 1e6


def _finished(arrays):
    """Finishing a plan of plain columns: the arrays handed on as they are."""
    return arrays["x"], arrays[LABEL_KEY]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=2000, help="per round and path (an eighth for images)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name, (batch, row_shape, dtype) in SHAPES.items():
        count = args.batches if batch == 64 else max(1, args.batches // 8)
        figures: Dict[str, list] = {path: [] for path in PATHS}
        for _ in range(args.rounds):
            for path in PATHS:
                figures[path].append(per_batch_us(path, batch, row_shape, dtype, count))
        print(f"{name} (CPU us per batch, min / median of {args.rounds} rounds):")
        for path, values in figures.items():
            print(f"  {path:24s} {min(values):7.1f} / {statistics.median(values):7.1f}")


if __name__ == "__main__":
    main()
