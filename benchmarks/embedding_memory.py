"""A table larger than one rank's memory budget, trained on two ranks under Spark's own limit.

    .venv/bin/python benchmarks/embedding_memory.py [--budget 3g] [--table-ratio 1.1] [--dim 16]

``spark.executor.pyspark.memory`` is the budget: Spark caps each Python worker's address space
(``RLIMIT_AS``) at it, so a rank that outgrows it gets an allocation error, never the kernel's
out-of-memory killer. The table (``ShardedEmbedding``, row-wise Adagrad) is sized so that its
rows and their Adagrad state take ``--table-ratio`` times the budget; one epoch touches every
row once (each rank a shuffled half of the ids), so every row is created. Two runs on one
``local-cluster[2,1,1024]`` application:

* ``ShardedEmbedding`` under ``ParameterServer``: each rank reports its rows, its peak RSS
  (``VmHWM``), its peak address space (``VmPeak``, what the limit counts) and its samples/s;
* the same table as ``nn.Embedding(sparse=True)`` with ``torch.optim.Adagrad`` under
  ``AllReduce`` (each rank a replica of the table and its state): the error it fails with.

The script asserts that the table's rows and state exceed the budget, that every rank stayed
under it, and that the replicated run failed with sparkdl's out-of-memory error naming the
setting. Nothing is returned to the driver but these figures (the fitted table itself would
have to fit rank 0: docs/embeddings.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"

import torch  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl.data.shard_cache import _bytes_of  # noqa: E402  (Spark's size strings)

#: Bytes a held row costs a shard with Adagrad: values and sums, dim float32 each, and the
#: row store's index (8 bytes of id and 8-16 of hash buckets: docs/embeddings.md).
INDEX_BYTES = 24
BATCH = 8192


def row_bytes(dim: int) -> int:
    return 2 * 4 * dim + INDEX_BYTES


def make_loop(num_rows: int, dim: int, sharded: bool):
    """The ranks' loop: one epoch over a shuffled half of the ids each, a regression of each
    row's sum towards a value hashed from its id."""

    def loop(ctx: Any) -> Dict[str, Any]:
        import torch.distributed as dist

        def status_mib(key: str) -> float:
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) / 1024 for line in status if line.startswith(key + ":"))

        class Table(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                if sharded:
                    self.items = sparkdl.ShardedEmbedding(num_rows, dim, optimizer="adagrad", lr=0.1)
                else:
                    self.items = torch.nn.Embedding(num_rows, dim, sparse=True)
                self.scale = torch.nn.Parameter(torch.ones(1))

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.items(ids).sum(dim=1) * self.scale

        model = ctx.prepare_model(Table())
        inner = getattr(model, "module", model)
        dense = [inner.scale] if sharded else list(inner.parameters())
        optimizer = ctx.prepare_optimizer(torch.optim.Adagrad(dense, lr=0.1))
        half = num_rows // ctx.world_size
        mine = torch.randperm(half, generator=torch.Generator().manual_seed(ctx.rank)) + ctx.rank * half
        started, steps = time.time(), 0
        for start in range(0, len(mine), BATCH):
            ids = mine[start : start + BATCH]
            target = ((ids * 2654435761) % 1000).float() / 1000.0
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(ids), target).backward()
            optimizer.step()
            steps += 1
        measured = {
            "rank": ctx.rank,
            "steps": steps,
            "samples_per_s": len(mine) / (time.time() - started),
            "peak_rss_mib": status_mib("VmHWM"),
            "peak_address_space_mib": status_mib("VmPeak"),
        }
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, measured)  # no server closes before every rank is done
        return {"ranks": gathered}

    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="3g", help="spark.executor.pyspark.memory (default 3g)")
    parser.add_argument("--table-ratio", type=float, default=1.1, help="the table's rows and state / the budget")
    parser.add_argument("--dim", type=int, default=16)
    args = parser.parse_args()
    budget = _bytes_of(args.budget)
    num_rows = int(args.table_ratio * budget / row_bytes(args.dim))
    table_bytes = num_rows * row_bytes(args.dim)

    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .config("spark.executor.pyspark.memory", args.budget)
        # The limit counts address space; pyarrow's default allocator would reserve 1 GiB of it
        # in each worker (sparkdl/_driver/memory_check.py).
        .config("spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL", "system")
        .config("spark.executor.cores", "1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYTHONPATH", ROOT)
        .getOrCreate()
    )
    print(
        f"{datetime.date.today()}: budget spark.executor.pyspark.memory={args.budget} ({budget / 2**20:,.0f} MiB a "
        f"rank); table {num_rows:,} rows x {args.dim} float32 with Adagrad: {table_bytes / 2**20:,.0f} MiB of rows, "
        f"state and index ({table_bytes / budget:.2f}x the budget); torch {torch.__version__}"
    )
    started = time.time()
    result = sparkdl.run(
        make_loop(num_rows, args.dim, sharded=True),
        num_workers=2,
        strategy=sparkdl.ParameterServer(max_staleness=2),
        spark=spark,
        progress=False,
    )
    print(f"\nShardedEmbedding under ParameterServer, 2 ranks: trained in {time.time() - started:.0f} s (the call)")
    print("| rank | steps | samples/s | peak RSS | peak address space | budget |\n|---:|---:|---:|---:|---:|---:|")
    for rank in result["ranks"]:
        print(
            f"| {rank['rank']} | {rank['steps']} | {rank['samples_per_s']:,.0f} | {rank['peak_rss_mib']:,.0f} MiB | "
            f"{rank['peak_address_space_mib']:,.0f} MiB | {budget / 2**20:,.0f} MiB |"
        )
    assert table_bytes > budget, "the table must exceed one rank's budget"
    assert all(rank["peak_address_space_mib"] * 2**20 <= budget for rank in result["ranks"])

    started = time.time()
    try:
        sparkdl.run(
            make_loop(num_rows, args.dim, sharded=False),
            num_workers=2,
            strategy=sparkdl.AllReduce(),
            spark=spark,
            progress=False,
            max_failures=0,
        )
    except sparkdl.ConfigError as exc:
        text = str(exc)
        print(f"\nnn.Embedding(sparse=True) under AllReduce: failed after {time.time() - started:.0f} s with\n{text}")
        assert "ran out of memory" in text and "spark.executor.pyspark.memory" in text, text
    else:
        raise AssertionError("a replica of the whole table and its state trained within the budget")
    spark.stop()


if __name__ == "__main__":
    main()
