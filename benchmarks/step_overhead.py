"""What sparkdl's training loop costs per step beyond the model: one rank, one core, no Spark.

    .venv/bin/python benchmarks/step_overhead.py [--steps 1200] [--rounds 6] [--core 1]

The compute-bound configuration of ``allreduce_vs_ddp.py`` (the 85k-parameter MLP, batch 64,
SGD with momentum) in one process pinned to one core, as a one-core Spark task runs it: a
one-rank gloo group, DDP, and either

* **in memory**: the plain DDP loop over tensors already in memory (the floor), or
* **sparkdl**: ``FitLoop`` with ``AllReduce`` streaming a Parquet shard through the Arrow reader
  and the prefetch thread, exactly as a task does (minus Spark and the channel).

Each round runs both, one after the other, and prints the ratio of their CPU time per step (the
process's CPU time, so the prefetch thread's work counts and other tenants of a shared machine
mostly do not); the median over rounds is the figure. The end-to-end benchmark with two Spark
workers (``allreduce_vs_ddp.py``) swings by ±10 % between runs here; this one isolates the loop.
A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from allreduce_vs_ddp import make_mlp, make_optimizer, synthetic, write_parquet  # noqa: E402

BATCH = 64


def in_memory(x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    optimizer = make_optimizer(model.parameters())
    order = torch.randperm(len(x))
    start = time.process_time()
    for step in range(steps):
        index = order[step * BATCH:(step + 1) * BATCH]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
    return time.process_time() - start


def sparkdl_loop(env, dataset, spec, steps: int) -> float:
    from sparkdl._training import FitLoop
    from sparkdl.context import TrainContext
    from sparkdl.data.readers import reader_from_name
    from sparkdl.strategies.allreduce import AllReduce

    runtime = AllReduce().create_runtime(env)
    ctx = TrainContext(env, runtime, lambda record: None, dataset=dataset, data_spec=spec, reader=reader_from_name("arrow"), steps_per_epoch=steps)
    loop = FitLoop(model=make_mlp, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy, epochs=1, seed=0)
    try:
        start = time.process_time()
        loop(ctx)
        return time.process_time() - start
    finally:
        ctx.close()
        runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--core", type=int, default=1, help="the core to pin to (-1: no pinning)")
    args = parser.parse_args()
    if args.core >= 0:
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    from sparkdl._rendezvous import rendezvous, teardown
    from sparkdl.data.batching import DataSpec
    from sparkdl.data.dataset import inspect_dataset

    features, labels = synthetic(args.steps * BATCH)
    workdir = tempfile.mkdtemp(prefix="sparkdl-step-overhead-")
    write_parquet(workdir, features, labels)
    dataset = inspect_dataset(workdir, ["features"], "label")
    x, y = torch.from_numpy(np.ascontiguousarray(features)), torch.from_numpy(labels)
    env = rendezvous(0, 1, ["127.0.0.1:0"], lambda value: [value], torch.device("cpu"), timeout_s=60)
    ratios, floor, ours = [], [], []
    try:
        for _ in range(args.rounds + 1):  # the first round warms up and is left out
            plain = in_memory(x, y, args.steps)
            loop = sparkdl_loop(env, dataset, DataSpec(batch_size=BATCH, seed=0), args.steps)
            floor.append(plain / args.steps)
            ours.append(loop / args.steps)
            ratios.append(plain / loop)
    finally:
        teardown()
    print(f"MLP (85k params), batch {BATCH}, {args.steps} steps, one core, CPU time per step, median of {args.rounds} rounds")
    print("| loop | CPU ms/step | vs in memory |")
    print("|---|---:|---:|")
    print(f"| in memory (plain DDP) | {1000 * statistics.median(floor[1:]):.3f} | 1.00 |")
    print(f"| sparkdl FitLoop, Arrow reader | {1000 * statistics.median(ours[1:]):.3f} | {statistics.median(ratios[1:]):.2f} |")
    print("ratios per round: " + " ".join(f"{r:.3f}" for r in ratios[1:]))


if __name__ == "__main__":
    main()
