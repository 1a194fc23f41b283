"""Where the cached epochs lose to in-memory DDP on two ranks: every step's wall time, not the mean.

    .venv/bin/python benchmarks/cached_step_times.py [--steps 146] [--epochs 6] [--rounds 3] [--world 2] [--checkpoints]

The data-bound configuration of ``allreduce_vs_ddp.py`` (``Linear(64, 10)``, batch 1024, SGD) on
``--world`` ranks (two by default), one process pinned to one core each, a real gloo group and no
Spark (nor Java: it runs on any machine with torch, numpy, pyarrow and cryptography):

* **in memory**: the plain DDP loop over the rank's rows as tensors, a new permutation per epoch;
* **sparkdl, shard cache**: ``FitLoop`` with ``AllReduce`` and the shard cache on, so the epochs
  after the first read the rank's decoded shard from memory (#31's path);
* with ``--checkpoints``, also **sparkdl, shard cache, checkpoint dir**: the same with a checkpoint
  directory, as a production fit has: a checkpoint written in the background at each epoch's end,
  and the ranks' agreements on draining (sparkdl._runtime.drain).

A forward hook stamps each training step; the intervals of the epochs after the second (the cache
warm, the first permutation done) are summarized per rank and round: median, mean, tail and the
"excess" (the sum of each step's time over the median), which tells a per-step overhead (the
median moves) from jitter (the tail moves: synchronous ranks wait for each other's slow steps).
Both sides run in every round, one after the other, so the ratios compare like with like on a
shared machine. A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _ranks import Store, join, run_ranks  # noqa: E402
from allreduce_vs_ddp import MODELS, make_optimizer, synthetic, write_parquet  # noqa: E402

BATCH = 1024
STEADY_FROM_EPOCH = 2  # epochs 0 and 1 (0-based) read Parquet and fill the cache: left out


class Stamped(torch.nn.Module):
    """The model, with the time of every training forward (one per step) appended to ``stamps``."""

    def __init__(self, inner: torch.nn.Module, stamps: List[float]) -> None:
        super().__init__()
        self.inner = inner
        self.stamps = stamps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.stamps.append(time.perf_counter())
        return self.inner(x)


def in_memory(x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, stamps: List[float]) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Stamped(MODELS["linear"](), stamps))
    optimizer = make_optimizer(model.parameters())
    for _ in range(args.epochs):
        order = torch.randperm(len(x))
        for step in range(args.steps):
            index = order[step * BATCH : (step + 1) * BATCH]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()


def sparkdl_cached(env, dataset, args: argparse.Namespace, stamps: List[float], checkpoints: bool = False) -> None:
    from sparkdl._task.fit_loop import FitLoop
    from sparkdl.checkpoint import FileCheckpointStore
    from sparkdl.context import TrainContext
    from sparkdl.data.batching import DataSpec
    from sparkdl.data.readers import reader_from_name
    from sparkdl.data.shard_cache import Decision
    from sparkdl.strategies.allreduce import AllReduce

    runtime = AllReduce().create_runtime(env)
    cache = Decision("memory", budget_bytes=1 << 32, shard_bytes=0, memory_bytes=1 << 34, reason="benchmark")
    ctx = TrainContext(
        env,
        runtime,
        lambda record: None,
        dataset=dataset,
        data_spec=DataSpec(batch_size=BATCH, seed=0, shard_cache=cache),
        reader=reader_from_name("arrow"),
        steps_per_epoch=args.steps,
        store=FileCheckpointStore(tempfile.mkdtemp(prefix="sparkdl-cached-steps-ckpt-")) if checkpoints else None,
    )
    loop = FitLoop(
        model=lambda: Stamped(MODELS["linear"](), stamps),
        optimizer=make_optimizer,
        loss=torch.nn.functional.cross_entropy,
        epochs=args.epochs,
        seed=0,
    )
    try:
        loop(ctx)
    finally:
        ctx.close()
        runtime.close()


def steady_intervals_ms(stamps: List[float], args: argparse.Namespace) -> np.ndarray:
    epochs = [np.diff(stamps[e * args.steps : (e + 1) * args.steps]) for e in range(STEADY_FROM_EPOCH, args.epochs)]
    return np.concatenate(epochs) * 1000


CHECKPOINTED = "sparkdl, shard cache, checkpoint dir"


def sides(args: argparse.Namespace) -> List[str]:
    return ["in memory", "sparkdl, shard cache"] + ([CHECKPOINTED] if args.checkpoints else [])


def rank_main(rank: int, world_size: int, store: Store, args: argparse.Namespace, workdir: str):
    from sparkdl._runtime.rendezvous import teardown
    from sparkdl._task.allocator import keep_step_memory
    from sparkdl.data.dataset import inspect_dataset

    features, labels = synthetic(args.steps * BATCH * world_size)
    x = torch.from_numpy(np.ascontiguousarray(features[rank::world_size]))
    y = torch.from_numpy(labels[rank::world_size])
    dataset = inspect_dataset(workdir, ["features"], "label")
    if not args.glibc_defaults:
        # As a fit's task does before training (sparkdl._task.allocator), for both loops alike.
        keep_step_memory()
    env = join(rank, world_size, store, core=0)
    measured: Dict[str, List[np.ndarray]] = {side: [] for side in sides(args)}
    try:
        for _ in range(args.rounds):
            stamps: List[float] = []
            in_memory(x, y, args, stamps)
            measured["in memory"].append(steady_intervals_ms(stamps, args))
            stamps = []
            sparkdl_cached(env, dataset, args, stamps)
            measured["sparkdl, shard cache"].append(steady_intervals_ms(stamps, args))
            if args.checkpoints:
                stamps = []
                sparkdl_cached(env, dataset, args, stamps, checkpoints=True)
                measured[CHECKPOINTED].append(steady_intervals_ms(stamps, args))
    finally:
        teardown()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=146, help="steps per epoch per rank")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world", type=int, default=2, help="ranks, each pinned to a core of its own")
    parser.add_argument("--checkpoints", action="store_true", help="also the cached loop with a checkpoint directory")
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="leave glibc's mmap and trim thresholds as a new process has them (a fit's task raises them)",
    )
    args = parser.parse_args()
    if not 2 <= args.world <= os.cpu_count():
        parser.error(f"--world must be between 2 and this machine's {os.cpu_count()} cores")
    if args.epochs <= STEADY_FROM_EPOCH:
        parser.error(f"--epochs must be more than {STEADY_FROM_EPOCH}: the first {STEADY_FROM_EPOCH} are left out")
    features, labels = synthetic(args.steps * BATCH * args.world)
    workdir = tempfile.mkdtemp(prefix="sparkdl-cached-steps-")
    write_parquet(workdir, features, labels)
    by_rank = run_ranks(rank_main, args.world, args, workdir)
    print(
        f"Linear(64, 10), batch {BATCH}, {args.world} ranks on a core each of {os.cpu_count()}, "
        f"torch {torch.__version__}, epochs {STEADY_FROM_EPOCH + 1}-{args.epochs}"
    )
    print("| rank | round | loop | median ms | mean ms | p90 | p99 | excess ms | in memory / this (mean) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for rank in sorted(by_rank):
        for round_number in range(args.rounds):
            floor = by_rank[rank]["in memory"][round_number].mean()
            for side, rounds in by_rank[rank].items():
                d = rounds[round_number]
                excess = (d - np.median(d)).clip(0).sum()
                print(
                    f"| {rank} | {round_number} | {side} | {np.median(d):.3f} | {d.mean():.3f} | "
                    f"{np.percentile(d, 90):.3f} | {np.percentile(d, 99):.3f} | {excess:.0f} | {floor / d.mean():.3f} |"
                )
    # The ranks step together, so the loop's throughput follows the mean step (alike on every rank).
    for side in sides(args)[1:]:
        ratios = [
            np.mean([by_rank[r]["in memory"][n].mean() / by_rank[r][side][n].mean() for r in by_rank])
            for n in range(args.rounds)
        ]
        print(
            f"{side} / in-memory DDP, samples/s by round: {', '.join(f'{r:.3f}' for r in ratios)}"
            f" (median {np.median(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
