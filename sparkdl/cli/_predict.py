"""``sparkdl predict`` (= ``jobs/predict.py``): a saved model's predictions for a Parquet dataset,
evaluated with ``--label``, and metrics.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from sparkdl._version import versions as _versions
from sparkdl.cli._common import UsageError, _config, _write_metrics, load_factory, spark_session


def build_predict_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl predict",
        description="Load a saved model, write its predictions for a Parquet dataset (and evaluate them with --label).",
    )
    parser.add_argument("--model", required=True, help="directory of a saved model (a training run's DIR/model)")
    parser.add_argument("--data", required=True, help="URL or path of the Parquet dataset to predict on")
    parser.add_argument("--output", required=True, help="directory for predictions/ (Parquet) and metrics.json")
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
    parser.add_argument("--overwrite", action="store_true", help="replace existing predictions")
    return parser


def predict(args: argparse.Namespace) -> Dict[str, Any]:
    import pyspark
    from pyspark.sql import functions as sf

    import sparkdl

    factory = load_factory(args.model_factory) if args.model_factory else None
    spark = spark_session(f"sparkdl-predict {os.path.basename(args.output.rstrip('/'))}", args.master)
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
            row = written.select(
                sf.avg((predicted_class == sf.col(args.label)).cast("double")).alias("accuracy"),
                sf.count(sf.lit(1)).alias("rows"),
            ).first()
            evaluation = {"accuracy": row["accuracy"]}
            rows = row["rows"]
        elif args.label:
            error = sf.col(prediction) - sf.col(args.label).cast("double")
            row = written.select(
                sf.avg(error * error).alias("mse"),
                sf.avg(sf.abs(error)).alias("mae"),
                sf.count(sf.lit(1)).alias("rows"),
            ).first()
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
    print(
        json.dumps(
            {k: document.get(k) for k in ("status", "rows", "evaluation", "predictions", "error") if k in document}
        )
    )
    return code
