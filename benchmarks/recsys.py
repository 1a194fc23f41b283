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
  pushed and pulled every step; skipped when the tables exceed ``--dense-limit-mb`` (each
  step would move them twice per rank);
* ``dense AllReduce``: ``AllReduce()`` with ``nn.Embedding``: dense gradients of the whole
  tables allreduced every step (what DDP does without ``sparse=True``); same limit.
  ``--dense-steps N`` runs the dense sides for N timed steps only (their samples/s on a slow
  link, where an epoch would take hours; their AUC is then after fewer samples, and says so),
  after one untimed step instead of ``--warmup``.

A side whose per-rank copy of the tables and their Adagrad state exceeds ``--replica-limit-mb``
is skipped and the table says so. Columns (``benchmarks/_recsys_loop.py`` measures them):
samples/s of both ranks after ``--warmup`` steps; bytes per step each rank sends (the
parameter server's own counter; for sparse AllReduce counted from each batch's unique ids as
gloo's sparse allreduce sends them); the larger rank's peak RSS (``VmHWM``, the whole Python
worker, from the RSS it had when the loop started: Spark reuses Python workers); run: the whole ``sparkdl.run`` (launch, DDP's broadcast of the initial tables, scoring);
the AUC on the held-out rows after the epoch (equal samples on every side), next to
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
from benchmarks._recsys_network import (  # noqa: E402
    add_network_arguments,
    cluster_session,
    link_label,
    run_on_netcluster,
    shape,
)
from examples.recsys.data import bayes_auc, generate, read_test  # noqa: E402
from examples.recsys.model import model_inputs, table_bytes  # noqa: E402

SIDES = {
    "sharded PS": ("sharded", lambda: sparkdl.ParameterServer(max_staleness=2), "ShardedEmbedding"),
    "sparse AllReduce": ("sparse", lambda: sparkdl.AllReduce(), "nn.Embedding(sparse=True)"),
    "dense PS": ("dense", lambda: sparkdl.ParameterServer(max_staleness=2), "nn.Embedding"),
    "dense AllReduce": ("dense", lambda: sparkdl.AllReduce(), "nn.Embedding"),
}


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the click log (train and test)")
    parser.add_argument("--vocab-scale", type=float, default=1.0, help="vocabularies times this (1: 20 M ids)")
    parser.add_argument("--dim", type=int, default=4, help="embedding width (the example's)")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch on each rank")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each side")
    parser.add_argument("--test-rows", type=int, default=20_000, help="held-out rows scored for the AUC")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated, of: " + ", ".join(SIDES))
    parser.add_argument("--replica-limit-mb", type=float, default=4096, help="skip sides whose tables+state exceed it")
    parser.add_argument("--dense-limit-mb", type=float, default=128, help="skip dense sides above these table MB")
    parser.add_argument(
        "--dense-steps", type=int, default=0, help="dense sides: stop after this many timed steps (0: the epoch)"
    )
    parser.add_argument("--data", default=None, help="where the click log goes (default: a temporary directory)")
    parser.add_argument("--memory-mb", type=int, default=3072, help="each executor's JVM heap")
    add_network_arguments(parser)
    args = parser.parse_args(list(argv))
    args.side_list = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in args.side_list if s not in SIDES]
    if unknown:
        parser.error(f"unknown sides {unknown}; choose from {list(SIDES)}")
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    if args.netcluster and not args.driver:
        return run_on_netcluster(args, argv)  # builds the cluster and runs this file as its driver
    if args.driver:
        spark, links, data_dir = cluster_session(args), args.rate_list, os.path.join(args.cluster_dir, "recsys-data")
    else:
        from _spark import local_cluster

        spark = local_cluster("sparkdl-benchmark-recsys", executor_memory_mb=args.memory_mb, pythonpath=(ROOT,))
        links, data_dir = ["loopback"], args.data
    scratch = None if data_dir else tempfile.TemporaryDirectory(prefix="sparkdl-recsys-")
    try:
        started = time.time()
        log = generate(spark, data_dir or scratch.name, args.rows, args.vocab_scale, seed=0)
        print(f"click log: {args.rows:,} rows, {sum(log.vocabularies):,} ids, in {time.time() - started:.0f} s")
        best = bayes_auc(read_test(log, limit=args.test_rows))
        tables_mb = table_bytes(log.vocabularies, args.dim) / 2**20
        lines = [
            f"{datetime.date.today()}: `benchmarks/recsys.py {' '.join(argv)}`, {args.rows:,} rows, "
            f"{sum(log.vocabularies):,} ids in {len(log.vocabularies)} tables of width {args.dim} "
            f"({tables_mb:,.0f} MB float32), batch {args.batch_size} per rank, 2 ranks, 1 epoch, Adagrad",
            "",
            "| link | side | tables | samples/s | bytes/step/rank | peak RSS/rank | run | AUC | hidden model's AUC |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for link in links:
            if args.driver:
                shape(args, link)
            for side in args.side_list:
                lines.append(f"| {link_label(link)} | " + measure_side(spark, log, side, tables_mb, best, args))
                print(lines[-1], flush=True)
        print("\n" + "\n".join(lines))
    finally:
        if args.driver:
            shape(args, "none")
        spark.stop()
        if scratch is not None:
            scratch.cleanup()
    return 0


def measure_side(spark, log, side: str, tables_mb: float, best: float, args) -> str:
    """One fit of one side; its row of the table (without the link column)."""
    tables, strategy, label = SIDES[side]
    skipped = skip_reason(tables, tables_mb, args)
    if skipped:
        return f"{side} | {label} | {skipped} | | | | | {best:.4f} |"
    started = time.time()
    capped = args.dense_steps if tables == "dense" else 0
    warmup = min(args.warmup, 1) if capped else args.warmup  # a capped side's steps take seconds each
    result = sparkdl.run(
        make_loop(log.vocabularies, tables, args.dim, warmup, log.test, args.test_rows, capped),
        num_workers=2,
        strategy=strategy(),
        data=log.train,
        inputs=model_inputs(len(log.vocabularies)),
        label_col="label",
        batch_size=args.batch_size,
        spark=spark,
        progress=False,
    )
    seconds = time.time() - started
    row = summarize(result, tables)
    auc = f"{row['auc']:.4f}" + (f" after {row['samples']:,} samples" if capped else "")
    if tables == "sharded":  # the share of lookups whose rows came before their forward (prefetch.py)
        label += f" ({row['prefetched_share']:.0%} of lookups prefetched)"
    return (
        f"{side} | {label} | {row['samples_per_sec']:,.0f} | {_bytes(row['bytes_per_step'])} | "
        f"{row['peak_rss_mib']:,.0f} MiB (from {row['start_rss_mib']:,.0f}) | {seconds:.0f} s | {auc} | {best:.4f} |"
    )


def skip_reason(tables: str, tables_mb: float, args) -> str:
    if tables != "sharded" and 2 * tables_mb > args.replica_limit_mb:
        return f"skipped: tables + Adagrad state {2 * tables_mb:,.0f} MB per rank > {args.replica_limit_mb:,.0f} MB"
    if tables == "dense" and tables_mb > args.dense_limit_mb:
        return f"skipped: every step would move the {tables_mb:,.0f} MB of tables (> --dense-limit-mb)"
    return ""


def _bytes(value: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__: List[str] = ["main"]
