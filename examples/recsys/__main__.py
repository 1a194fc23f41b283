"""Generates a click log with Spark, trains the DLRM with sharded embeddings, prints its AUC.

    python -m examples.recsys /tmp/clicks                     # 200k rows, 20 M ids in 10 tables
    python -m examples.recsys /tmp/clicks --rows 5000000 --epochs 2

The default (200,000 rows, one epoch, 2 workers) runs in a few minutes on 2 cores. The AUC
printed next to the model's is the hidden model's on the same held-out rows: the best any
model can reach there. With 20 M ids and few rows most ids are seen once or never, so the gap
closes with more rows (``--rows``) or smaller vocabularies (``--vocab-scale``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from examples.recsys.data import generate
from examples.recsys.train import fit_and_evaluate, local_session


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="where the click log is written (DIR/train, DIR/test)")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the log, train and test (default 200,000)")
    parser.add_argument("--vocab-scale", type=float, default=1.0, help="vocabularies times this (1: 20 M ids)")
    parser.add_argument("--zipf", type=float, default=1.1, help="exponent of the ids' power law (default 1.1)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256, help="rows per batch on each rank")
    parser.add_argument(
        "--dim",
        type=int,
        default=4,
        help="embedding width (default 4: the fitted tables, 320 MB, come back to the driver)",
    )
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = local_session()
    try:
        started = time.time()
        log = generate(spark, os.path.abspath(args.dir), args.rows, args.vocab_scale, args.zipf, seed=args.seed)
        print(
            f"generated {args.rows:,} rows, {sum(log.vocabularies):,} ids in {len(log.vocabularies)} tables "
            f"in {time.time() - started:.1f} s: {log.train}, {log.test}"
        )
        outcome = fit_and_evaluate(
            log,
            num_workers=args.num_workers,
            batch_size=args.batch_size,
            epochs=args.epochs,
            dim=args.dim,
            seed=args.seed,
        )
        print(outcome.summary())
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
