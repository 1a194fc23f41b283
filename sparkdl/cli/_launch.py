"""``sparkdl launch [options] script.py -- args``: an existing training script on barrier tasks.

Runs ``sparkdl.launch(script, *args, ...)`` (docs/launch.md): every rank runs the script in a
child process with torchrun's environment; the children's output is printed prefixed with the
rank. The exit status is rank 0's script's (0), the failing rank's script status when a script
exited non-zero, 1 for any other failed launch and 2 for bad arguments; rank 0's last lines of
output are printed at the end.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import List, Optional

from sparkdl.cli._common import UsageError, add_slot_wait_argument, spark_session
from sparkdl.data.readers import registered_readers


def build_launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl launch",
        description="Run a training script unchanged on Spark barrier tasks, torchrun style (docs/launch.md).",
    )
    parser.add_argument(
        "script", help="the Python script every rank runs (every executor must see it: --files, a shared filesystem)"
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments, after --")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--master", default=None, help="Spark master when not started by spark-submit")
    parser.add_argument(
        "--data", default=None, help="Parquet/Petastorm dataset sparkdl.shard_dataset() streams in the script"
    )
    parser.add_argument("--features", default=None, help="feature column(s), comma-separated (one tensor per batch)")
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        dest="inputs",
        help="a named input, as for sparkdl train",
    )
    parser.add_argument("--label", default=None, help="label column")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch on each worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shuffle", dest="shuffle", action="store_false")
    parser.add_argument("--reader", choices=registered_readers(), default="arrow")
    parser.add_argument(
        "--timeout", type=float, default=600.0, dest="timeout_s", help="rendezvous and store timeout, seconds"
    )
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument("--watchdog-timeout", type=float, default=600.0, dest="watchdog_timeout_s")
    add_slot_wait_argument(parser)
    parser.add_argument("--quiet", action="store_true", help="do not print the ranks' output on the driver")
    return parser


def launch_main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``sparkdl launch``; returns the exit status."""
    from sparkdl.cli._inputs import parse_inputs

    args = build_launch_parser().parse_args(argv)
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    try:
        inputs = parse_inputs(args.inputs) if args.inputs else None
        if args.data is None and (inputs or args.features or args.label):
            raise UsageError("--features, --input and --label describe --data: give --data too")
        if args.data is not None and bool(inputs) == bool(args.features):
            raise UsageError("with --data give --features or --input NAME=SPEC, not both and not neither")
    except UsageError as exc:
        print(f"sparkdl launch: {exc}", file=sys.stderr)
        return 2

    import sparkdl
    from sparkdl.errors import ConfigError, SparkdlError, TrainingError

    spark = spark_session(f"sparkdl launch {args.script}", args.master)
    data_options = {}
    if args.data is not None:
        data_options = dict(
            data=args.data,
            feature_cols=[c.strip() for c in args.features.split(",") if c.strip()] if args.features else (),
            inputs=inputs,
            label_col=args.label,
            batch_size=args.batch_size,
            seed=args.seed,
            shuffle=args.shuffle,
            reader=args.reader,
        )
    try:
        result = sparkdl.launch(
            args.script,
            *script_args,
            num_workers=args.num_workers,
            spark=spark,
            progress=not args.quiet,
            timeout_s=args.timeout_s,
            max_failures=args.max_failures,
            watchdog_timeout_s=args.watchdog_timeout_s,
            slot_wait_s=args.slot_wait_s,
            **data_options,
        )
    except ConfigError as exc:
        print(f"sparkdl launch: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"sparkdl launch: {exc}", file=sys.stderr)
        first = exc.failures[0] if exc.failures else None
        status = (
            re.search(r"exited with status (\d+) on rank", first.message)
            if first is not None and first.exc_type == "ScriptExitError"
            else None
        )
        return int(status.group(1)) if status else 1
    except SparkdlError as exc:
        print(f"sparkdl launch: {exc}", file=sys.stderr)
        return 1
    finally:
        from sparkdl._driver.cluster import settle

        settle()  # a failed stage's killed tasks end first: stopping under them fails them noisily
        spark.stop()
    print(f"sparkdl launch: {args.script} finished on {args.num_workers} rank(s); rank 0's last lines:")
    for line in result.last_lines:
        print(f"  {line}")
    return result.exit_code
