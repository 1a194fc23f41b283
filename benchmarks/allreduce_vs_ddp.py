"""Throughput of sparkdl AllReduce against plain DDP on in-memory tensors, same machine, same run.

    .venv/bin/python benchmarks/allreduce_vs_ddp.py [--rows 200000] [--epochs 3]

Both sides train the same MLP with the same per-worker batch, 2 workers, 1 thread each, gloo.
sparkdl streams the data from Parquet (Arrow and Petastorm readers) inside Spark barrier tasks
(local-cluster[2,1,2048]); the baseline is a torch.multiprocessing DDP script holding its shard
in memory. Prints steady-state samples/s (epochs after the first), their ratio, and start-up
time (fit called → first batch on rank 0). A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HIDDEN = 256
FEATURES = 64
CLASSES = 10


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def synthetic(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=rows)
    features = centers[labels] + rng.normal(scale=2.0, size=(rows, FEATURES)).astype(np.float32)
    return features, labels.astype(np.int64)


def write_parquet(path: str, features, labels, row_group: int = 8192) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path, exist_ok=True)
    offsets = pa.array(np.arange(0, len(features) * FEATURES + 1, FEATURES, dtype=np.int32))
    values = pa.ListArray.from_arrays(offsets, pa.array(features.reshape(-1)))
    table = pa.table({"features": values, "label": labels})
    pq.write_table(table, os.path.join(path, "part-0.parquet"), row_group_size=row_group)


def run_sparkdl(path: str, batch: int, epochs: int, readers=("arrow", "petastorm")):
    from _spark import local_cluster

    import sparkdl

    spark = local_cluster("sparkdl-benchmark-allreduce", executor_memory_mb=2048)
    results = []
    try:
        # The first fit of a new Spark application starts the executors' Python workers ("cold");
        # the steady-state figures come from later fits, one per reader.
        for attempt, reader in [("cold", readers[0])] + [("warm", r) for r in readers]:
            estimator = sparkdl.TorchEstimator(
                model=make_model, optimizer=make_optimizer, num_workers=2, batch_size=batch,
                epochs=epochs if attempt == "warm" else 1, progress=False, reader=reader,
            )
            called = time.time()
            model = estimator.fit(path)
            info = model.run_info
            results.append((attempt, reader, model.history, info["prepare_seconds"] + info["startup_seconds"], time.time() - called))
    finally:
        spark.stop()
    return results


def _ddp_worker(rank: int, world: int, port: int, features, labels, batch: int, epochs: int, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    optimizer = make_optimizer(model.parameters())
    x = torch.from_numpy(features[rank::world].copy())
    y = torch.from_numpy(labels[rank::world].copy())
    steps = len(labels) // (batch * world)
    generator = torch.Generator().manual_seed(rank)
    rates = []
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        dist.barrier()
        start = time.time()
        for step in range(steps):
            index = order[step * batch:(step + 1) * batch]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        dist.barrier()
        rates.append(steps * batch * world / (time.time() - start))
    if rank == 0:
        out.put(rates)
    dist.destroy_process_group()


def run_ddp(features, labels, batch: int, epochs: int):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_ddp_worker, args=(2, port, features, labels, batch, epochs, queue), nprocs=2, start_method="spawn")
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    features, labels = synthetic(args.rows)
    workdir = tempfile.mkdtemp(prefix="sparkdl-bench-")
    try:
        path = os.path.join(workdir, "data")
        write_parquet(path, features, labels)
        spark_runs = run_sparkdl(path, args.batch_size, args.epochs)
        ddp_rates = run_ddp(features, labels, args.batch_size, args.epochs)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    _, _, _, cold_startup, _ = spark_runs[0]
    ddp_rate = float(np.mean(ddp_rates[1:] or ddp_rates))
    params = sum(p.numel() for p in make_model().parameters())
    print(f"\nrows={args.rows} features={FEATURES} model=MLP({params} params) workers=2 batch/worker={args.batch_size} epochs={args.epochs}")
    print("| run | steady samples/s | ratio to DDP | start-up (fit called → first batch) |")
    print("|---|---:|---:|---:|")
    print(f"| plain DDP, in-memory tensors (torch.multiprocessing) | {ddp_rate:,.0f} | 1.00 | – |")
    for attempt, reader, history, startup, _ in spark_runs[1:]:
        rate = float(np.mean([r["samples_per_sec"] for r in history[1:]] or [history[0]["samples_per_sec"]]))
        print(
            f"| sparkdl AllReduce, Parquet via the {reader} reader, Spark barrier tasks | {rate:,.0f} | {rate / ddp_rate:.2f} "
            f"| {cold_startup:.1f} s first fit of the app, {startup:.1f} s this fit |"
        )


if __name__ == "__main__":
    main()
