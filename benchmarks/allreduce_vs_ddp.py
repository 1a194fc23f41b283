"""Throughput and whole-call time of sparkdl AllReduce against the peers a user would pick instead:
plain DDP on in-memory tensors, and PySpark's own ``TorchDistributor``. Same machine, same run,
same Parquet, same model, same per-worker batch, 2 workers, 1 thread each, gloo.

    .venv-petastorm/bin/python benchmarks/allreduce_vs_ddp.py [--rows 200000] [--epochs 3]
    .venv/bin/python benchmarks/allreduce_vs_ddp.py --readers arrow      # no petastorm in .venv
    ... [--dataframe] [--repeats 5] [--skip-distributor] [--plain-in-executors] [--shard-cache none,auto]

Configurations (the issue's three):

    --model mlp --batch-size 64                   compute-bound (the defaults)
    --model mlp --batch-size 256 --rows 300000    the MLP with a data-bound-ish batch
    --model linear --batch-size 1024 --rows 300000  data-bound: Linear(64, 10)

The sides, one table row each:

* plain DDP: a ``torch.multiprocessing`` script, 2 spawned processes, each holding its shard
  (rows ``r::2``) as tensors in memory; the floor for what training costs on this machine.
* TorchDistributor: ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run``
  on the same Spark session. It starts a barrier job of 2 tasks, each of which launches
  ``torchrun`` (one node per task, one process per node); the function, cloudpickled and run by
  torchrun, loads its rank's contiguous half of the rows (the row groups that overlap it) from
  the same Parquet with pyarrow into memory, the usual pattern since TorchDistributor does not
  stream DataFrames, and trains with DDP on those tensors.
* plain DDP inside the executors (``--plain-in-executors``): the same loop and in-memory shard,
  run by ``sparkdl.run`` in the executors' barrier tasks: Spark's environment without sparkdl's
  data path and training loop, which tells the two apart.
* Ray Train (``--ray``): ``TorchTrainer`` with Ray Data reading the same Parquet
  (``ray.data.read_parquet`` → ``iter_torch_batches``), the same model, optimizer and batch, 2
  workers of one CPU each; run by ``benchmarks/ray_train_side.py`` in its own virtualenv
  (``benchmarks/ray_env`` makes ``.venv-ray``: ray is no dependency of sparkdl), while the Spark
  application idles.
* sparkdl AllReduce: ``TorchEstimator.fit(path)`` streaming the Parquet with the Arrow and/or
  Petastorm reader (``--readers``; petastorm is skipped with a note where it cannot be imported)
  inside Spark barrier tasks.

Spark runs on local-cluster[2,1,2048] (two one-core executors) and stays up for every side. The
first call of the application starts the executors' Python workers ("cold", 1 epoch); the figures
come from the calls after it. With ``--repeats N`` every side runs N times, alternated, and each
side's ratio to DDP is taken against the DDP run of the same repeat (a slow spell of a shared
machine then moves both), reported as the median and its range. DDP and TorchDistributor share one
training loop (a fresh shuffled order each epoch, ``dist.barrier()`` around each epoch's timing on
rank 0).

Columns: steady samples/s (mean of the epochs after the first; median over repeats), its ratio to
plain DDP, the whole call (fit / run / start_processes called → returned), and start-up (called →
first batch on rank 0; for TorchDistributor also its launch, called → the function entered on
rank 0, and its pyarrow load). The machine may be shared: ratios measured side by side matter, not
absolute figures.
A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HIDDEN = 256
FEATURES = 64
CLASSES = 10
WORKERS = 2


def make_mlp() -> torch.nn.Module:
    """Compute-bound: two hidden layers of 256."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def make_linear() -> torch.nn.Module:
    """Data-bound: one Linear(64, 10), so the data path dominates."""
    return torch.nn.Linear(FEATURES, CLASSES)


