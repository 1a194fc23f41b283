"""``sparkdl train`` (= ``sparkdl-train`` and ``jobs/train.py``): options (``--input`` specs are parsed in ``_inputs``),
the estimator run, metrics.json with throughput and a hint for executors' missing modules, and
the one summary line a run ends with."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from sparkdl._driver.progress import validation_figures
from sparkdl._runtime.validation import METRICS, accuracy, named_metrics, squeezed  # noqa: F401 - accuracy: re-exported where it was
from sparkdl._version import versions as _versions
from sparkdl.cli._common import (
    UsageError,
    _config,
    _write_metrics,
    add_slot_wait_argument,
    check_output,
    error_kind,
    load_factory,
    parse_arguments,
    rank_rates,
    session_running,
    spark_session,
)
from sparkdl.cli._inputs import parse_inputs
from sparkdl.data.readers import registered_readers
from sparkdl.filesystem import url_join

# Where the package re-exports this module's names: what pickles and MLflow's "optimizer"/"loss"
# params name, as they did when the CLI was one module.

OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


#: Regression losses compare a [B, 1] output with a [B] label: squeezed, not broadcast to [B, B].
_squeezed = squeezed


LOSSES: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": _squeezed(F.mse_loss),
    "l1": _squeezed(F.l1_loss),
    "bce_with_logits": _squeezed(F.binary_cross_entropy_with_logits),
}


def add_train_options(parser: argparse.ArgumentParser, dests: Sequence[str]) -> None:
    """``sparkdl train``'s own argparse actions named by ``dests``, added to ``parser`` (what
    argparse's ``parents=`` does, for a subset): commands that take the same model, data and
    training options cannot drift apart from ``train``."""
    for action in build_parser()._actions:
        if action.dest in dests:
            parser._add_action(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl train", description="Train a PyTorch model on a Spark cluster with sparkdl."
    )
    parser.add_argument("--data", required=True, help="URL or path of a Parquet/Petastorm dataset")
    parser.add_argument(
        "--model", required=True, help="module:factory, a zero-argument callable returning a torch.nn.Module"
    )
    parser.add_argument(
        "--features",
        default=None,
        help="feature column(s), comma-separated, concatenated in order into one positional input",
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        dest="inputs",
        help=(
            "a named model input (repeat; the model is called as model(**inputs); replaces --features). SPEC is: "
            "COLUMN (the column as it is; integer ids stay int64), "
            "dense:COL1,COL2,... (numeric/array columns concatenated into floats), "
            "image:COLUMN:HxW[xC][:flip][:crop=P] (encoded images, C = 1 or 3, default 3), "
            "sequence:COLUMN:MAX_LENGTH[:PAD] (variable-length token ids, padded; a length input NAME_lengths is added). "
            "E.g. --input image=image:jpeg_bytes:224x224x3 --input tokens=sequence:token_ids:128 --input dense=dense:age,income"
        ),
    )
    parser.add_argument("--label", required=True, help="label column")
    parser.add_argument(
        "--strategy",
        default="allreduce",
        help="allreduce, sharded, model_averaging, diloco, elastic_averaging, parameter_server (default allreduce); settings with --strategy-arg",
    )
    parser.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy setting, e.g. --strategy-arg sync_every=8 (repeatable; values parsed as JSON when possible)",
    )
    parser.add_argument("--num-workers", type=int, default=2)
    add_slot_wait_argument(parser)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch on each worker")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--momentum", type=float, default=0.9, help="for --optimizer sgd")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="cross_entropy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        required=True,
        help="directory for the saved model and metrics.json: a path or a URL (s3://, gs://, abfs://, hdfs://, "
        "any fsspec URL)",
    )
    parser.add_argument("--master", default=None, help="Spark master when not started by spark-submit")
    parser.add_argument("--quiet", action="store_true", help="no per-epoch progress lines")
    parser.add_argument("--reader", choices=registered_readers(), default="arrow", help="data reader (default arrow)")
    parser.add_argument(
        "--decode-threads", type=int, default=None, help="threads per task decoding images (default: the task's cores)"
    )
    parser.add_argument(
        "--shard-cache",
        choices=["auto", "memory", "none"],
        default="auto",
        help="keep each rank's decoded shard in memory after the first epoch: when it fits half a task's memory "
        "(auto), whenever it fits (memory), never (none)",
    )
    parser.add_argument(
        "--validation",
        type=float,
        default=None,
        metavar="FRACTION",
        help="hold out this fraction of the rows (deterministically) and report val_loss per epoch",
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        choices=sorted(METRICS),
        dest="metrics",
        help="also report val_<metric> per epoch on the --validation rows (repeatable)",
    )
    parser.add_argument(
        "--precision",
        choices=["32", "bf16-mixed", "16-mixed"],
        default="32",
        help="training precision (16-mixed needs GPUs)",
    )
    parser.add_argument(
        "--resources",
        type=_resources,
        default=None,
        metavar="cpus=N,gpus=N,memory=SIZE",
        help="the training stage's own task resources (a Spark resource profile for that stage only; ETL keeps "
        "spark.task.cpus), e.g. cpus=4,gpus=1 (docs/resources.md)",
    )
    recovery = parser.add_argument_group("fault tolerance (README, 'Surviving failures')")
    recovery.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoint here (storage every executor can write); a re-run with the same dir resumes, "
        "or returns the finished run's model without training",
    )
    recovery.add_argument(
        "--checkpoint-every", type=int, default=None, help="also checkpoint every N steps (default: each epoch's end)"
    )
    recovery.add_argument(
        "--checkpoint-sync",
        dest="checkpoint_async",
        action="store_false",
        help="write each checkpoint before training goes on (default: in the background after a copy to host memory)",
    )
    recovery.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="relaunch the training stage up to N times after a failure (default 0)",
    )
    recovery.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="a relaunch that finds fewer free slots than --num-workers continues on as many as are free, down to N (default: --num-workers)",
    )
    recovery.add_argument(
        "--on-resize",
        choices=("keep_global_batch", "scale_lr", "none"),
        help="on fewer workers than --num-workers: accumulate gradients to the global batch, scale lr, or neither (default: per strategy)",
    )
    recovery.add_argument(
        "--no-resume", dest="resume", action="store_false", help="ignore existing checkpoints and train from scratch"
    )
    tracking = parser.add_argument_group("tracking (pip install 'sparkdl-torch[tracking]')")
    tracking.add_argument(
        "--mlflow-experiment",
        default=None,
        help="log params, per-epoch metrics and the model to this MLflow experiment",
    )
    tracking.add_argument("--mlflow-tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI)")
    tracking.add_argument(
        "--mlflow-register",
        default=None,
        metavar="NAME",
        dest="mlflow_registered_model_name",
        help="also register the logged MLflow model under this name in the model registry (needs --mlflow-experiment)",
    )
    tracking.add_argument("--tensorboard-dir", default=None, help="write per-epoch scalars for TensorBoard here")
    return parser


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


def model_inputs(args: argparse.Namespace) -> Tuple[Optional[List[str]], Optional[Dict[str, Any]]]:
    """``(feature_cols, inputs)`` from ``--features`` / ``--input`` (exactly one of them), checked
    with ``--metric`` (which needs ``--validation``)."""
    inputs = parse_inputs(args.inputs) if args.inputs else None
    if bool(inputs) == bool(args.features):
        raise UsageError(
            "give --features (one positional input) or --input NAME=SPEC (named inputs), not both and not neither"
        )
    if args.metrics and args.validation is None:
        raise UsageError("--metric is computed on held-out rows: give --validation FRACTION as well")
    feature_cols = [c.strip() for c in args.features.split(",") if c.strip()] if args.features else None
    return feature_cols, inputs


def estimator_arguments(args: argparse.Namespace) -> Dict[str, Any]:
    """The TorchEstimator arguments of the model, data and training options that ``sparkdl
    train`` and ``sparkdl compare`` share (``compare`` adds no strategy: it tries each)."""
    feature_cols, inputs = model_inputs(args)
    return dict(
        model=load_factory(args.model),
        optimizer=_optimizer_factory(args.optimizer, args.lr, args.momentum),
        loss=LOSSES[args.loss],
        feature_cols=feature_cols,
        inputs=inputs,
        label_col=args.label,
        num_workers=args.num_workers,
        slot_wait_s=args.slot_wait_s,
        batch_size=args.batch_size,
        epochs=args.epochs,
        seed=args.seed,
        reader=args.reader,
        decode_threads=args.decode_threads,
        shard_cache=args.shard_cache,
        validation=args.validation,
        metrics=named_metrics(args.metrics) or None,  # the estimator's own vocabulary
        precision=args.precision,
        resources=args.resources,
    )


def _resources(text: str) -> Any:
    from sparkdl.errors import ConfigError
    from sparkdl.resources import Resources

    try:
        return Resources.parse(text)
    except ConfigError as exc:  # argparse reports ArgumentTypeError as a usage error, in one line
        raise argparse.ArgumentTypeError(str(exc)) from None


def train(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs one training job from parsed arguments; returns the metrics document."""
    import pyspark

    import sparkdl
    from sparkdl.filesystem import basename
    from sparkdl.strategies import strategy_from_name

    estimator_options = estimator_arguments(args)
    strategy = strategy_from_name(args.strategy, **_strategy_kwargs(args.strategy_arg))
    if args.mlflow_tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = args.mlflow_tracking_uri
    estimator = sparkdl.TorchEstimator(
        **estimator_options,
        strategy=strategy,
        progress=not args.quiet,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_async=args.checkpoint_async,
        max_failures=args.max_failures,
        min_workers=args.min_workers,
        on_resize=args.on_resize,
        resume=args.resume,
        mlflow_experiment=args.mlflow_experiment,
        mlflow_registered_model_name=args.mlflow_registered_model_name,
        tensorboard_dir=args.tensorboard_dir,
    )
    borrowed = session_running()
    spark = spark_session(f"sparkdl-train {basename(args.output)}", args.master)
    try:
        model = estimator.fit(args.data)
        model.save(url_join(args.output, "model"))
        spark_info = {"master": spark.sparkContext.master, "app_id": spark.sparkContext.applicationId}
    finally:
        if not borrowed:
            spark.stop()
    return {
        "status": "succeeded",
        "history": model.history,
        "throughput": throughput(model.history),
        "run": model.run_info,
        "config": _config(args),
        "versions": _versions(pyspark.__version__),
        "spark": spark_info,
    }


