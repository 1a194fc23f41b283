"""Command-line training: what ``jobs/train.py`` (under spark-submit) and ``sparkdl-train`` run.

Example::

    spark-submit --py-files models.py jobs/train.py --data /data/digits --model models:make_model \\
        --features features --label label --strategy allreduce --num-workers 2 --epochs 3 \\
        --batch-size 32 --output out/run1

It writes ``DIR/model`` (a :class:`~sparkdl.TorchModel`) and ``DIR/metrics.json`` (history,
configuration, versions, exit status) and exits non-zero with a one-paragraph message on failure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def _squeezed(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Regression losses compare a [B, 1] output with a [B] label; squeeze rather than broadcast
    to [B, B], which would train silently on the wrong objective."""

    def regression_loss(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if output.dim() == label.dim() + 1 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        return loss(output, label.to(output.dtype))

    return regression_loss


LOSSES: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": _squeezed(F.mse_loss),
    "l1": _squeezed(F.l1_loss),
    "bce_with_logits": _squeezed(F.binary_cross_entropy_with_logits),
}


class UsageError(Exception):
    """A command-line argument is wrong; exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkdl-train", description="Train a PyTorch model on a Spark cluster with sparkdl.")
    parser.add_argument("--data", required=True, help="URL or path of a Parquet/Petastorm dataset")
    parser.add_argument("--model", required=True, help="module:factory, a zero-argument callable returning a torch.nn.Module")
    parser.add_argument("--features", required=True, help="feature column(s), comma-separated, concatenated in order")
    parser.add_argument("--label", required=True, help="label column")
    parser.add_argument("--strategy", default="allreduce", help="allreduce, model_averaging, elastic_averaging, ... (default allreduce)")
    parser.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy setting, e.g. --strategy-arg sync_every=8 (repeatable; values parsed as JSON when possible)",
    )
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch on each worker")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--momentum", type=float, default=0.9, help="for --optimizer sgd")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="cross_entropy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="directory for the saved model and metrics.json")
    parser.add_argument("--master", default=None, help="Spark master when not started by spark-submit")
    parser.add_argument("--quiet", action="store_true", help="no per-epoch progress lines")
    return parser


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


def _strategy_kwargs(pairs: List[str]) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--strategy-arg {pair!r} must look like KEY=VALUE")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def _optimizer_factory(name: str, lr: float, momentum: float):
    cls = OPTIMIZERS[name]
    kwargs = {"lr": lr, **({"momentum": momentum} if name == "sgd" else {})}
    return _OptimizerFactory(cls, kwargs)


class _OptimizerFactory:
    """A picklable ``params -> optimizer`` (module-level, so executors import it by reference)."""

    def __init__(self, cls: Callable[..., torch.optim.Optimizer], kwargs: Dict[str, Any]) -> None:
        self.cls = cls
        self.kwargs = kwargs

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs one training job from parsed arguments; returns the metrics document."""
    import pyspark
    from pyspark.sql import SparkSession

    import sparkdl
    from sparkdl.strategies import strategy_from_name

    factory = load_factory(args.model)
    strategy = strategy_from_name(args.strategy, **_strategy_kwargs(args.strategy_arg))
    builder = SparkSession.builder.appName(f"sparkdl-train {os.path.basename(args.output.rstrip('/'))}")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    estimator = sparkdl.TorchEstimator(
        model=factory,
        optimizer=_optimizer_factory(args.optimizer, args.lr, args.momentum),
        loss=LOSSES[args.loss],
        feature_cols=[c.strip() for c in args.features.split(",") if c.strip()],
        label_col=args.label,
        strategy=strategy,
        num_workers=args.num_workers,
        batch_size=args.batch_size,
        epochs=args.epochs,
        seed=args.seed,
        progress=not args.quiet,
    )
    try:
        model = estimator.fit(args.data)
        model.save(os.path.join(args.output, "model"))
        spark_info = {"master": spark.sparkContext.master, "app_id": spark.sparkContext.applicationId}
    finally:
        # Stopping explicitly lets executors shut down in order instead of racing the JVM's exit.
        spark.stop()
    return {
        "status": "succeeded",
        "history": model.history,
        "run": model.run_info,
        "config": _config(args),
        "versions": _versions(pyspark.__version__),
        "spark": spark_info,
    }


def _config(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(args).items()}


def _versions(pyspark_version: str) -> Dict[str, str]:
    import petastorm
    import pyarrow

    import sparkdl

    return {
        "sparkdl": sparkdl.__version__,
        "torch": torch.__version__,
        "pyspark": pyspark_version,
        "petastorm": petastorm.__version__,
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


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 1 training failed, 2 bad usage)."""
    args = build_parser().parse_args(argv)
    started = time.time()
    try:
        document = train(args)
        code = 0
    except UsageError as exc:
        print(f"sparkdl-train: {exc}", file=sys.stderr)
        document, code = {"status": "failed", "error": str(exc), "config": _config(args)}, 2
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        from sparkdl.errors import SparkdlError

        kind = "" if isinstance(exc, SparkdlError) else f"{type(exc).__name__}: "
        print(f"sparkdl-train: training failed: {kind}{exc}", file=sys.stderr)
        document = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "config": _config(args)}
        code = 1
    document["wall_seconds"] = time.time() - started
    _write_metrics(args.output, document)
    if code == 0:
        last = document["history"][-1] if document.get("history") else {}
        print(f"sparkdl-train: done in {document['wall_seconds']:.1f}s; final loss {last.get('loss', float('nan')):.4f}; model in {os.path.join(args.output, 'model')}")
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
