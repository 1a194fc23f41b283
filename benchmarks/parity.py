"""Parity with Ray's published "Ray Train vs DDP" benchmark (FashionMNIST-shaped): four ways to
train the same model on the same rows, side by side in one invocation, on CPU.

    .venv/bin/python benchmarks/parity.py [--rows 60000] [--epochs 5] [--repeats 3]
    .venv/bin/python benchmarks/parity.py --rows 4000 --epochs 2 --repeats 1   # quick check

The workload (benchmarks/_parity_workload.py): 60,000 generated rows of 784 float32 features and
10 classes (class centers + noise; nothing can be downloaded here), written to Parquet as a
list<float> column; 10,000 held-out rows around the same centers for the accuracy. MLP
784-512-512-10 with ReLU; SGD lr 0.01, momentum 0.9 (allreduce_vs_ddp.make_optimizer; Ray's
example uses lr 1e-3 without momentum on FashionMNIST's pixels, which learns too slowly on these
rows in a few epochs; the step's cost does not depend on it); batch 64 per worker, 2 workers of
one CPU each, one torch thread, gloo.

The sides (the runners of benchmarks/allreduce_vs_ddp.py, whose docstring details them):

* plain DDP: 2 ``torch.multiprocessing`` ranks, each holding its shard in memory;
* sparkdl AllReduce: ``TorchEstimator.fit(path)`` on local-cluster[2,1,1024] (its defaults: the
  arrow reader, shard_cache=auto);
* TorchDistributor: ``TorchDistributor(num_processes=2, local_mode=False).run`` on the same
  application, each rank loading its half of the Parquet with pyarrow into memory;
* Ray Train: ``TorchTrainer`` + Ray Data (``read_parquet`` -> ``iter_torch_batches``) in its own
  virtualenv (benchmarks/ray_env), while the Spark application idles.

Every repeat runs the sides in turn (DDP, sparkdl, TorchDistributor, Ray); ratios pair the runs of
one repeat. One sparkdl fit of 1 epoch first starts the executors' Python workers (not counted).

CPU (benchmarks/_parity_cpu.py): user + system seconds of this process and all its descendants,
sampled every 0.2 s: for the Spark sides the driver's Python and JVM (which also runs the
local-cluster master and workers), the executor JVMs, their Python workers and whatever those
start (torchrun and its ranks); for DDP and Ray this process and its non-JVM descendants (the
ranks; Ray's GCS, raylet, workers and Ray Data tasks). "Steady" is the epochs after the first
(their wall time from the side's own epoch figures), "whole call" is called -> returned.
A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _parity_cpu import PARTS, CpuMeter, become_subreaper  # noqa: E402
from _parity_workload import make_data, make_model  # noqa: E402
from allreduce_vs_ddp import (  # noqa: E402
    WORKERS,
    _ray_python,
    held_out_accuracy,
    run_ddp,
    run_distributor,
    run_ray,
    run_sparkdl,
    write_parquet,
)

SIDES = {
    "ddp": "plain DDP, in-memory tensors (torch.multiprocessing)",
    "sparkdl": "sparkdl AllReduce, TorchEstimator.fit(Parquet path)",
    "distributor": "TorchDistributor, pyarrow shard in memory + DDP",
    "ray": "Ray Train, TorchTrainer + Ray Data",
}
SPARK_SIDES = ("sparkdl", "distributor")


def epochs_of(side: str, result: Dict, rows: int, batch: int) -> Tuple[List[float], List[int]]:
    """The side's epochs: (seconds, samples) of each, from its own figures."""
    if side == "sparkdl":
        history = result["model"].history
        return [r["seconds"] for r in history], [r["samples"] for r in history]
    # DDP, TorchDistributor and Ray (equal shards, last partial batch dropped): the same steps.
    samples = rows // (batch * WORKERS) * batch * WORKERS
    return [samples / rate for rate in result["rates"]], [samples] * len(result["rates"])