def throughput(history: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Samples/s over the run: global per epoch, and each rank's mean over the epochs, so a slow
    executor stands out in metrics.json."""
    per_rank = [rank_rates(r) for r in history if rank_rates(r)]
    means = [sum(rates) / len(per_rank) for rates in zip(*per_rank)] if per_rank else []
    return {
        "samples_per_sec": [r.get("samples_per_sec") for r in history],
        "rank_samples_per_sec_mean": [round(m, 3) for m in means],
        "slowest_rank": min(range(len(means)), key=means.__getitem__) if means else None,
    }


def _missing_module_hint(message: str, model_spec: str) -> str:
    """The spark-submit line that fixes an executor's missing module."""
    match = re.search(r"No module named '([\w.]+)'", message)
    if not match:
        return ""
    missing = match.group(1).split(".")[0]
    user_module = model_spec.partition(":")[0].split(".")[0]
    if missing in ("sparkdl", "connectors"):
        return (
            f"\n\nThe executors have no sparkdl. Build a zip of it with `sparkdl package --output sparkdl.zip` and submit with "
            f"--py-files sparkdl.zip,{user_module}.py, or ship a packed virtualenv with --archives env.tar.gz#env "
            f"--conf spark.pyspark.python=./env/bin/python (docs/deploy.md, 'Getting our code to the executors')."
        )
    if missing == user_module:
        return f"\n\nShip the model code to the executors: spark-submit --py-files {user_module}.py (docs/deploy.md)."
    return (
        f"\n\nThe executors' Python has no {missing!r}: install it there, or ship a packed virtualenv with "
        f"--archives env.tar.gz#env --conf spark.pyspark.python=./env/bin/python (docs/deploy.md)."
    )


def _safe_versions() -> Dict[str, str]:
    try:
        import pyspark

        return _versions(pyspark.__version__)
    except Exception as exc:  # noqa: BLE001 - a failed run still gets its metrics.json
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 1 training failed, 2 bad usage).

    ``--output`` (a path or URL) is checked first: a scheme with no filesystem here or a directory
    that cannot be written ends the command at once (2). Every other outcome, a usage error
    argparse finds included, leaves ``--output``/metrics.json with ``status``, ``exit_code`` and,
    on failure, ``error`` and ``error_kind`` (:func:`~sparkdl.cli._common.error_kind`)."""
    args = parse_arguments(build_parser(), argv)
    started = time.time()
    try:
        check_output(args.output)
    except UsageError as exc:  # nowhere to write metrics.json: the message is all there is
        print(f"sparkdl-train: {exc}", file=sys.stderr)
        return 2
    try:
        document = train(args)
        code = 0
    except UsageError as exc:
        print(f"sparkdl-train: {exc}", file=sys.stderr)
        document, code = {"status": "failed", "error": str(exc), "error_kind": "usage", "config": _config(args)}, 2
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        from sparkdl.errors import SparkdlError

        kind = "" if isinstance(exc, SparkdlError) else f"{type(exc).__name__}: "
        hint = _missing_module_hint(str(exc), args.model)
        print(f"sparkdl-train: training failed: {kind}{exc}{hint}", file=sys.stderr)
        document = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}{hint}",
            "error_kind": error_kind(exc),
            "config": _config(args),
        }
        code = 1
    document["wall_seconds"] = time.time() - started
    document["exit_code"] = code
    document["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    document.setdefault("versions", _safe_versions())
    _write_metrics(args.output, document)
    if code == 0:
        print(summary_line(document, args.output))
    return code


def summary_line(document: Dict[str, Any], output: str) -> str:
    """The run's last line: what a user wants first (the final loss, the validation figures,
    where the model and metrics.json are)."""
    last = document["history"][-1] if document.get("history") else {}
    figures = [f"final loss {last.get('loss', float('nan')):.4f}"]
    figures += [f"{key} {last[key]:.4f}" for key in validation_figures([last]) if isinstance(last[key], (int, float))]
    return (
        f"sparkdl-train: done in {document['wall_seconds']:.1f}s, {len(document.get('history') or [])} epoch(s): {', '.join(figures)}; "
        f"model in {url_join(output, 'model')}, metrics in {url_join(output, 'metrics.json')}"
    )
