"""A sparse table's server side alone: the memory a rank spends per row it holds, and the time
of one pull and one push of a batch of ids.

    .venv/bin/python benchmarks/sparse_rows.py [--rows 1000000] [--dim 16] [--batch 4096]

What is measured: one :class:`~sparkdl.strategies.parameter_server.sparse_shard.SparseShard`
(rank 0 of 1, Adagrad), in this process, without Spark, sockets or a model: the store the
server keeps its rows in and the row-wise optimizer.

* ``bytes/row``: the growth of this process's RSS (``VmRSS`` in ``/proc/self/status``) while
  ``--rows`` rows are created (pulled for the first time, ``--batch`` new ids at a time),
  divided by the rows. The values and Adagrad's sums alone are ``2 x dim x 4`` bytes a row
  (128 at dim 16); the rest is the store's index and its spare capacity.
* ``pull`` / ``push``: the median time of one pull (rows read) and one push (Adagrad applied to
  the rows) of ``--batch`` distinct ids drawn uniformly from the rows held, over ``--repeats``
  batches.

A script that prints figures, not a test; the machine may be shared, so read the medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from sparkdl.strategies.parameter_server.rows import RowOptimizer  # noqa: E402
from sparkdl.strategies.parameter_server.sparse_shard import SparseShard, SparseSpec  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = SparseSpec(0, "bench", 1 << 40, args.dim, torch.float32, 0, 0.01, RowOptimizer("adagrad", lr=0.1))
    shard = SparseShard(spec, 0, 1, None, 60.0)
    # Ids spread over a wide range (as hashed categorical ids are), not 0..rows-1.
    ids = torch.randperm(args.rows, generator=torch.Generator().manual_seed(0)) * 7919 + 13
    shard.pull(ids[: args.batch], 0, -1)  # the store's first allocations and torch's kernels
    before = rss_bytes()
    for start in range(args.batch, args.rows, args.batch):
        shard.pull(ids[start : start + args.batch], 0, -1)
    grown = rss_bytes() - before
    per_row = grown / (args.rows - args.batch)
    generator = torch.Generator().manual_seed(1)
    pulls, pushes = [], []
    grads = torch.randn(args.batch, args.dim, generator=generator)
    for clock in range(args.repeats):
        batch = ids[torch.randperm(args.rows, generator=generator)[: args.batch]]
        start = time.perf_counter()
        shard.pull(batch, 0, -1)
        pulls.append(time.perf_counter() - start)
        start = time.perf_counter()
        shard.push(0, clock, batch, grads)
        pushes.append(time.perf_counter() - start)
    print(
        f"{datetime.date.today()} rows={shard.rows_held} dim={args.dim} adagrad: "
        f"RSS +{grown / 2**20:.1f} MiB = {per_row:.0f} bytes/row "
        f"(values + sums: {2 * args.dim * 4}); batch of {args.batch} ids: "
        f"pull {statistics.median(pulls) * 1e3:.2f} ms, push {statistics.median(pushes) * 1e3:.2f} ms (medians of {args.repeats})"
    )


if __name__ == "__main__":
    main()