def measure(side: str, call: Callable[[], Dict], rows: int, batch: int, test: str) -> Dict:
    """Runs one side's call under a CPU meter; its figures: steady samples/s, whole call, CPU
    seconds per sample (steady epochs and whole call), held-out accuracy."""
    meter = CpuMeter(exclude_java=side not in SPARK_SIDES).start()
    called = time.time()
    result = call()
    # The other sides evaluate on their rank 0 before they return: sparkdl's model, on the driver,
    # within the call's time and CPU as well (one torch thread, as theirs).
    accuracy = held_out_accuracy(result["model"].module, test) if side == "sparkdl" else result["accuracy"]
    whole = time.time() - called
    meter.stop()
    seconds, samples = epochs_of(side, result, rows, batch)
    steady = slice(1, None) if len(seconds) > 1 else slice(None)
    begin = result["first_batch"] + sum(seconds[: steady.start or 0])
    end = result["first_batch"] + sum(seconds)
    parts = meter.between(begin, end)
    return {
        "rate": sum(samples[steady]) / sum(seconds[steady]),
        "whole": whole,
        "cpu_steady": sum(parts.values()) / sum(samples[steady]),
        "cpu_whole": meter.whole() / sum(samples),
        "cores": sum(parts.values()) / (end - begin),
        **{f"cores_{part}": cpu / (end - begin) for part, cpu in parts.items()},
        "accuracy": accuracy,
        "ray": result.get("ray"),
    }


def spread(values: List[float], fmt: str) -> str:
    """The median, and the range where there are several values."""
    text = format(float(np.median(values)), fmt)
    return text + (f" ({format(min(values), fmt)}–{format(max(values), fmt)})" if len(values) > 1 else "")


def paired(mine: List[Dict], theirs: List[Dict], key: str, cost: bool) -> List[float]:
    """Per repeat: a rate's ratio mine/theirs, or for a cost theirs/mine (above 1: mine is cheaper)."""
    return [(t[key] / m[key]) if cost else (m[key] / t[key]) for m, t in zip(mine, theirs)]


