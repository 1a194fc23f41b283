"""``sparkdl compare``: train the model with each strategy for the same epochs and print one table;
writes DIR/compare.json and DIR/compare.png. The model, data and training options are
``sparkdl train``'s own (the same argparse actions, so they cannot drift apart)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from sparkdl.cli._common import UsageError, check_input, check_output, session_running, spark_session
from sparkdl.cli._train import add_train_options, estimator_arguments
from sparkdl.filesystem import basename, exists, remove_file, url_join

#: ``sparkdl train`` options that ``compare`` takes as they are (dest names).
SHARED_OPTIONS = (
    "data",
    "model",
    "features",
    "inputs",
    "label",
    "num_workers",
    "epochs",
    "batch_size",
    "optimizer",
    "lr",
    "momentum",
    "loss",
    "seed",
    "master",
    "quiet",
    "reader",
    "decode_threads",
    "shard_cache",
    "validation",
    "metrics",
    "precision",
    "slot_wait_s",
    "resources",
)


def build_compare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl compare",
        description="Train the model with each strategy (same data, model, optimizer, seed and epochs) and compare "
        "samples/s, comm bytes per sample, the loss after the budget and the time to a target loss.",
    )
    # Without train's strategy, checkpoint and tracking options, which a comparison sets or refuses.
    add_train_options(parser, SHARED_OPTIONS)
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies with :KEY=VALUE settings, e.g. allreduce,model_averaging:sync_every=4,"
        "parameter_server:max_staleness=2 (default: allreduce, model_averaging at sync_every 4 and 16, elastic_averaging, "
        "parameter_server unbounded and with max_staleness=2)",
    )
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="also report the training time until the loss is at or below this",
    )
    parser.add_argument(
        "--slow-rank", type=int, default=None, help="simulate a straggler: this rank sleeps before every training step"
    )
    parser.add_argument(
        "--slow-seconds", type=float, default=None, help="the slowed rank's sleep per step (default 0.05 s)"
    )
    parser.add_argument("--output", required=True, help="directory (path or URL) for compare.json and compare.png")
    parser.add_argument(
        "--no-plot", dest="plot", action="store_false", help="do not draw compare.png (no matplotlib needed)"
    )
    return parser


def compare_main(argv: Optional[List[str]] = None) -> int:
    """Entry point: 0 when every strategy trained, 1 when one failed (its row says why), 2 on bad
    arguments (``--data`` included: a path that does not exist or lacks the columns is one
    message, before Spark starts)."""
    from sparkdl.comparison import DEFAULT_SLOW_S, CompareSettings, check_data, compare
    from sparkdl.comparison.result import check_plotting
    from sparkdl.errors import ConfigError, DataError
    from sparkdl.estimator import TorchEstimator

    args = build_compare_parser().parse_args(argv)
    try:
        estimator = estimator_arguments(args)
        slow_s = DEFAULT_SLOW_S if args.slow_seconds is None else args.slow_seconds
        if args.slow_seconds is not None and args.slow_rank is None:
            raise UsageError("--slow-seconds needs --slow-rank (which rank to slow down)")
        # Checked before Spark starts: a typo costs a second, not a session.
        settings = CompareSettings(
            strategies=args.strategies,
            epochs=args.epochs,
            num_workers=args.num_workers,
            target_loss=args.target_loss,
            slow_rank=args.slow_rank,
            slow_s=slow_s,
        )
        if args.plot:
            check_plotting()
        check_input(args.output, "--output")  # its scheme now; writing to it after --data's checks
        # --data is a path or URL: checked (exists, holds the columns, fills every shard) once,
        # before Spark starts, not by every strategy in turn.
        check_data(args.data, TorchEstimator(**estimator, progress=False))
        check_output(args.output)
        for name in ("compare.json", "compare.png"):  # what the directory lists afterwards is this run's
            remove_file(url_join(args.output, name))
    except DataError as exc:
        print(f"sparkdl compare: --data: {exc}", file=sys.stderr)
        return 2
    except (UsageError, ConfigError, OSError) as exc:
        print(f"sparkdl compare: {_option_names(str(exc))}", file=sys.stderr)
        return 2

    started = time.time()
    borrowed = session_running()
    spark = spark_session(f"sparkdl-compare {basename(args.output)}", args.master)
    try:
        comparison = compare(
            data=args.data,
            strategies=dict(settings.strategies),
            target_loss=settings.target_loss,
            slow_rank=settings.slow_rank,
            slow_s=settings.slow_s,
            output_dir=args.output,
            plot=args.plot,
            progress=not args.quiet,
            **estimator,
        )
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        print(f"sparkdl compare: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    finally:
        if not borrowed:
            spark.stop()
    print(comparison.table())
    written = [url_join(args.output, name) for name in ("compare.json", "compare.png")]
    written = [path for path in written if exists(path)]
    print(
        f"\nsparkdl compare: {len(comparison.rows)} strategies in {time.time() - started:.1f}s; wrote {', '.join(written)}"
    )
    if not comparison.ok:
        print(
            f"sparkdl compare: failed: {', '.join(row.label for row in comparison.failures)} (see the table)",
            file=sys.stderr,
        )
        return 1
    return 0


def _option_names(message: str) -> str:
    """A library message in the command line's terms (``slow_rank=`` is ``--slow-rank``)."""
    for name, option in (
        ("slow_rank=", "--slow-rank "),
        ("slow_s=", "--slow-seconds "),
        ("target_loss=", "--target-loss "),
        ("epochs=", "--epochs "),
        ("num_workers=", "--num-workers "),
        ("strategies=", "--strategies "),
    ):
        message = message.replace(name, option)
    return message.replace("strategies:", "--strategies:")
