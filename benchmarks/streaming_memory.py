"""Memory and speed of a rank's data path on a dataset of several GB against one 1/8 its size,
streaming and with the shard cache, measured side by side in one run.

    .venv/bin/python benchmarks/streaming_memory.py [--gb 3] [--epochs 2]

Writes two Parquet datasets of the same rows' shape (64 float32 features as Spark's list<float>,
an int64 label; row groups of 65,536 rows): LARGE of ``--gb`` GB decoded and SMALL of 1/8 of it.
Each is trained for ``--epochs`` epochs by ``sparkdl.run`` on local-cluster[2,1,2048] (two
one-core executors) with a data-bound loop (a ``Linear(64, 10)``, batch 1024 per rank), once per
``shard_cache`` setting. Every rank reports its process's resident memory before its first batch
and its largest resident memory during the run (sampled every 20 steps: the Python workers are
reused between runs, so the process's own high-water mark would carry an earlier run's), and its
epochs' samples/s.

What it shows: streaming, a rank's peak resident memory does not grow with the dataset (the
read-ahead row groups and the shuffle buffer are all it holds); ``shard_cache="auto"`` keeps the
small shard (it fits half a task's memory) and streams the large one (it does not), so the large
dataset's memory stays bounded either way; and the speed per sample of the large dataset against
the small one. This machine is shared: compare the ratios.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FEATURES, CLASSES, ROW_GROUP, BATCH = 64, 10, 65_536, 1024


def write(path: str, rows: int) -> None:
    """``rows`` rows in row groups of ROW_GROUP, written a row group at a time (bounded memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    schema = pa.schema([("features", pa.list_(pa.float32())), ("label", pa.int64())])
    with pq.ParquetWriter(os.path.join(path, "part-0.parquet"), schema) as writer:
        for start in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - start)
            values = rng.normal(size=n * FEATURES).astype(np.float32)
            offsets = pa.array(np.arange(0, n * FEATURES + 1, FEATURES, dtype=np.int32))
            features = pa.ListArray.from_arrays(offsets, pa.array(values))
            labels = pa.array(rng.integers(0, CLASSES, size=n))
            writer.write_table(
                pa.table({"features": features, "label": labels}, schema=schema), row_group_size=ROW_GROUP
            )


def _resident_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def train(ctx, epochs: int) -> List[Dict]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = ctx.prepare_model(torch.nn.Linear(FEATURES, CLASSES))
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    before = peak = _resident_kb("VmRSS")
    rates = []
    for _ in range(epochs):
        start = time.perf_counter()
        for step, (x, y) in enumerate(ctx.epoch_batches()):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if step % 20 == 0:  # this run's peak: the worker process (reused) has a lifetime high-water mark
                peak = max(peak, _resident_kb("VmRSS"))
        rates.append(ctx.steps_per_epoch * BATCH / (time.perf_counter() - start))
    mine = {
        "rank": ctx.rank,
        "rss_before_mb": before / 1024,
        "peak_rss_mb": max(peak, _resident_kb("VmRSS")) / 1024,
        "rates": rates,
        "cache": ctx.shard_cache_stats(),
    }
    everyone: List = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=3.0, help="the large dataset's decoded size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--settings", default="none,auto", help="shard_cache settings to run, comma-separated")
    args = parser.parse_args()
    row_bytes = FEATURES * 4 + 8
    large_rows = int(args.gb * 1e9 / row_bytes) // ROW_GROUP * ROW_GROUP
    sizes = {"large": large_rows, "small": large_rows // 8}
    workdir = tempfile.mkdtemp(prefix="sparkdl-streaming-")
    results: Dict = {}
    try:
        for name, rows in sizes.items():
            started = time.time()
            write(os.path.join(workdir, name), rows)
            print(
                f"wrote {name}: {rows:,} rows ({rows * row_bytes / 1e9:.2f} GB decoded) in {time.time() - started:.0f} s"
            )
        from _spark import local_cluster

        import sparkdl

        spark = local_cluster("sparkdl-benchmark-streaming", executor_memory_mb=2048)
        try:
            for setting in [s.strip() for s in args.settings.split(",") if s.strip()]:
                for name in sizes:
                    results[(setting, name)] = sparkdl.run(
                        functools.partial(train, epochs=args.epochs),
                        num_workers=2,
                        data=os.path.join(workdir, name),
                        feature_cols=["features"],
                        label_col="label",
                        batch_size=BATCH,
                        shard_cache=setting,
                        progress=False,
                        spark=spark,
                    )
        finally:
            spark.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    import pyspark
    import torch

    print(
        f"\nlarge {sizes['large']:,} rows ({sizes['large'] * row_bytes / 1e9:.2f} GB decoded), small {sizes['small']:,} "
        f"(1/8); Linear({FEATURES}, {CLASSES}), batch {BATCH}/rank, 2 ranks, {args.epochs} epochs; "
        f"pyspark={pyspark.__version__} torch={torch.__version__}"
    )
    print(
        "| shard_cache | dataset | rank RSS before (MB) | rank peak RSS in the run (MB) | kept in memory (MB) | samples/s epoch 1 | samples/s later |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for (setting, name), ranks in results.items():
        before = max(r["rss_before_mb"] for r in ranks)
        peak = max(r["peak_rss_mb"] for r in ranks)
        kept = max((r["cache"] or {}).get("held_bytes", 0) for r in ranks) / 1e6
        first = sum(r["rates"][0] for r in ranks) / len(ranks) * 2
        later = sum(np.mean(r["rates"][1:] or r["rates"]) for r in ranks) / len(ranks) * 2
        print(f"| {setting} | {name} | {before:,.0f} | {peak:,.0f} | {kept:,.0f} | {first:,.0f} | {later:,.0f} |")
    print()
    for setting in {s for s, _ in results}:
        large, small = results[(setting, "large")], results[(setting, "small")]
        # Absolute peaks in the run: a reused worker keeps the heap an earlier run grew, so
        # "peak - before" of the first run would count the Python process's own warm-up.
        growth = max(r["peak_rss_mb"] for r in large) - max(r["peak_rss_mb"] for r in small)
        speed = np.mean([np.mean(r["rates"]) for r in large]) / np.mean([np.mean(r["rates"]) for r in small])
        print(
            f"shard_cache={setting}: a rank's peak RSS with 8x the data: {growth:+,.0f} MB; "
            f"speed per sample large/small {speed:.2f}"
        )


if __name__ == "__main__":
    main()