def print_tables(runs: Dict[str, List[Dict]]) -> None:
    print(
        "| side | steady samples/s | whole call (s) | CPU-µs/sample, steady | CPU-µs/sample, whole call | cores busy, steady (driver / JVMs / other processes) | held-out accuracy |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side, side_runs in runs.items():
        breakdown = " / ".join(
            format(float(np.median([r[f"cores_{part}"] for r in side_runs])), ".2f") for part in PARTS
        )
        label = SIDES[side] + (f" (ray {side_runs[0]['ray']})" if side == "ray" else "")
        print(
            f"| {label} | {spread([r['rate'] for r in side_runs], ',.0f')} | {spread([r['whole'] for r in side_runs], '.1f')} "
            f"| {spread([r['cpu_steady'] * 1e6 for r in side_runs], '.0f')} | {spread([r['cpu_whole'] * 1e6 for r in side_runs], '.0f')} "
            f"| {spread([r['cores'] for r in side_runs], '.2f')} ({breakdown}) | {spread([r['accuracy'] for r in side_runs], '.3f')} |"
        )
    print()
    print(
        "Ratios, paired by repeat, median (range). samples/s: side ÷ reference; CPU/sample and whole call: reference ÷ side (above 1: the side is cheaper/faster)."
    )
    print()
    references = [name for name in ("ddp", "distributor") if name in runs]
    header = " | ".join(
        f"{what} vs {SIDES[ref].split(',')[0]}"
        for ref in references
        for what in ("samples/s", "CPU/sample steady", "CPU/sample whole", "whole call")
    )
    print(f"| side | {header} |")
    print("|---|" + "---:|" * (4 * len(references)))
    for side, side_runs in runs.items():
        cells = []
        for ref in references:
            for key, cost in (("rate", False), ("cpu_steady", True), ("cpu_whole", True), ("whole", True)):
                cells.append(spread(paired(side_runs, runs[ref], key, cost), ".2f"))
        print(f"| {SIDES[side].split(',')[0]} | " + " | ".join(cells) + " |")


def print_sparkdl_ratios(runs: Dict[str, List[Dict]]) -> None:
    """sparkdl against each other side, paired by repeat (as print_tables' ratios)."""
    if "sparkdl" not in runs:
        return
    print("\n| sparkdl against | steady samples/s | CPU/sample, steady | CPU/sample, whole call | whole call |")
    print("|---|---:|---:|---:|---:|")
    for ref in (side for side in runs if side != "sparkdl"):
        cells = [
            spread(paired(runs["sparkdl"], runs[ref], key, cost), ".2f")
            for key, cost in (("rate", False), ("cpu_steady", True), ("cpu_whole", True), ("whole", True))
        ]
        print(f"| {SIDES[ref].split(',')[0]} | " + " | ".join(cells) + " |")


def print_goals(runs: Dict[str, List[Dict]]) -> None:
    """The issue's goal figures for sparkdl, each met or not (on the median of the paired ratios)."""
    if "sparkdl" not in runs:
        return
    cpu = (("cpu_steady", "CPU-s/sample, steady"), ("cpu_whole", "CPU-s/sample, whole call"))
    goals = [("distributor", key, what, True, 1.0) for key, what in cpu]
    goals += [("ddp", key, what, True, 0.97) for key, what in cpu]
    goals += [("ray", "rate", "steady samples/s", False, 1.0)] + [("ray", key, what, True, 1.0) for key, what in cpu]
    print()
    for ref, key, what, cost, floor in goals:
        if ref in runs:
            value = float(np.median(paired(runs["sparkdl"], runs[ref], key, cost)))
            verdict = "met" if value >= floor else "NOT met"
            print(f"goal: sparkdl >= {floor:.2f}x {SIDES[ref].split(',')[0]} on {what}: {value:.2f}x -> {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--test-rows", type=int, default=10_000, help="held-out rows for the accuracy")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every side, interleaved")
    parser.add_argument("--skip", default="", help="sides to leave out, comma-separated: " + ",".join(SIDES))
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.repeats < 1 or args.epochs < 1 or skip - set(SIDES):
        parser.error("--repeats and --epochs must be >= 1; --skip takes " + ",".join(SIDES))
    sides = [side for side in SIDES if side not in skip]
    ray_python = _ray_python() if "ray" in sides else None
    become_subreaper()
    import torch

    torch.set_num_threads(1)  # the driver's share: sparkdl's held-out evaluation

    features, labels, test_x, test_y = make_data(args.rows, args.test_rows)
    workdir = tempfile.mkdtemp(prefix="sparkdl-parity-")
    runs: Dict[str, List[Dict]] = {side: [] for side in sides}
    try:
        path, test = os.path.join(workdir, "data"), os.path.join(workdir, "test.npz")
        write_parquet(path, features, labels)
        np.savez(test, features=test_x, labels=test_y)
        from _spark import local_cluster

        spark = local_cluster("sparkdl-benchmark-parity", executor_memory_mb=1024, pythonpath=(ROOT, HERE))
        try:
            batch, epochs = args.batch_size, args.epochs
            calls = {
                "ddp": lambda: run_ddp(make_model, features, labels, batch, epochs, test),
                "sparkdl": lambda: run_sparkdl(spark, path, make_model, batch, epochs, "arrow"),
                "distributor": lambda: run_distributor(path, make_model, batch, epochs, test),
                "ray": lambda: run_ray(ray_python, path, "_parity_workload:make_model", batch, epochs, test),
            }
            if "sparkdl" in sides or "distributor" in sides:  # starts the executors' Python workers
                run_sparkdl(spark, path, make_model, batch, 1, "arrow")
            for repeat in range(args.repeats):
                for side in sides:
                    runs[side].append(measure(side, calls[side], args.rows, batch, test))
                    print(f"repeat {repeat + 1} {side}: {runs[side][-1]}", file=sys.stderr, flush=True)
        finally:
            spark.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, runs)


def report(args: argparse.Namespace, runs: Dict[str, List[Dict]]) -> None:
    import pyspark
    import torch

    params = sum(p.numel() for p in make_model().parameters())
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: rows={args.rows} (held out {args.test_rows}) features=784 "
        f"MLP 784-512-512-10 ({params:,} params) workers={WORKERS} batch/worker={args.batch_size} epochs={args.epochs} "
        f"repeats={args.repeats} SGD lr=0.01 momentum=0.9 gloo pyspark={pyspark.__version__} torch={torch.__version__} "
        f"cpus={os.cpu_count()}\n"
    )
    print_tables(runs)
    print_sparkdl_ratios(runs)
    print_goals(runs)


if __name__ == "__main__":
    main()
