"""What two or more ``sparkdl`` commands share: the usage error, the Spark session, ``--model``-style
factory loading, metrics.json (configuration, versions, writing) and per-rank rates of an epoch record."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

if TYPE_CHECKING:
    import torch


class UsageError(Exception):
    """A command-line argument is wrong; exit code 2."""


def spark_session(app_name: str, master: Optional[str]) -> Any:
    """The command's SparkSession: spark-submit's when it started the command (its master and
    ``--conf`` settings stand), else a new one on ``--master`` with Spark's console progress bar
    off: sparkdl prints its own progress lines, and the bar would cut into them."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # set when spark-submit started this driver
        builder = builder.config("spark.ui.showConsoleProgress", "false")
    if master:
        builder = builder.master(master)
    return builder.getOrCreate()


def add_slot_wait_argument(parser: argparse.ArgumentParser) -> None:
    """``--slot-wait``, for every command that launches ranks."""
    parser.add_argument(
        "--slot-wait", type=float, default=30.0, dest="slot_wait_s", metavar="SECONDS",
        help="how long to wait for --num-workers free task slots (executors still starting) before failing (default 30)",
    )


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--model {spec!r} must look like module:factory (e.g. models:make_model)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"--model {spec!r}: cannot import {module_name!r} ({exc}); ship it with spark-submit --py-files {module_name}.py"
        ) from exc
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise UsageError(f"--model {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise UsageError(f"--model {spec!r} is not callable")
    return factory



def rank_rates(record: Dict[str, Any]) -> List[float]:
    """``[rank0_samples_per_sec, rank1_samples_per_sec, ...]`` of an epoch record."""
    rates = []
    while f"rank{len(rates)}_samples_per_sec" in record:
        rates.append(record[f"rank{len(rates)}_samples_per_sec"])
    return rates



def _config(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(args).items()}


def _versions(pyspark_version: str) -> Dict[str, str]:
    import pyarrow
    import torch

    import sparkdl

    try:
        import petastorm

        petastorm_version = petastorm.__version__
    except ImportError:
        petastorm_version = "not installed"
    return {
        "sparkdl": sparkdl.__version__,
        "torch": torch.__version__,
        "pyspark": pyspark_version,
        "petastorm": petastorm_version,
        "pyarrow": pyarrow.__version__,
        "python": platform.python_version(),
    }



def _write_metrics(output: str, document: Dict[str, Any]) -> None:
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, "metrics.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(document, handle, indent=2, default=str)
    os.replace(tmp, path)

