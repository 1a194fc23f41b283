"""The command line: ``sparkdl train | predict | inspect | package | launch | compare`` (and ``sparkdl-train``, which is
``sparkdl train``); ``jobs/train.py`` runs :func:`main` under spark-submit.

Example::

    spark-submit --py-files models.py jobs/train.py --data /data/digits --model models:make_model \\
        --features features --label label --strategy allreduce --num-workers 2 --epochs 3 \\
        --batch-size 32 --output out/run1

Training writes ``DIR/model`` (a :class:`~sparkdl.TorchModel`) and ``DIR/metrics.json`` (per-epoch
history with each rank's throughput, run info, configuration, versions, exit status) and exits
non-zero with a one-paragraph message on failure (1: training failed, 2: bad arguments).
``predict`` writes ``DIR/predictions`` (Parquet) and ``DIR/metrics.json``; ``inspect`` prints a
dataset's schema, row groups and first rows, a saved model's metadata, or a run's metrics.json;
``package`` zips sparkdl for ``spark-submit --py-files`` (docs/deploy.md).
``compare`` trains the model with each strategy and writes ``DIR/compare.json`` and ``DIR/compare.png``.

One module per command: ``_train``, ``_predict``, ``_inspect``, ``_package``, ``_compare`` (what two or more
share: ``_common``); this package holds the ``sparkdl`` dispatcher and re-exports their names, so
``sparkdl.cli.main``, ``sparkdl.cli.predict_main``, ``sparkdl.cli.describe``... stay where they were.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional

from sparkdl.cli._common import UsageError, load_factory, rank_rates
from sparkdl.cli._compare import build_compare_parser, compare_main
from sparkdl.cli._inputs import parse_inputs
from sparkdl.cli._inspect import build_inspect_parser, describe, format_description, inspect_main
from sparkdl.cli._launch import build_launch_parser, launch_main
from sparkdl.cli._package import build_package_parser, package, package_main
from sparkdl.cli._plan import build_plan_parser, plan_main
from sparkdl.cli._predict import build_predict_parser, predict, predict_main
from sparkdl.cli._submit import submit_main
from sparkdl.cli._train import LOSSES, OPTIMIZERS, build_parser, main, throughput, train

COMMANDS: Dict[str, Callable[[Optional[List[str]]], int]] = {
    "train": main,
    "predict": predict_main,
    "inspect": inspect_main,
    "package": package_main,
    "launch": launch_main,
    "compare": compare_main,
    "plan": plan_main,
    "submit": submit_main,
}

USAGE = """usage: sparkdl {train,predict,inspect,package,compare,plan,launch,submit} [options]

  train     train a model on a Spark cluster (= sparkdl-train and jobs/train.py); writes DIR/model, DIR/metrics.json
  predict   load a saved model and write predictions for a Parquet dataset; --label also evaluates
  inspect   print a dataset's schema, rows and row groups, a saved model's metadata, or a run's metrics.json
  package   zip sparkdl for spark-submit --py-files (executors without sparkdl installed)
  launch    run an existing training script unchanged on barrier tasks, torchrun style: sparkdl launch train.py -- ARGS
  compare   train the model with each strategy for the same epochs; one table, DIR/compare.json, DIR/compare.png
  plan      calibrate for a minute, predict each strategy on 2..1024 workers; one table, DIR/plan.json, DIR/plan.png
  submit    spark-submit the packaged train or predict job, shipping sparkdl and the model's module: sparkdl submit train [spark-submit options] -- ARGS

'sparkdl COMMAND --help' describes a command's options."""


def sparkdl_main(argv: Optional[List[str]] = None) -> int:
    """The ``sparkdl`` console command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"sparkdl: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2


__all__ = [
    "COMMANDS",
    "LOSSES",
    "OPTIMIZERS",
    "USAGE",
    "UsageError",
    "build_compare_parser",
    "build_plan_parser",
    "plan_main",
    "build_inspect_parser",
    "build_launch_parser",
    "build_package_parser",
    "build_parser",
    "build_predict_parser",
    "compare_main",
    "describe",
    "format_description",
    "inspect_main",
    "launch_main",
    "load_factory",
    "main",
    "package",
    "package_main",
    "parse_inputs",
    "predict",
    "predict_main",
    "rank_rates",
    "sparkdl_main",
    "throughput",
    "train",
]
