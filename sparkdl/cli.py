"""The command line: ``sparkdl train | predict | inspect | package`` (and ``sparkdl-train``, which is
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
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from sparkdl.data.readers import registered_readers

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
    parser = argparse.ArgumentParser(prog="sparkdl train", description="Train a PyTorch model on a Spark cluster with sparkdl.")
    parser.add_argument("--data", required=True, help="URL or path of a Parquet/Petastorm dataset")
    parser.add_argument("--model", required=True, help="module:factory, a zero-argument callable returning a torch.nn.Module")
    parser.add_argument("--features", default=None, help="feature column(s), comma-separated, concatenated in order into one positional input")
    parser.add_argument(
        "--input", action="append", default=[], metavar="NAME=SPEC", dest="inputs",
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
    parser.add_argument("--reader", choices=registered_readers(), default="arrow", help="data reader (default arrow)")
    parser.add_argument("--decode-threads", type=int, default=None, help="threads per task decoding images (default: the task's cores)")
    parser.add_argument(
        "--validation", type=float, default=None, metavar="FRACTION",
        help="hold out this fraction of the rows (deterministically) and report val_loss per epoch",
    )
    parser.add_argument(
        "--precision", choices=["32", "bf16-mixed", "16-mixed"], default="32",
        help="training precision (16-mixed needs GPUs)",
    )
    recovery = parser.add_argument_group("fault tolerance (README, 'Surviving failures')")
    recovery.add_argument(
        "--checkpoint-dir", default=None,
        help="checkpoint here (storage every executor can write); a re-run with the same dir resumes, "
        "or returns the finished run's model without training",
    )
    recovery.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps (default: each epoch's end)")
    recovery.add_argument("--max-failures", type=int, default=0, help="relaunch the training stage up to N times after a failure (default 0)")
    recovery.add_argument("--no-resume", dest="resume", action="store_false", help="ignore existing checkpoints and train from scratch")
    tracking = parser.add_argument_group("tracking (pip install 'sparkdl[tracking]')")
    tracking.add_argument("--mlflow-experiment", default=None, help="log params, per-epoch metrics and the model to this MLflow experiment")
    tracking.add_argument("--mlflow-tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI)")
    tracking.add_argument("--tensorboard-dir", default=None, help="write per-epoch scalars for TensorBoard here")
    return parser


def parse_inputs(items: List[str]) -> Dict[str, Any]:
    """``--input NAME=SPEC`` arguments as the ``inputs=`` dict (see ``--help``)."""
    from sparkdl.data.inputs import Image, Sequence

    inputs: Dict[str, Any] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        name = name.strip()
        if not sep or not name or not spec:
            raise UsageError(f"--input {item!r}: expected NAME=SPEC, e.g. image=image:jpeg_bytes:224x224x3")
        if name in inputs:
            raise UsageError(f"--input {name!r} is given twice")
        kind, _, rest = spec.partition(":")
        try:
            if kind == "image" and rest:
                parts = rest.split(":")
                column, shape, options = parts[0], (parts[1] if len(parts) > 1 else ""), parts[2:]
                dims = [int(v) for v in shape.lower().split("x")] if shape else []
                if len(dims) not in (2, 3):
                    raise UsageError(f"--input {item!r}: image size must be HxW or HxWxC, e.g. 224x224x3")
                crop = [int(o.split("=", 1)[1]) for o in options if o.startswith("crop=")]
                unknown = [o for o in options if o != "flip" and not o.startswith("crop=")]
                if unknown:
                    raise UsageError(f"--input {item!r}: unknown image option(s) {unknown}; valid: flip, crop=PIXELS")
                inputs[name] = Image(column, size=(dims[0], dims[1]), channels=dims[2] if len(dims) == 3 else 3,
                                     random_flip="flip" in options, random_crop=crop[0] if crop else 0)
            elif kind == "sequence" and rest:
                parts = rest.split(":")
                if len(parts) not in (2, 3):
                    raise UsageError(f"--input {item!r}: expected sequence:COLUMN:MAX_LENGTH[:PAD]")
                inputs[name] = Sequence(parts[0], max_length=int(parts[1]), pad_value=int(parts[2]) if len(parts) == 3 else 0,
                                        lengths_input=f"{name}_lengths")
            elif kind == "dense" and rest:
                inputs[name] = [c.strip() for c in rest.split(",") if c.strip()]
            elif ":" not in spec and "," not in spec:
                inputs[name] = spec.strip()
            else:
                raise UsageError(f"--input {item!r}: SPEC must be COLUMN, dense:COLS, image:COLUMN:HxW[xC] or sequence:COLUMN:MAX_LENGTH[:PAD]")
        except ValueError as exc:
            raise UsageError(f"--input {item!r}: {exc}") from exc
    return inputs


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

    inputs = parse_inputs(args.inputs) if args.inputs else None
    if bool(inputs) == bool(args.features):
        raise UsageError("give --features (one positional input) or --input NAME=SPEC (named inputs), not both and not neither")
    factory = load_factory(args.model)
    strategy = strategy_from_name(args.strategy, **_strategy_kwargs(args.strategy_arg))
    if args.mlflow_tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = args.mlflow_tracking_uri
    builder = SparkSession.builder.appName(f"sparkdl-train {os.path.basename(args.output.rstrip('/'))}")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    estimator = sparkdl.TorchEstimator(
        model=factory,
        optimizer=_optimizer_factory(args.optimizer, args.lr, args.momentum),
        loss=LOSSES[args.loss],
        feature_cols=[c.strip() for c in args.features.split(",") if c.strip()] if args.features else None,
        inputs=inputs,
        decode_threads=args.decode_threads,
        label_col=args.label,
        strategy=strategy,
        num_workers=args.num_workers,
        batch_size=args.batch_size,
        epochs=args.epochs,
        seed=args.seed,
        progress=not args.quiet,
        reader=args.reader,
        validation=args.validation,
        precision=args.precision,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        max_failures=args.max_failures,
        resume=args.resume,
        mlflow_experiment=args.mlflow_experiment,
        tensorboard_dir=args.tensorboard_dir,
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
    os.makedirs(args.output, exist_ok=True)  # fail on an unwritable --output now, not after training
    try:
        document = train(args)
        code = 0
    except UsageError as exc:
        print(f"sparkdl-train: {exc}", file=sys.stderr)
        document, code = {"status": "failed", "error": str(exc), "config": _config(args)}, 2
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        from sparkdl.errors import SparkdlError

        kind = "" if isinstance(exc, SparkdlError) else f"{type(exc).__name__}: "
        hint = _missing_module_hint(str(exc), args.model)
        print(f"sparkdl-train: training failed: {kind}{exc}{hint}", file=sys.stderr)
        document = {"status": "failed", "error": f"{type(exc).__name__}: {exc}{hint}", "config": _config(args)}
        code = 1
    document["wall_seconds"] = time.time() - started
    document["exit_code"] = code
    document["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    document.setdefault("versions", _safe_versions())
    _write_metrics(args.output, document)
    if code == 0:
        last = document["history"][-1] if document.get("history") else {}
        print(f"sparkdl-train: done in {document['wall_seconds']:.1f}s; final loss {last.get('loss', float('nan')):.4f}; model in {os.path.join(args.output, 'model')}")
    return code


# --------------------------------------------------------------------------------------------
# sparkdl predict
# --------------------------------------------------------------------------------------------


def build_predict_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl predict",
        description="Load a saved model, write its predictions for a Parquet dataset (and evaluate them with --label).",
    )
    parser.add_argument("--model", required=True, help="directory of a saved model (a training run's DIR/model)")
    parser.add_argument("--data", required=True, help="URL or path of the Parquet dataset to predict on")
    parser.add_argument("--output", required=True, help="directory for predictions/ (Parquet) and metrics.json")
    parser.add_argument(
        "--model-factory", default=None, metavar="MODULE:FACTORY",
        help="build the module with this factory and read only weights and JSON metadata, instead of unpickling model_fn.pkl",
    )
    parser.add_argument("--label", default=None, help="label column: also report accuracy (vector outputs) or mse/mae (scalar outputs)")
    parser.add_argument("--master", default=None, help="Spark master when not started by spark-submit")
    parser.add_argument("--overwrite", action="store_true", help="replace existing predictions")
    return parser


def predict(args: argparse.Namespace) -> Dict[str, Any]:
    import pyspark
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as sf

    import sparkdl

    factory = load_factory(args.model_factory) if args.model_factory else None
    builder = SparkSession.builder.appName(f"sparkdl-predict {os.path.basename(args.output.rstrip('/'))}")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    target = os.path.join(args.output, "predictions")
    try:
        model = sparkdl.TorchModel.load(args.model, model=factory)
        frame = spark.read.parquet(args.data)
        if args.label and args.label not in frame.columns:
            raise UsageError(f"--label {args.label!r} is not a column of {args.data}; its columns are: {frame.columns}")
        model.transform(frame).write.mode("overwrite" if args.overwrite else "errorifexists").parquet(target)
        written = spark.read.parquet(target)  # evaluate what was written rather than run the model twice
        prediction = model.getPredictionCol()
        evaluation: Dict[str, Any] = {}
        if args.label and model.output_size > 1:
            predicted_class = sf.expr(f"array_position(`{prediction}`, array_max(`{prediction}`)) - 1")
            row = written.select(sf.avg((predicted_class == sf.col(args.label)).cast("double")).alias("accuracy"), sf.count(sf.lit(1)).alias("rows")).first()
            evaluation = {"accuracy": row["accuracy"]}
            rows = row["rows"]
        elif args.label:
            error = sf.col(prediction) - sf.col(args.label).cast("double")
            row = written.select(sf.avg(error * error).alias("mse"), sf.avg(sf.abs(error)).alias("mae"), sf.count(sf.lit(1)).alias("rows")).first()
            evaluation = {"mse": row["mse"], "mae": row["mae"]}
            rows = row["rows"]
        else:
            rows = written.count()
    finally:
        spark.stop()
    return {
        "status": "succeeded",
        "model": args.model,
        "data": args.data,
        "predictions": target,
        "rows": rows,
        "evaluation": evaluation,
        "config": _config(args),
        "versions": _versions(pyspark.__version__),
    }


def predict_main(argv: Optional[List[str]] = None) -> int:
    args = build_predict_parser().parse_args(argv)
    started = time.time()
    os.makedirs(args.output, exist_ok=True)
    try:
        document, code = predict(args), 0
    except UsageError as exc:
        print(f"sparkdl predict: {exc}", file=sys.stderr)
        document, code = {"status": "failed", "error": str(exc), "config": _config(args)}, 2
    except Exception as exc:  # noqa: BLE001
        print(f"sparkdl predict: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        document, code = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "config": _config(args)}, 1
    document["wall_seconds"] = time.time() - started
    document["exit_code"] = code
    _write_metrics(args.output, document)
    # The last line is one JSON object: what an Airflow BashOperator pushes to XCom.
    print(json.dumps({k: document.get(k) for k in ("status", "rows", "evaluation", "predictions", "error") if k in document}))
    return code


# --------------------------------------------------------------------------------------------
# sparkdl inspect
# --------------------------------------------------------------------------------------------


def build_inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl inspect",
        description="Describe a Parquet dataset (schema, rows, row groups, first rows), a saved model, or a run's metrics.json.",
    )
    parser.add_argument("path", help="dataset URL/path, model directory, run directory or metrics.json")
    parser.add_argument("--rows", type=int, default=3, help="rows of a dataset to show (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    return parser


def describe(path: str, rows: int = 3) -> Dict[str, Any]:
    """What ``sparkdl inspect`` prints, as a dict with ``kind`` = metrics, model or dataset."""
    import pyarrow.fs as pafs

    from sparkdl.data.dataset import filesystem_and_path, normalize_url

    url = normalize_url(path)
    fs, root = filesystem_and_path(url)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise UsageError(f"{path!r} does not exist")

    def read_json(file_path: str) -> Dict[str, Any]:
        with fs.open_input_stream(file_path) as stream:
            return json.loads(stream.read())

    def exists(file_path: str) -> bool:
        return fs.get_file_info(file_path).type == pafs.FileType.File

    if info.type == pafs.FileType.File and root.endswith(".json"):
        return {"kind": "metrics", "path": url, **read_json(root)}
    if info.type == pafs.FileType.Directory and exists(f"{root}/metadata.json"):
        return {"kind": "model", "path": url, **read_json(f"{root}/metadata.json")}
    if info.type == pafs.FileType.Directory and exists(f"{root}/metrics.json"):
        return {"kind": "metrics", "path": url + "/metrics.json", **read_json(f"{root}/metrics.json")}
    return _describe_dataset(fs, root, url, info, rows)


def _describe_dataset(fs: Any, root: str, url: str, info: Any, rows: int) -> Dict[str, Any]:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    if info.type == pafs.FileType.File:
        paths = [root]
    else:
        found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        paths = sorted(
            f.path for f in found
            if f.type == pafs.FileType.File and not any(part.startswith(("_", ".")) for part in f.path[len(root):].split("/") if part)
        )
    if not paths:
        raise UsageError(f"{url!r} holds no Parquet files")
    files, schema, head, total_rows = [], None, [], 0
    for file_path in paths:
        try:
            with fs.open_input_file(file_path) as handle:
                parquet = pq.ParquetFile(handle)
                metadata = parquet.metadata
                if schema is None:
                    schema = parquet.schema_arrow
                if len(head) < rows and metadata.num_row_groups:
                    table = parquet.read_row_group(0)
                    head.extend(table.slice(0, rows - len(head)).to_pylist())
        except Exception as exc:  # noqa: BLE001 - name the file that is not Parquet
            raise UsageError(f"{file_path!r} is not a readable Parquet file: {exc}") from exc
        groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        total_rows += metadata.num_rows
        files.append({"path": file_path[len(root):].lstrip("/") or os.path.basename(file_path), "rows": metadata.num_rows, "row_groups": groups})
    return {
        "kind": "dataset",
        "path": url,
        "rows": total_rows,
        "row_groups": sum(len(f["row_groups"]) for f in files),
        "schema": {field.name: str(field.type) for field in schema},
        "files": files,
        "head": [{k: _short(v) for k, v in row.items()} for row in head],
    }


def _short(value: Any, limit: int = 8) -> Any:
    if isinstance(value, list) and len(value) > limit:
        return [_short(v) for v in value[:limit]] + [f"... ({len(value)} values)"]
    if isinstance(value, float):
        return round(value, 4)
    return value


def format_description(doc: Dict[str, Any]) -> str:
    kind = doc["kind"]
    lines: List[str] = []
    if kind == "dataset":
        lines.append(f"dataset {doc['path']}: {doc['rows']} rows in {len(doc['files'])} file(s), {doc['row_groups']} row group(s)")
        lines.append("schema:")
        lines += [f"  {name}: {dtype}" for name, dtype in doc["schema"].items()]
        lines.append("row groups (rows):")
        lines += [f"  {f['path']}: {', '.join(str(n) for n in f['row_groups']) or 'none'}" for f in doc["files"][:20]]
        if len(doc["files"]) > 20:
            lines.append(f"  ... {len(doc['files']) - 20} more file(s)")
        lines.append(f"first {len(doc['head'])} row(s):")
        lines += [f"  {json.dumps(row, default=str)}" for row in doc["head"]]
    elif kind == "model":
        lines.append(f"model {doc['path']}: sparkdl {doc.get('sparkdl_version')}, torch {doc.get('torch_version')}")
        plan = doc.get("inputs") or {}
        if plan and not plan.get("positional"):
            named = ", ".join(f"{key}={spec.get('type')}({', '.join(f'{k}={v}' for k, v in spec.items() if k != 'type' and v not in (None, 0, False))})" for key, spec in plan["inputs"])
            lines.append(f"  inputs: {named} -> {doc.get('prediction_col')} (output shape {doc.get('output_shape')})")
        else:
            lines.append(f"  features: {', '.join(doc.get('feature_cols', []))} -> {doc.get('prediction_col')} (output shape {doc.get('output_shape')})")
        run = doc.get("run_info") or {}
        if run:
            lines.append(f"  trained: {run.get('num_workers')} worker(s), {run.get('epochs')} epoch(s), strategy {(run.get('strategy') or {}).get('name')}")
        lines += _history_lines(doc.get("history") or [])
    else:
        status = doc.get("status", "?")
        wall = doc.get("wall_seconds")
        lines.append(f"run {doc['path']}: {status}" + (f" in {wall:.1f}s" if isinstance(wall, (int, float)) else "") + f" (exit {doc.get('exit_code', '?')})")
        if doc.get("error"):
            lines.append(f"  error: {doc['error']}")
        run = doc.get("run") or {}
        if run:
            lines.append(
                f"  {run.get('num_workers')} worker(s), strategy {(run.get('strategy') or {}).get('name')}, "
                f"{(run.get('dataset') or {}).get('rows')} rows, {len(run.get('attempts') or [])} attempt(s), "
                f"resumed at step {(run.get('steps') or {}).get('resumed_at')}"
            )
        lines += _history_lines(doc.get("history") or [])
        versions = doc.get("versions") or {}
        if versions:
            lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return "\n".join(lines)


def _history_lines(history: List[Dict[str, Any]]) -> List[str]:
    if not history:
        return []
    lines = ["  epoch  loss        samples/s   seconds   per-rank samples/s"]
    for r in history:
        ranks = ", ".join(f"{x:.0f}" for x in rank_rates(r))
        lines.append(f"  {r.get('epoch', '?'):<6} {r.get('loss', float('nan')):<11.4f} {r.get('samples_per_sec', 0):<11.0f} {r.get('seconds', 0):<9.3f} {ranks}")
    return lines


def inspect_main(argv: Optional[List[str]] = None) -> int:
    args = build_inspect_parser().parse_args(argv)
    try:
        doc = describe(args.path, rows=args.rows)
    except UsageError as exc:
        print(f"sparkdl inspect: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2, default=str) if args.json else format_description(doc))
    return 0


# --------------------------------------------------------------------------------------------
# sparkdl package
# --------------------------------------------------------------------------------------------


def build_package_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl package",
        description="Zip the installed sparkdl (and connectors) for spark-submit --py-files, so executors without sparkdl installed can import it.",
    )
    parser.add_argument("--output", default="sparkdl.zip", help="zip file to write (default sparkdl.zip)")
    parser.add_argument("--no-connectors", dest="connectors", action="store_false", help="leave the connectors package out")
    return parser


def package(output: str, connectors: bool = True) -> Dict[str, Any]:
    """Writes a reproducible zip (sorted entries, fixed timestamps, no bytecode) of the pure-Python
    packages; third-party packages (torch, pyspark, petastorm...) must be on the executors."""
    import importlib.util
    import zipfile

    import sparkdl

    roots = [os.path.dirname(os.path.abspath(sparkdl.__file__))]
    if connectors:
        spec = importlib.util.find_spec("connectors")
        if spec is not None and spec.submodule_search_locations:
            roots.append(list(spec.submodule_search_locations)[0])
    entries = []
    for root in roots:
        base = os.path.dirname(root)
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py") or name.endswith(".json") or name == "py.typed":
                    full = os.path.join(folder, name)
                    entries.append((os.path.relpath(full, base).replace(os.sep, "/"), full))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, full in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(full, "rb") as handle:
                archive.writestr(info, handle.read())
    os.replace(tmp, output)
    return {"output": os.path.abspath(output), "files": len(entries), "packages": [os.path.basename(r) for r in roots], "bytes": os.path.getsize(output)}


def package_main(argv: Optional[List[str]] = None) -> int:
    args = build_package_parser().parse_args(argv)
    result = package(args.output, connectors=args.connectors)
    print(result["output"])
    print(f"sparkdl package: {result['files']} files of {', '.join(result['packages'])}, {result['bytes']} bytes; "
          f"ship with spark-submit --py-files {args.output},models.py", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# sparkdl (the umbrella command)
# --------------------------------------------------------------------------------------------

COMMANDS: Dict[str, Callable[[Optional[List[str]]], int]] = {
    "train": main,
    "predict": predict_main,
    "inspect": inspect_main,
    "package": package_main,
}

USAGE = """usage: sparkdl {train,predict,inspect,package} [options]

  train     train a model on a Spark cluster (= sparkdl-train and jobs/train.py); writes DIR/model, DIR/metrics.json
  predict   load a saved model and write predictions for a Parquet dataset; --label also evaluates
  inspect   print a dataset's schema, rows and row groups, a saved model's metadata, or a run's metrics.json
  package   zip sparkdl for spark-submit --py-files (executors without sparkdl installed)

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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
