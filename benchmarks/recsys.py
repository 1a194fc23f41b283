"""The recommendation workload of ``examples/recsys`` under three strategies, side by side.

    .venv/bin/python benchmarks/recsys.py                         # 20 M ids, 100k rows
    .venv/bin/python benchmarks/recsys.py --vocab-scale 0.01      # 200k ids: every side fits

One run generates the click log with Spark (``examples/recsys/data.py``: 10 Zipf-distributed
categorical features over vocabularies of 20 M ids in all at ``--vocab-scale 1``, 4 dense
features, labels from a hidden logistic model), then trains the same DLRM
(``examples/recsys/model.py``) for one epoch, with the same batches, batch size and Adagrad,
with ``sparkdl.run`` on its own ``local-cluster[2,1,...]`` application (2 ranks), once per side:

* ``sharded PS``: ``ParameterServer(max_staleness=2)`` with ``ShardedEmbedding`` tables (rows
  sharded over the ranks, each step pulls and pushes the batch's unique rows);
* ``sparse AllReduce``: ``AllReduce()`` (DDP) with ``nn.Embedding(sparse=True)``: every rank
  holds every table and its Adagrad state, gradients are allreduced as sparse tensors;
* ``dense PS``: ``ParameterServer(max_staleness=2)`` with ``nn.Embedding``: every parameter is
  pushed and pulled every step; skipped when the tables exceed ``--dense-ps-limit-mb`` (each
  step would move them twice per rank).

A side whose per-rank copy of the tables and their Adagrad state exceeds ``--replica-limit-mb``
is skipped and the table says so. Columns (``benchmarks/_recsys_loop.py`` measures them):
samples/s of both ranks after ``--warmup`` steps; bytes per step each rank sends (the
parameter server's own counter; for sparse AllReduce counted from each batch's unique ids as
gloo's sparse allreduce sends them); the larger rank's peak RSS (``VmHWM``, the whole Python
worker); the AUC on the held-out rows after the epoch (equal samples on every side), next to
the hidden model's AUC on the same rows, the best reachable. Timing is wall clock on whatever
else the machine runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "benchmarks"))
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"

import sparkdl  # noqa: E402
from benchmarks._recsys_loop import make_loop, summarize  # noqa: E402  (importable on the executors too)
from examples.recsys.data import bayes_auc, generate, read_test  # noqa: E402
from examples.recsys.model import model_inputs, table_bytes  # noqa: E402

SIDES = {
    "sharded PS": ("sharded", lambda: sparkdl.ParameterServer(max_staleness=2), "ShardedEmbedding"),
    "sparse AllReduce": ("sparse", lambda: sparkdl.AllReduce(), "nn.Embedding(sparse=True)"),
    "dense PS": ("dense", lambda: sparkdl.ParameterServer(max_staleness=2), "nn.Embedding"),
}


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the click log (train and test)")
    parser.add_argument("--vocab-scale", type=float, default=1.0, help="vocabularies times this (1: 20 M ids)")
    parser.add_argument("--dim", type=int, default=4, help="embedding width (the example's)")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch on each rank")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each side")
    parser.add_argument("--test-rows", type=int, default=20_000, help="held-out rows scored for the AUC")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of: " + ", ".join(SIDES))
    parser.add_argument("--replica-limit-mb", type=float, default=4096, help="skip sides whose tables+state exceed it")
    parser.add_argument("--dense-ps-limit-mb", type=float, default=128, help="skip dense PS above these table MB")
    parser.add_argument("--data", default=None, help="where the click log goes (default: a temporary directory)")
    parser.add_argument("--memory-mb", type=int, default=3072, help="each executor's JVM heap")
    args = parser.parse_args(list(argv))
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        parser.error(f"unknown sides {unknown}; choose from {list(SIDES)}")

    from _spark import local_cluster

    spark = local_cluster("sparkdl-benchmark-recsys", executor_memory_mb=args.memory_mb, pythonpath=(ROOT,))
    scratch = None if args.data else tempfile.TemporaryDirectory(prefix="sparkdl-recsys-")
    try:
        started = time.time()
        log = generate(spark, args.data or scratch.name, args.rows, args.vocab_scale, seed=0)
        print(f"click log: {args.rows:,} rows, {sum(log.vocabularies):,} ids, in {time.time() - started:.0f} s")
        best = bayes_auc(read_test(log, limit=args.test_rows))
        tables_mb = table_bytes(log.vocabularies, args.dim) / 2**20
        lines = [
            f"{datetime.date.today()}: `benchmarks/recsys.py {' '.join(argv)}`, {args.rows:,} rows, "
            f"{sum(log.vocabularies):,} ids in {len(log.vocabularies)} tables of width {args.dim} "
            f"({tables_mb:,.0f} MB float32), batch {args.batch_size} per rank, 2 ranks, 1 epoch, Adagrad",
            "",
            "| side | tables | samples/s | bytes/step/rank | peak RSS/rank | AUC | hidden model's AUC |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for side in sides:
            tables, strategy, label = SIDES[side]
            skipped = skip_reason(tables, tables_mb, args)
            if skipped:
                lines.append(f"| {side} | {label} | {skipped} | | | | {best:.4f} |")
                print(lines[-1], flush=True)
                continue
            result = sparkdl.run(
                make_loop(log.vocabularies, tables, args.dim, args.warmup, log.test, args.test_rows),
                num_workers=2,
                strategy=strategy(),
                data=log.train,
                inputs=model_inputs(len(log.vocabularies)),
                label_col="label",
                batch_size=args.batch_size,
                spark=spark,
                progress=False,
            )
            row = summarize(result, tables)
            lines.append(
                f"| {side} | {label} | {row['samples_per_sec']:,.0f} | {_bytes(row['bytes_per_step'])} | "
                f"{row['peak_rss_mib']:,.0f} MiB | {row['auc']:.4f} | {best:.4f} |"
            )
            print(lines[-1], flush=True)
        print("\n" + "\n".join(lines))
    finally:
        spark.stop()
        if scratch is not None:
            scratch.cleanup()


def skip_reason(tables: str, tables_mb: float, args) -> str:
    if tables != "sharded" and 2 * tables_mb > args.replica_limit_mb:
        return f"skipped: tables + Adagrad state {2 * tables_mb:,.0f} MB per rank > {args.replica_limit_mb:,.0f} MB"
    if tables == "dense" and tables_mb > args.dense_ps_limit_mb:
        return f"skipped: every step would push and pull {tables_mb:,.0f} MB per rank"
    return ""


def _bytes(value: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


if __name__ == "__main__":
    main(sys.argv[1:])


__all__: List[str] = ["main"]
