"""What sparkdl's training loop costs per step beyond the model: one rank, one core, no Spark.

    .venv/bin/python benchmarks/step_overhead.py [--model mlp|linear] [--batch-size 64] [--layout list|packed] [--steps 1200] [--rounds 6] [--core 1]

A configuration of ``allreduce_vs_ddp.py`` (default the compute-bound one: the 85k-parameter
MLP, batch 64, SGD with momentum; ``--model linear --batch-size 1024`` is the data-bound one) in
one process pinned to one core, as a one-core Spark task runs it: a one-rank gloo group, DDP, and

* **in memory**: the plain DDP loop over tensors already in memory (the floor);
* **sparkdl**: ``FitLoop`` with ``AllReduce`` streaming a Parquet shard through the Arrow reader,
  exactly as a task on the CPU does (minus Spark and the channel): batches become tensors in the
  training thread when it takes them;
* **sparkdl, prefetch thread**: the same with a prefetch thread converting batches ahead (what
  a CUDA task does, and what CPU tasks did before): the reason for the choice above.

Each round runs all three, one after the other, and prints the ratio of their CPU time per step
(the process's CPU time, so every thread's work counts and other tenants of a shared machine
mostly do not) and of their wall time; the median over rounds is the figure. The end-to-end
benchmark with two Spark workers (``allreduce_vs_ddp.py``) swings by ±10 % between runs here;
this one isolates the loop.
A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _ranks import Store, join, run_ranks  # noqa: E402
from allreduce_vs_ddp import MODELS, make_optimizer, synthetic, write_parquet  # noqa: E402

Times = Tuple[float, float]  # (CPU seconds, wall seconds)


def in_memory(
    make_model: Callable[[], torch.nn.Module], x: torch.Tensor, y: torch.Tensor, batch: int, steps: int
) -> Times:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    optimizer = make_optimizer(model.parameters())
    order = torch.randperm(len(x))
    start, wall = time.process_time(), time.perf_counter()
    for step in range(steps):
        index = order[step * batch : (step + 1) * batch]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
    return time.process_time() - start, time.perf_counter() - wall


def sparkdl_loop(
    make_model: Callable[[], torch.nn.Module], env, dataset, spec, steps: int, prefetch_thread: bool
) -> Times:
    import sparkdl.context
    from sparkdl._runtime.host_batches import Prefetcher, host_batches
    from sparkdl._task.fit_loop import FitLoop
    from sparkdl.context import TrainContext
    from sparkdl.data.readers import reader_from_name
    from sparkdl.strategies.allreduce import AllReduce

    runtime = AllReduce().create_runtime(env)
    ctx = TrainContext(
        env,
        runtime,
        lambda record: None,
        dataset=dataset,
        data_spec=spec,
        reader=reader_from_name("arrow"),
        steps_per_epoch=steps,
    )
    loop = FitLoop(model=make_model, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy, epochs=1, seed=0)
    if prefetch_thread:
        sparkdl.context.host_batches = lambda source, device: Prefetcher(source, pin=False, device=device)
    try:
        start, wall = time.process_time(), time.perf_counter()
        loop(ctx)
        return time.process_time() - start, time.perf_counter() - wall
    finally:
        sparkdl.context.host_batches = host_batches
        ctx.close()
        runtime.close()


def _pack(workdir: str) -> None:
    """Rewrites the features column as float32 bytes per row, marked as sparkdl marks its copy."""
    import pyarrow.parquet as pq

    from sparkdl.data.tensor_bytes import pack_array, spark_footer_metadata

    for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        table = pq.read_table(path)
        packed = table.set_column(0, "features", pack_array(table.column("features").combine_chunks()))
        packed = packed.replace_schema_metadata(spark_footer_metadata(packed.schema, ["features"]))
        row_group = pq.ParquetFile(path).metadata.row_group(0).num_rows
        pq.write_table(packed, path, row_group_size=row_group, use_dictionary=["label"])


SIDES = ("in memory (plain DDP)", "sparkdl FitLoop, Arrow reader", "sparkdl FitLoop, Arrow reader, prefetch thread")


def measure(rank: int, world_size: int, store: Store, args: argparse.Namespace, workdir: str) -> Dict[str, List[Times]]:
    """One rank's rounds: all three sides per round, in the same order on every rank (their
    collectives keep the ranks in step). Each rank trains on rows ``rank::world_size``."""
    from sparkdl._runtime.rendezvous import teardown
    from sparkdl.data.batching import DataSpec
    from sparkdl.data.dataset import inspect_dataset

    env = join(rank, world_size, store, args.core)
    batch, make_model = args.batch_size, MODELS[args.model]
    features, labels = synthetic(args.steps * batch * world_size)
    dataset = inspect_dataset(workdir, ["features"], "label")
    x = torch.from_numpy(np.ascontiguousarray(features[rank::world_size]))
    y = torch.from_numpy(labels[rank::world_size])
    times: Dict[str, List[Times]] = {side: [] for side in SIDES}
    try:
        for _ in range(args.rounds + 1):  # the first round warms up and is left out
            spec = DataSpec(batch_size=batch, seed=0)
            times[SIDES[0]].append(in_memory(make_model, x, y, batch, args.steps))
            times[SIDES[1]].append(sparkdl_loop(make_model, env, dataset, spec, args.steps, prefetch_thread=False))
            times[SIDES[2]].append(sparkdl_loop(make_model, env, dataset, spec, args.steps, prefetch_thread=True))
    finally:
        teardown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--layout",
        choices=("list", "packed"),
        default="list",
        help="the features as Spark's list<float> (a Parquet dataset as Spark wrote it) or float32 bytes (sparkdl's copy of a DataFrame)",
    )
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--ranks", type=int, default=1, help="ranks, one process and one core each (2: the collectives sync for real)"
    )
    parser.add_argument("--core", type=int, default=1, help="rank 0's core; rank r pins to core + r (-1: no pinning)")
    args = parser.parse_args()
    features, labels = synthetic(args.steps * args.batch_size * args.ranks)
    workdir = tempfile.mkdtemp(prefix="sparkdl-step-overhead-")
    write_parquet(workdir, features, labels)
    if args.layout == "packed":
        _pack(workdir)
    if args.ranks == 1:
        times = measure(0, 1, None, args, workdir)
    else:
        times = run_ranks(measure, args.ranks, args, workdir)[0]
    floor = times[SIDES[0]][1:]
    where = "one core" if args.ranks == 1 else f"{args.ranks} ranks on a core each (rank 0's times)"
    print(
        f"{args.model}, batch {args.batch_size}, {args.layout} layout, {args.steps} steps, {where}, per step, median of {args.rounds} rounds"
    )
    print("| loop | CPU ms/step | vs in memory (CPU) | wall ms/step | vs in memory (wall) |")
    print("|---|---:|---:|---:|---:|")
    for side in SIDES:
        rounds = times[side][1:]
        cpu = statistics.median(cpu for cpu, _ in rounds) / args.steps
        wall = statistics.median(wall for _, wall in rounds) / args.steps
        cpu_ratio = statistics.median(base[0] / mine[0] for base, mine in zip(floor, rounds))
        wall_ratio = statistics.median(base[1] / mine[1] for base, mine in zip(floor, rounds))
        print(f"| {side} | {1000 * cpu:.3f} | {cpu_ratio:.2f} | {1000 * wall:.3f} | {wall_ratio:.2f} |")


if __name__ == "__main__":
    main()
