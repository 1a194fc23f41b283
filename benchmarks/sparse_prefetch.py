"""A forward's ShardedEmbedding pulls, one round trip per table against one per forward, side by side.

    .venv/bin/python benchmarks/sparse_prefetch.py              # 3 rounds of each side
    .venv/bin/python benchmarks/sparse_prefetch.py --rounds 1 --steps 50

Two ranks in two processes on loopback (real gloo groups, real parameter-server connections,
no Spark), each training the DLRM of ``examples/recsys/model.py`` (10 tables of 2,000,000 rows,
width 4, Adagrad) on its own Zipf-distributed ids (exponent 1.2, batch 256 per rank), once per
side:

* ``sharded PS, a pull per lookup``: ``ParameterServer(max_staleness=2)`` with the prefetch
  detached (``SparseTables.close()`` after ``prepare_model``): each table's lookup waits for
  its own round trip to the other rank;
* ``sharded PS, prefetched``: the same with the prefetch (``prefetch.py``): every table's pulls
  go out before the forward, one round trip per peer;
* ``sparse DDP``: ``nn.Embedding(sparse=True)`` under torch's DistributedDataParallel, for scale.

samples/s is both ranks' over the timed steps (after ``--warmup``); the sides take turns for
``--rounds`` rounds and the table shows each side's median, so that load from elsewhere on the
machine falls on all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIDES = ("sharded PS, a pull per lookup", "sharded PS, prefetched", "sparse DDP")
VOCABULARY, TABLES, BATCH = 2_000_000, 10, 256


def _batches(rank: int, steps: int) -> List[Any]:
    import numpy as np
    import torch

    rng = np.random.default_rng(rank)
    out = []
    for _ in range(steps):
        ids = {f"c{i}": torch.from_numpy((rng.zipf(1.2, BATCH) * 7919 + i) % VOCABULARY) for i in range(TABLES)}
        out.append((torch.randn(BATCH, 4), ids, torch.randint(0, 2, (BATCH,)).float()))
    return out


def _side(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from examples.recsys.model import DLRM, make_optimizer
    from tests.gloo import cpu_env, join_group, save_results

    side, steps, warmup = os.environ["SIDE"], int(os.environ["STEPS"]), int(os.environ["WARMUP"])
    join_group(rank, port, 2)
    batches = _batches(rank, warmup + steps)
    torch.manual_seed(0)
    runtime = None
    if side.startswith("sharded PS"):
        import sparkdl
        from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime

        def gather(message: str) -> List[str]:
            out: List[Any] = [None] * 2
            dist.all_gather_object(out, message)
            return out

        runtime = ParameterServerRuntime(
            sparkdl.ParameterServer(max_staleness=2), cpu_env(rank, port, 2), gather, "127.0.0.1"
        )
        model = runtime.prepare_model(DLRM([VOCABULARY] * TABLES, tables="sharded"))
        if side.endswith("a pull per lookup"):
            runtime.sparse.close()
        optimizer = runtime.prepare_optimizer(make_optimizer(model.parameters()))
    else:
        model = torch.nn.parallel.DistributedDataParallel(DLRM([VOCABULARY] * TABLES, tables="sparse"))
        optimizer = make_optimizer(model.parameters())
    started = 0.0
    for step, (dense, ids, clicked) in enumerate(batches):
        if step == warmup:
            dist.barrier()
            started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(dense, **ids), clicked).backward()
        optimizer.step()
    seconds = time.perf_counter() - started
    dist.barrier()
    if runtime is not None:
        runtime.close()
    save_results({"samples_per_s": steps * BATCH / seconds}, out_dir, rank)


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="times each side runs, taking turns")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    args = parser.parse_args(argv)
    from tests.gloo import spawn_ranks

    results: Dict[str, List[float]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            os.environ.update(SIDE=side, STEPS=str(args.steps), WARMUP=str(args.warmup))
            with tempfile.TemporaryDirectory() as out_dir:
                ranks = spawn_ranks(_side, 2, out_dir)
            results[side].append(sum(rank["samples_per_s"] for rank in ranks))
    plain = statistics.median(results[SIDES[0]])
    print(f"2 ranks, {TABLES} tables of {VOCABULARY:,} rows, batch {BATCH}, {args.rounds} rounds of {args.steps} steps")
    print("| side | samples/s (median) | runs | vs a pull per lookup |")
    print("| --- | ---: | --- | ---: |")
    for side in SIDES:
        median = statistics.median(results[side])
        runs = ", ".join(f"{value:,.0f}" for value in results[side])
        print(f"| {side} | {median:,.0f} | {runs} | {median / plain:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
