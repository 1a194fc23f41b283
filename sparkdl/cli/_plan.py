"""``sparkdl plan``: calibrate on this cluster for about a minute, then predict each strategy's
samples/s, scaling efficiency, bytes on the wire and memory per rank on 2 to 1024 workers; prints
one table and writes DIR/plan.json and DIR/plan.png. The model and data options are ``sparkdl
train``'s own (the same argparse actions)."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from sparkdl.cli._common import UsageError, check_output, session_running, spark_session
from sparkdl.cli._train import add_train_options
from sparkdl.filesystem import basename

#: ``sparkdl train`` options that ``plan`` takes as they are (dest names).
SHARED_OPTIONS = (
    "data",
    "model",
    "features",
    "inputs",
    "label",
    "batch_size",
    "optimizer",
    "lr",
    "momentum",
    "loss",
    "master",
    "quiet",
)


def build_plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl plan",
        description="Calibrate on this cluster (about half a minute: two tasks' steps and data paths timed together, the "
        "link between them) and predict each strategy's throughput on 2 to 1024 workers.",
    )
    add_train_options(parser, SHARED_OPTIONS)
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies with :KEY=VALUE settings, as for sparkdl compare (default: allreduce, "
        "model averaging every 8, DiLoCo every 64, elastic averaging, parameter server, sharded)",
    )
    parser.add_argument(
        "--workers",
        default=None,
        help="comma-separated worker counts to predict for (default 2,4,8,...,1024)",
    )
    parser.add_argument(
        "--bandwidth",
        default=None,
        help="the link between hosts, e.g. 10Gbit or 100mbit, instead of the measured one (needed when the "
        "calibration's two tasks share a host)",
    )
    parser.add_argument("--latency", default=None, help="one message's cost, e.g. 50us, instead of the measured one")
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="the memory one rank may use, e.g. 4g: a prediction over it says 'does not fit' (default: a task's "
        "share of spark.executor.pyspark.memory when set)",
    )
    parser.add_argument("--output", required=True, help="directory (path or URL) for plan.json and plan.png")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw plan.png")
    parser.set_defaults(metrics=[], validation=None)  # train's options a plan has no use for
    return parser


def plan_main(argv: Optional[List[str]] = None) -> int:
    """0 with a plan, 1 when the calibration failed, 2 on bad arguments."""
    from sparkdl.cli._train import LOSSES, _optimizer_factory, load_factory, model_inputs
    from sparkdl.comparison.strategies import labelled_strategies
    from sparkdl.errors import ConfigError, DataError
    from sparkdl.planning import DEFAULT_WORKERS, plan
    from sparkdl.planning.units import bandwidth_bytes, latency_seconds, memory_bytes

    args = build_plan_parser().parse_args(argv)
    try:
        workers = DEFAULT_WORKERS
        if args.workers:
            try:
                workers = tuple(int(n) for n in args.workers.split(",") if n.strip())
            except ValueError:
                raise UsageError(f"--workers {args.workers!r}: comma-separated whole numbers such as 2,4,8") from None
        bandwidth_bytes(args.bandwidth, "--bandwidth")
        latency_seconds(args.latency, "--latency")
        memory_bytes(args.memory_budget, "--memory-budget")
        if args.strategies is not None:  # a misspelt name is named before a JVM starts
            labelled_strategies(args.strategies)
        feature_cols, inputs = model_inputs(args)
        model = load_factory(args.model)
        check_output(args.output)
    except (UsageError, ConfigError, OSError) as exc:
        print(f"sparkdl plan: {exc}", file=sys.stderr)
        return 2
    borrowed = session_running()
    spark = spark_session(f"sparkdl-plan {basename(args.output)}", args.master)
    try:
        result = plan(
            model=model,
            data=args.data,
            batch_size=args.batch_size,
            strategies=args.strategies,
            workers=workers,
            bandwidth=args.bandwidth,
            latency=args.latency,
            memory_budget=args.memory_budget,
            optimizer=_optimizer_factory(args.optimizer, args.lr, args.momentum),
            loss=LOSSES[args.loss],
            feature_cols=feature_cols,
            label_col=args.label,
            inputs=inputs,
            spark=spark,
            progress=not args.quiet,
        )
    except (ConfigError, DataError) as exc:
        print(f"sparkdl plan: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        print(f"sparkdl plan: calibration failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if not borrowed:
            spark.stop()
    print(result.table())
    written = result.save(args.output, plot=args.plot)
    print(f"\nsparkdl plan: wrote {', '.join(written)}")
    return 0
