"""``sparkdl predict`` (= ``jobs/predict.py``): a saved model's predictions for a Parquet dataset,
evaluated with ``--label``, and metrics.json. ``--model``, ``--data`` and ``--output`` are paths
or URLs. The predictions are a resumable job (:mod:`sparkdl.inference.predict_job`): each input
part is committed on its own, so a rerun without ``--overwrite`` after a failure or a kill
computes only what is missing; a complete output is refused. Data at a URL only Spark's Hadoop
opens is read and written by Spark in one job (``_frames``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional

from sparkdl._version import versions as _versions
from sparkdl.cli._common import (
    UsageError,
    _config,
    _write_metrics,
    check_input,
    check_output,
    error_kind,
    load_factory,
    parse_arguments,
    session_running,
    spark_session,
)
from sparkdl.cli._frames import read_parquet, write_parquet
from sparkdl.filesystem import basename, is_process_local, url_join


def build_predict_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl predict",
        description="Load a saved model, write its predictions for a Parquet dataset (and evaluate them with --label).",
    )
    parser.add_argument(
        "--model", required=True, help="directory (path or URL) of a saved model (a training run's DIR/model)"
    )
    parser.add_argument("--data", required=True, help="URL or path of the Parquet dataset to predict on")
    parser.add_argument(
        "--output", required=True, help="directory (path or URL) for predictions/ (Parquet) and metrics.json"
    )
    parser.add_argument(
        "--model-factory",
        default=None,
        metavar="MODULE:FACTORY",
        help="build the module with this factory and read only weights and JSON metadata, instead of unpickling model_fn.pkl",
    )
    parser.add_argument(
        "--label", default=None, help="label column: also report accuracy (vector outputs) or mse/mae (scalar outputs)"
    )
    parser.add_argument("--master", default=None, help="Spark master when not started by spark-submit")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing predictions (without it, a partial output of the same job is resumed)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="rows per model call (default 1024)")
    parser.add_argument(
        "--on-error",
        choices=["fail", "null"],
        default=None,
        help="a row that cannot be scored fails the job (default), or gets a null prediction and a reason",
    )
    parser.add_argument(
        "--prediction-kind",
        choices=["raw", "probabilities", "label", "top_k"],
        default=None,
        help="what the prediction column holds (default raw: the model's output)",
    )
    parser.add_argument("--top-k", type=int, default=None, help="classes kept by --prediction-kind top_k (default 5)")
    parser.add_argument(
        "--optimize",
        choices=["auto", "off"],
        default=None,
        help="auto (default): score with a frozen graph of the model where it is the same and faster; off: the module",
    )
    parser.add_argument(
        "--keep-columns",
        default=None,
        metavar="COL,COL",
        help="input columns the predictions keep, comma-separated, e.g. id (default: all; --label's column is "
        "kept for the evaluation)",
    )
    return parser


def _keep_columns(args: argparse.Namespace) -> Optional[List[str]]:
    """``--keep-columns`` as a list, with ``--label``'s column added (the evaluation reads it)."""
    if args.keep_columns is None:
        return None
    kept = [name.strip() for name in args.keep_columns.split(",") if name.strip()]
    if not kept:
        raise UsageError("--keep-columns names no column: give one or more, comma-separated (e.g. --keep-columns id)")
    if args.label and args.label not in kept:
        kept.append(args.label)
    return kept


def _options(args: argparse.Namespace) -> Dict[str, Any]:
    """The scoring options the flags give (those not given keep the model's own)."""
    given = {
        "batch_size": args.batch_size,
        "on_error": args.on_error,
        "output": args.prediction_kind,
        "top_k": args.top_k,
        "optimize": args.optimize,
    }
    return {name: value for name, value in given.items() if value is not None}


def predict(args: argparse.Namespace) -> Dict[str, Any]:
    import pyspark

    import sparkdl

    factory = load_factory(args.model_factory) if args.model_factory else None
    target = url_join(args.output, "predictions")
    borrowed = session_running()
    spark = spark_session(f"sparkdl-predict {basename(args.output)}", args.master)
    try:
        model = sparkdl.TorchModel.load(args.model, model=factory)
        written = _write_predictions(spark, model, args, target)
        # Evaluated on what was written rather than by running the model twice.
        kind = args.prediction_kind or model.inference_options().output
        rows, evaluation = _evaluate(read_parquet(spark, target, "predictions"), model, args.label, kind)
    finally:
        if not borrowed:
            spark.stop()
    return {
        "status": "succeeded",
        "model": args.model,
        "data": args.data,
        "predictions": target,
        "rows": rows,
        **written,
        "evaluation": evaluation,
        "config": _config(args),
        "versions": _versions(pyspark.__version__),
    }


def _write_predictions(spark: Any, model: Any, args: argparse.Namespace, target: str) -> Dict[str, Any]:
    """Writes the predictions as a resumable job of committed parts (sparkdl.inference), or,
    for a URL only Spark's Hadoop opens, with Spark's writer. Returns what it did."""
    from sparkdl.errors import ConfigError
    from sparkdl.inference.parts import list_parts, part_schema
    from sparkdl.inference.predict_job import OutputConflictError, predict_parts

    try:
        parts = list_parts(spark, args.data)
    except ConfigError:  # no pyarrow or fsspec filesystem here for the scheme: Spark's own reader
        return _write_with_spark(spark, model, args, target)
    _check_columns(args, part_schema(parts[0]).names)
    try:
        result = predict_parts(
            spark,
            model,
            parts,
            args.data,
            target,
            overwrite=args.overwrite,
            refuse_complete=True,
            options=_options(args),
            keep_columns=_keep_columns(args),
        )
    except OutputConflictError as exc:  # what --output holds: the user's to change
        raise UsageError(str(exc)) from exc
    return {
        "bad_rows": result.bad_rows,
        "parts": result.parts,
        "parts_written": result.parts_written,
        "parts_skipped": result.parts_skipped,
    }