MODELS: Dict[str, Callable[[], torch.nn.Module]] = {"mlp": make_mlp, "linear": make_linear}


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def synthetic(rows: int, seed: int = 0, features: int = FEATURES, center_scale: float = 1.0, noise: float = 2.0):
    """``rows`` rows of ``features`` float32 around one random center per class (learnable: the
    smaller ``center_scale`` against ``noise``, the harder), and their int64 labels."""
    rng = np.random.default_rng(seed)
    centers = (rng.normal(size=(CLASSES, features)) * center_scale).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=rows)
    values = centers[labels] + rng.normal(scale=noise, size=(rows, features)).astype(np.float32)
    return values, labels.astype(np.int64)


def held_out_accuracy(module: torch.nn.Module, test: str) -> float:
    """The share of the rows in ``test`` (an ``.npz`` of ``features``, ``labels``) that ``module``
    classifies right."""
    with np.load(test) as held_out:
        x, y = torch.from_numpy(held_out["features"]), torch.from_numpy(held_out["labels"])
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).float().mean())


def write_parquet(path: str, features, labels, row_group: int = 8192) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path, exist_ok=True)
    width = features.shape[1]
    offsets = pa.array(np.arange(0, len(features) * width + 1, width, dtype=np.int32))
    values = pa.ListArray.from_arrays(offsets, pa.array(features.reshape(-1)))
    table = pa.table({"features": values, "label": labels})
    pq.write_table(table, os.path.join(path, "part-0.parquet"), row_group_size=row_group)