def _write_with_spark(spark: Any, model: Any, args: argparse.Namespace, target: str) -> Dict[str, Any]:
    """Spark reads and writes the whole dataset in one job (not resumable)."""
    frame = read_parquet(spark, args.data, "--data")
    _check_columns(args, frame.columns)
    setters = {"batch_size": model.setBatchSize, "on_error": model.setOnError, "output": model.setOutput}
    for name, value in _options(args).items():
        {**setters, "top_k": model.setTopK, "optimize": model.setOptimize}[name](value)
    scored = model.transform(frame)
    kept = _keep_columns(args)
    if kept is not None:
        scored = scored.select(*kept, *[name for name in scored.columns if name not in frame.columns])
    write_parquet(scored, target, args.overwrite)
    return {}


def _check_columns(args: argparse.Namespace, columns: List[str]) -> None:
    """``--label`` and ``--keep-columns`` name columns of ``--data``."""
    if args.label and args.label not in columns:
        raise UsageError(f"--label {args.label!r} is not a column of {args.data}; its columns are: {columns}")
    missing = [name for name in _keep_columns(args) or [] if name not in columns]
    if missing:
        raise UsageError(f"--keep-columns names {missing}, not columns of {args.data}; its columns are: {columns}")


def _evaluate(written: Any, model: Any, label: Optional[str], kind: Optional[str] = None) -> Any:
    """``(rows, evaluation)`` of the written predictions: accuracy for class predictions (vector
    outputs, probabilities, labels, top-k's first class), mse and mae for scalar outputs,
    nothing without ``label``."""
    from pyspark.sql import functions as sf

    kind = kind if isinstance(kind, str) else "raw"  # a dict of kinds: several heads, no single prediction
    prediction = f"`{model.getPredictionCol()}`"
    predicted_class = {
        "label": sf.expr(prediction),
        "top_k": sf.expr(f"{prediction}.indices[0]"),
    }.get(kind, sf.expr(f"array_position({prediction}, array_max({prediction})) - 1"))
    if label and (model.output_size > 1 or kind in ("label", "top_k")):
        row = written.select(
            sf.avg((predicted_class == sf.col(label)).cast("double")).alias("accuracy"),
            sf.count(sf.lit(1)).alias("rows"),
        ).first()
        return row["rows"], {"accuracy": row["accuracy"]}
    if label:
        error = sf.expr(prediction) - sf.col(label).cast("double")
        row = written.select(
            sf.avg(error * error).alias("mse"),
            sf.avg(sf.abs(error)).alias("mae"),
            sf.count(sf.lit(1)).alias("rows"),
        ).first()
        return row["rows"], {"mse": row["mse"], "mae": row["mae"]}
    return written.count(), {}


def check_inputs(args: argparse.Namespace) -> None:
    """``--model`` and ``--data`` checked before Spark starts (UsageError): the model's scheme has
    a filesystem here, and the executors can reach the dataset (``memory://`` is this process's
    memory, not theirs). The dataset's scheme is Spark's to open first, so it is not checked here."""
    if is_process_local(args.data):
        raise UsageError(
            f"--data {args.data!r}: memory:// lives in this process only, and the executors read the data: "
            f"give a path or URL every executor can reach"
        )
    check_input(args.model, "--model")


def _check_output(output: str) -> None:
    if is_process_local(output):
        raise UsageError(
            f"--output {output!r}: memory:// lives in this process only, and the executors write the predictions: "
            f"give a path or URL every executor can reach"
        )
    check_output(output)


def predict_main(argv: Optional[List[str]] = None) -> int:
    """Entry point: 0 with predictions, 1 when predicting failed, 2 on bad usage. ``--output`` is
    checked first (a scheme with no filesystem here, a directory that cannot be written, or
    memory://, which executors cannot write, ends it at once with 2); every other outcome leaves
    metrics.json (``status``, ``exit_code``, ``error``, ``error_kind``)."""
    args = parse_arguments(build_predict_parser(), argv)
    started = time.time()
    try:
        _check_output(args.output)
    except UsageError as exc:  # nowhere to write metrics.json: the message is all there is
        print(f"sparkdl predict: {exc}", file=sys.stderr)
        return 2
    try:
        check_inputs(args)
        document, code = predict(args), 0
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        kind = error_kind(exc)
        reason = str(exc) if kind == "usage" else f"{type(exc).__name__}: {exc}"
        print(
            f"sparkdl predict: {reason}" if kind == "usage" else f"sparkdl predict: failed: {reason}", file=sys.stderr
        )
        document = {"status": "failed", "error": reason, "error_kind": kind, "config": _config(args)}
        code = 2 if kind == "usage" else 1
    document["wall_seconds"] = time.time() - started
    document["exit_code"] = code
    _write_metrics(args.output, document)
    # The last line is one JSON object: what an Airflow BashOperator pushes to XCom.
    print(
        json.dumps(
            {k: document.get(k) for k in ("status", "rows", "evaluation", "predictions", "error") if k in document}
        )
    )
    return code