def _train_ddp(model_fn, x, y, steps: int, batch: int, epochs: int, rank: int, world: int, test: Optional[str] = None):
    """The training loop of both DDP sides (process group already up): the model wrapped in DDP,
    ``steps`` batches of ``batch`` rows per epoch in a fresh shuffled order. Returns (per-epoch
    samples/s of all ranks together, time.time() at the first batch, the trained model's
    accuracy on ``test`` on rank 0 or None)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(model_fn())
    optimizer = make_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    rates: List[float] = []
    first_batch = None
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        dist.barrier()
        start = time.time()
        if first_batch is None:
            first_batch = start
        for step in range(steps):
            index = order[step * batch : (step + 1) * batch]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        dist.barrier()
        rates.append(steps * batch * world / (time.time() - start))
    accuracy = held_out_accuracy(model.module, test) if test and rank == 0 else None
    return rates, first_batch, accuracy


# --- plain DDP, in-memory tensors ----------------------------------------------------------------


def _ddp_worker(rank: int, world: int, port: int, model_fn, features, labels, batch: int, epochs: int, out, test=None):
    import torch.distributed as dist

    from tests.gloo import exit_without_finalizing

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    x = torch.from_numpy(features[rank::world].copy())
    y = torch.from_numpy(labels[rank::world].copy())
    steps = len(labels) // (batch * world)
    rates, first_batch, accuracy = _train_ddp(model_fn, x, y, steps, batch, epochs, rank, world, test)
    if rank == 0:
        out.put({"rates": rates, "first_batch": first_batch, "steps": steps, "accuracy": accuracy})
    dist.destroy_process_group()
    # Rank 0 hosts the store: it stays until the others are done with it (a rank whose store
    # vanished while it tore down its group aborted once).
    if rank == 0:
        store.wait([f"done-{other}" for other in range(1, world)])
    else:
        store.set(f"done-{rank}", "1")
    exit_without_finalizing()


def run_ddp(model_fn, features, labels, batch: int, epochs: int, test: Optional[str] = None) -> Dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    called = time.time()
    mp.start_processes(
        _ddp_worker,
        args=(WORKERS, port, model_fn, features, labels, batch, epochs, queue, test),
        nprocs=WORKERS,
        start_method="spawn",
    )
    whole = time.time() - called
    result = queue.get()
    return {**result, "startup": result["first_batch"] - called, "whole": whole}


def _plain_in_executor(model_name: str, rows: int, batch: int, epochs: int, ctx) -> Dict:
    """The DDP side's loop, run by ``sparkdl.run`` inside the executors' tasks on sparkdl's
    process group: each rank rebuilds the same synthetic rows and keeps its shard in memory."""
    features, labels = synthetic(rows)
    x = torch.from_numpy(np.ascontiguousarray(features[ctx.rank :: ctx.world_size]))
    y = torch.from_numpy(labels[ctx.rank :: ctx.world_size].copy())
    steps = rows // (batch * ctx.world_size)
    rates, first_batch, _ = _train_ddp(MODELS[model_name], x, y, steps, batch, epochs, ctx.rank, ctx.world_size)
    return {"rates": rates, "first_batch": first_batch}


def run_plain_in_executors(spark, model_name: str, rows: int, batch: int, epochs: int) -> Dict:
    import sparkdl

    called = time.time()
    result = sparkdl.run(
        functools.partial(_plain_in_executor, model_name, rows, batch, epochs),
        num_workers=WORKERS,
        spark=spark,
        progress=False,
    )
    return {**result, "startup": result["first_batch"] - called, "whole": time.time() - called}


# --- TorchDistributor: pyarrow shard in memory + DDP ---------------------------------------------


def _distributor_train(path: str, model_fn, batch: int, epochs: int, test: Optional[str] = None):
    """Run by torchrun on each executor (cloudpickled by value, as this module is ``__main__``):
    the usual TorchDistributor pattern for Parquet, which it does not stream: read this rank's
    share of the rows into memory with pyarrow, then DDP over the tensors. Returns rank 0's
    figures (TorchDistributor returns partition 0's, which is torchrun node 0, rank 0)."""
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch.distributed as dist

    entered = time.time()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// from torchrun: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    started = time.time()
    files = [pq.ParquetFile(name) for name in sorted(glob.glob(os.path.join(path, "*.parquet")))]
    total_rows = sum(f.metadata.num_rows for f in files)
    # This rank's contiguous 1/world of the rows: the row groups that overlap it, then a slice, so
    # that the shards are equal (as the other sides' are) and each rank reads about its share.
    low, high = rank * total_rows // world, (rank + 1) * total_rows // world
    pieces, offset, first = [], 0, None
    for f in files:
        for group in range(f.num_row_groups):
            size = f.metadata.row_group(group).num_rows
            if offset < high and offset + size > low:
                first = offset if first is None else first
                pieces.append((f, group))
            offset += size
    table = pa.concat_tables([f.read_row_group(group, columns=["features", "label"]) for f, group in pieces]).slice(
        low - first, high - low
    )
    column = table.column("features").combine_chunks()
    x = torch.from_numpy(column.flatten().to_numpy().reshape(len(table), -1).copy())
    y = torch.from_numpy(table.column("label").to_numpy().astype(np.int64))
    del table, column
    steps = total_rows // (batch * world)  # the other sides' steps: one pass over the rows
    loaded = time.time()
    rates, first_batch, accuracy = _train_ddp(model_fn, x, y, steps, batch, epochs, rank, world, test)
    dist.destroy_process_group()
    if rank == 0:
        return {
            "accuracy": accuracy,
            "rates": rates,
            "first_batch": first_batch,
            "entered": entered,
            "load_seconds": loaded - started,
            "steps": steps,
        }
    return None


def run_distributor(path: str, model_fn, batch: int, epochs: int, test: Optional[str] = None) -> Dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    # local_mode=False: torchrun runs inside the executors' barrier tasks, one node per task
    # (nproc_per_node=1 as CUDA_VISIBLE_DEVICES is empty without GPUs), not on the driver.
    distributor = TorchDistributor(num_processes=WORKERS, local_mode=False, use_gpu=False)
    called = time.time()
    result = distributor.run(_distributor_train, path, model_fn, batch, epochs, test)
    whole = time.time() - called
    # launch: run() called -> the function entered on rank 0 (Spark job, torchrun, imports).
    return {**result, "startup": result["first_batch"] - called, "launch": result["entered"] - called, "whole": whole}


# --- sparkdl AllReduce ---------------------------------------------------------------------------


def run_sparkdl(spark, data, model_fn, batch: int, epochs: int, reader: str, shard_cache: str = "auto") -> Dict:
    import sparkdl

    estimator = sparkdl.TorchEstimator(
        model=model_fn,
        optimizer=make_optimizer,
        num_workers=WORKERS,
        batch_size=batch,
        epochs=epochs,
        progress=False,
        reader=reader,
        shard_cache=shard_cache,
    )
    called = time.time()
    model = estimator.fit(data)
    whole = time.time() - called
    info = model.run_info
    startup = info["prepare_seconds"] + (info["startup_seconds"] or 0.0)
    return {
        "rates": [r["samples_per_sec"] for r in model.history],
        "whole": whole,
        "startup": startup,
        "first_batch": called + startup,
        "model": model,
    }


def steady(rates: List[float]) -> float:
    return float(np.mean(rates[1:] or rates))


def _figures(runs: List[Dict], ddp_runs: List[Dict]) -> Dict[str, float]:
    """A side's figures over the repeats: medians, and its steady rate's ratio to the DDP run of
    the same repeat (paired, so a slow spell of the machine moves both), median and range."""
    ratios = [steady(run["rates"]) / steady(ddp["rates"]) for run, ddp in zip(runs, ddp_runs)]
    return {
        "rate": float(np.median([steady(run["rates"]) for run in runs])),
        "ratio": float(np.median(ratios)),
        "low": min(ratios),
        "high": max(ratios),
        "whole": float(np.median([run["whole"] for run in runs])),
        "startup": float(np.median([run["startup"] for run in runs])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="mlp",
        help="mlp: compute-bound (default); linear: data-bound Linear(64, 10)",
    )
    parser.add_argument(
        "--readers",
        default="arrow,petastorm",
        help="sparkdl readers, comma-separated ('' for none); with --dataframe, READER@path reads the benchmark's "
        "Parquet in place (Spark's list<float>) instead of the DataFrame's copy, e.g. petastorm@path",
    )
    parser.add_argument(
        "--shard-cache",
        default="auto",
        help="sparkdl's shard_cache setting(s), comma-separated: each reader runs once per setting, side by side "
        "(e.g. none,auto: streaming every epoch against later epochs from memory)",
    )
    parser.add_argument("--skip-distributor", action="store_true", help="leave out the TorchDistributor side")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="add the Ray Train side (TorchTrainer + Ray Data, in .venv-ray: benchmarks/ray_env)",
    )
    parser.add_argument(
        "--dataframe",
        action="store_true",
        help="sparkdl fits spark.read.parquet(path), a DataFrame it materializes in its reader's layout, instead of the path",
    )
    parser.add_argument(
        "--plain-in-executors",
        action="store_true",
        help="also run the DDP side's loop inside the executors (launched by sparkdl.run, shard in memory): "
        "the Spark environment without sparkdl's data path and training loop",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every side this many times, alternated (DDP, the DDP loop in the executors if asked, each sparkdl reader, "
        "TorchDistributor); "
        "the table gives medians and the range of each side's ratio to the DDP run of the same repeat",
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    model_fn = MODELS[args.model]
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    for reader in readers:
        if reader.split("@")[0] not in ("arrow", "petastorm") or reader.partition("@")[2] not in ("", "path"):
            parser.error(f"unknown reader {reader!r}: arrow or petastorm, optionally @path")
    if any(r.startswith("petastorm") for r in readers) and importlib.util.find_spec("petastorm") is None:
        print(
            f"note: petastorm cannot be imported by {sys.executable}; the petastorm reader is skipped (it runs in .venv-petastorm)"
        )
        readers = [r for r in readers if not r.startswith("petastorm")]

    caches = [c.strip() for c in args.shard_cache.split(",") if c.strip()]
    if not caches or any(c not in ("auto", "memory", "none") for c in caches):
        parser.error(f"--shard-cache {args.shard_cache!r}: auto, memory or none, comma-separated")
    # One sparkdl side per reader and shard_cache setting: "arrow" or, with several settings, "arrow|none".
    sides = [reader if len(caches) == 1 else f"{reader}|{cache}" for reader in readers for cache in caches]

    features, labels = synthetic(args.rows)
    workdir = tempfile.mkdtemp(prefix="sparkdl-bench-")
    ddp_runs: List[Dict] = []
    sparkdl_runs: Dict[str, List[Dict]] = {side: [] for side in sides}
    distributor_runs: List[Dict] = []
    ray_runs: List[Dict] = []
    ray_python = _ray_python() if args.ray else None
    in_executor_runs: List[Dict] = []
    cold: Optional[Dict] = None
    distributor_cold: Optional[Dict] = None
    try:
        path = os.path.join(workdir, "data")
        write_parquet(path, features, labels)
        from _spark import local_cluster

        # Every side runs while the Spark application is up (its JVMs idle when not in use), as
        # a user's would be.
        spark = local_cluster("sparkdl-benchmark-allreduce", executor_memory_mb=2048)
        try:
            # A DataFrame is materialized by sparkdl once (float32 bytes per row, read by both
            # readers); a path is read as the benchmark wrote it (Spark's list<float>).
            data = spark.read.parquet(path) if args.dataframe else path

            def fit(side: str, epochs: int) -> Dict:
                reader, _, cache = side.partition("|")
                name, _, where = reader.partition("@")
                data_of = path if where == "path" else data
                return run_sparkdl(spark, data_of, model_fn, args.batch_size, epochs, name, cache or caches[0])

            # The first call of a new Spark application starts the executors' Python workers
            # ("cold", 1 epoch); the figures come from the calls after it.
            if sides:
                cold = fit(sides[0], 1)
            elif not args.skip_distributor:
                distributor_cold = run_distributor(path, model_fn, args.batch_size, 1)
            for _ in range(args.repeats):
                ddp_runs.append(run_ddp(model_fn, features, labels, args.batch_size, args.epochs))
                if args.plain_in_executors:
                    in_executor_runs.append(
                        run_plain_in_executors(spark, args.model, args.rows, args.batch_size, args.epochs)
                    )
                for side in sides:
                    sparkdl_runs[side].append(fit(side, args.epochs))
                if not args.skip_distributor:
                    distributor_runs.append(run_distributor(path, model_fn, args.batch_size, args.epochs))
                if ray_python:
                    ray_runs.append(run_ray(ray_python, path, args.model, args.batch_size, args.epochs))
        finally:
            spark.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    ddp = _figures(ddp_runs, ddp_runs)
    params = sum(p.numel() for p in model_fn().parameters())
    name = {"mlp": "MLP", "linear": "Linear(64, 10)"}[args.model]
    import pyspark

    print(
        f"\nrows={args.rows} features={FEATURES} model={name} ({params} params) workers={WORKERS} "
        f"batch/worker={args.batch_size} epochs={args.epochs} steps/epoch={ddp_runs[0]['steps']} repeats={args.repeats} "
        f"pyspark={pyspark.__version__} torch={torch.__version__}"
    )
    spread = args.repeats > 1

    def ratio(figures: Dict[str, float]) -> str:
        return f"{figures['ratio']:.2f}" + (f" ({figures['low']:.2f}–{figures['high']:.2f})" if spread else "")

    print(
        f"| side | steady samples/s | ratio to DDP{' (range)' if spread else ''} | whole call (s) | start-up (s, called → first batch) |"
    )
    print("|---|---:|---:|---:|---:|")
    print(
        f"| plain DDP, in-memory tensors (torch.multiprocessing) | {ddp['rate']:,.0f} | 1.00 | {ddp['whole']:.1f} | {ddp['startup']:.1f} |"
    )
    if in_executor_runs:
        figures = _figures(in_executor_runs, ddp_runs)
        print(
            f"| plain DDP inside the executors (sparkdl.run, in-memory tensors) | {figures['rate']:,.0f} | {ratio(figures)} "
            f"| {figures['whole']:.1f} | {figures['startup']:.1f} |"
        )
    if distributor_runs:
        figures = _figures(distributor_runs, ddp_runs)
        launch = float(np.median([run["launch"] for run in distributor_runs]))
        load = float(np.median([run["load_seconds"] for run in distributor_runs]))
        first = f"; first call of the app: {distributor_cold['startup']:.1f}" if distributor_cold else ""
        print(
            f"| TorchDistributor, pyarrow shard in memory + DDP | {figures['rate']:,.0f} | {ratio(figures)} | {figures['whole']:.1f} "
            f"| {figures['startup']:.1f} (launch {launch:.1f}, pyarrow load {load:.1f}){first} |"
        )
    if ray_runs:
        figures = _figures(ray_runs, ddp_runs)
        print(
            f"| Ray Train {ray_runs[0]['ray']}, TorchTrainer + Ray Data on the same Parquet | {figures['rate']:,.0f} "
            f"| {ratio(figures)} | {figures['whole']:.1f} | {figures['startup']:.1f} |"
        )
    for side, runs in sparkdl_runs.items():
        figures = _figures(runs, ddp_runs)
        reader, _, cache = side.partition("|")
        name, _, where = reader.partition("@")
        what = "a DataFrame (its copy)" if args.dataframe and not where else "Parquet read in place (list<float>)"
        print(
            f"| sparkdl AllReduce, {what} via the {name} reader, shard_cache={cache or caches[0]} "
            f"| {figures['rate']:,.0f} | {ratio(figures)} "
            f"| {figures['whole']:.1f} | {figures['startup']:.1f}; first fit of the app: {cold['startup']:.1f} |"
        )
    print()
    if distributor_runs:
        theirs = _figures(distributor_runs, ddp_runs)
        for side, runs in sparkdl_runs.items():
            mine = _figures(runs, ddp_runs)
            print(
                f"sparkdl {side} / TorchDistributor: steady samples/s {mine['rate'] / theirs['rate']:.2f}x, "
                f"whole call {mine['whole']:.1f} s vs {theirs['whole']:.1f} s ({theirs['whole'] / mine['whole']:.2f}x faster)"
            )

    if ray_runs:
        theirs = _figures(ray_runs, ddp_runs)
        for side, runs in sparkdl_runs.items():
            mine = _figures(runs, ddp_runs)
            print(
                f"sparkdl {side} / Ray Train: steady samples/s {mine['rate'] / theirs['rate']:.2f}x, "
                f"whole call {mine['whole']:.1f} s vs {theirs['whole']:.1f} s ({theirs['whole'] / mine['whole']:.2f}x faster)"
            )


# --- Ray Train -------------------------------------------------------------------------------------


def _ray_python() -> str:
    """The Ray side's interpreter: benchmarks/ray_env creates .venv-ray on first use."""
    script = os.path.join(ROOT, "benchmarks", "ray_env")
    return subprocess.run([script], check=True, capture_output=True, text=True).stdout.strip()


def run_ray(python: str, path: str, model: str, batch: int, epochs: int, test: Optional[str] = None) -> Dict:
    side = os.path.join(ROOT, "benchmarks", "ray_train_side.py")
    command = [python, side, "--path", path, "--model", model, "--batch-size", str(batch), "--epochs", str(epochs)]
    command += ["--workers", str(WORKERS)] + (["--test", test] if test else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the Ray Train side failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    # Its figures are the last JSON line: Ray's own processes may print to the same stdout after it.
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


if __name__ == "__main__":
    main()
