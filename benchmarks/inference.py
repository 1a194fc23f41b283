"""Batch inference side by side: sparkdl's ``TorchModel.transform`` and ``sparkdl.predict`` vs
Spark's own ways vs a plain loop.

    .venv/bin/python benchmarks/inference.py [--workload both] [--rows 2000000] [--images 20000]
        [--repeats 3] [--batch-size 1024] [--json PATH] [--keep-data DIR]

Two workloads, each one model on one Parquet dataset (an ``id`` column and the input column,
two files, written once to a temp dir and removed at the end):

* tabular: ``--rows`` rows of 64 float32 features stored as Parquet ``list<float>`` (Spark's
  ``array<float>``), an MLP 64-256-256-10;
* images: ``--images`` 64x64 RGB JPEGs (``benchmarks/make_images.py``'s synthetic ones, a few KB
  each) in a binary column, a small CNN (conv 3->16, pool, conv 16->32, pool, linear to 10).

Sides, all scoring the same Parquet files with the same weights (``state_dict``); 1-3 score
``spark.read.parquet(path)`` into Spark's noop sink, 4-5 read the files and write the predictions
as Parquet (every input column and ``prediction``, or only ``id`` and ``prediction``: the sides
named "…, id") into a directory under the data dir, removed before each run (untimed):

1. sparkdl transform   ``sparkdl.TorchModel.from_state(state, model=factory, feature_cols=[...] |
                       inputs={"x": sparkdl.Image(...)}, output_shape=[10]).transform(df)``,
                       with its default ``optimize="auto"`` (a frozen graph of the model where
                       it is the same and faster: sparkdl.inference.frozen, called on as many
                       rows at a time as score fastest: sparkdl.inference.call_rows);
                       "optimize off" is the same with ``setOptimize("off")``, the module as
                       it is on whole batches;
2. predict_batch_udf   Spark's ``pyspark.ml.functions.predict_batch_udf``: ``make_predict_fn``
                       builds the model once per worker, ``batch_size=--batch-size``,
                       ``input_tensor_shapes=[[64]]`` for the tabular rows;
   "…, batch 32"       the same with ``batch_size=32``: calls of 32 rows, where the small CNN
                       scores fastest per row on one thread, for a user who tuned the batch
                       (sparkdl's ``optimize="auto"`` picks its rows per call itself);
3. pandas_udf          what users write by hand: an iterator ``pandas_udf`` (Series in, Series
                       out), the weights in a broadcast, ``--batch-size`` rows a model call;
4. sparkdl predict     ``sparkdl.predict(model, path, out_dir, overwrite=True, batch_size=...)``
   → Parquet          with the model of 1: its tasks read the files' parts, score them and write
                       Parquet from Python, committing each part (no rows go back to the JVM);
                       timed as the whole call; "…, id" with ``keep_columns=["id"]``;
5. predict_batch_udf   2's DataFrame written by Spark, ``.write.mode("overwrite").parquet(dir)``:
   → Parquet          the peer of 4 with the same kind of output ("…, id": of
                       ``select("id", "prediction")``);
6. plain loop, 1 core  the ceiling: in this (the driver's) process, ``pyarrow.parquet`` reads the
                       same files ``--batch-size`` rows at a time, the model scores them with
                       ``torch.set_num_threads(1)``. No Spark, one core.

The peers (2, 3, 4) decode the JPEGs with Pillow to float32 / 255 and hand the model the NCHW
view of the NHWC pixels (channels-last strides), as predict_batch_udf users commonly write;
sparkdl decodes through its ``Image`` input, which hands the model the same layout. Sides 1-3 add a
``prediction`` column and write with ``.write.format("noop")`` (every row computed, nothing
stored); all Spark sides run on ``local-cluster[2,1,1024]`` (2 executors x 1 core, loopback;
``benchmarks/_spark.py``). The table's "writes" column says what each side stores.

Before timing, every side runs once on a small warm-up dataset (the executors' Python workers
start and import torch; the JVMs compile the read path), and its predictions are checked against
the plain loop's (the run stops when a side disagrees; the Parquet sides' predictions are read
back from their output files). Then ``--repeats`` rounds run every side
once each, interleaved, so that a load change on the shared machine hits every side alike.

Prints a table per workload: rows/s (median of the repeats, and the range), rows/s per core (a
Spark side divided by its 2 executor cores), the ratio of each side to predict_batch_udf and, per
core, to the plain loop, and the peak RSS of any executor Python worker during a measured run (the
largest over the repeats; from /proc, ``benchmarks/_inference_memory.py``); for the plain loop, the
peak of this driver process during the loop (it also holds the Spark driver's Python side).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCHMARKS)

import torch  # noqa: E402
from _inference_memory import OwnPeak, WorkerPeak  # noqa: E402
from _inference_sides import (  # noqa: E402
    PARQUET_SIDES,
    PLAIN_LOOP,
    SPARK_SIDES,
    WRITES,
    collected_predictions,
    plain_loop,
    written_predictions,
)
from _inference_workloads import FILES, WORKLOADS, Workload, write_dataset  # noqa: E402

EXECUTOR_CORES = 2
WARM_UP_ROWS = {"tabular": 4096, "images": 512}
#: Largest |difference| a side's predictions may have from the plain loop's (float32 math in
#: another order: sparkdl's contiguous NCHW vs the peers' channels-last convolution).
TOLERANCE = 1e-3


def time_spark_side(spark: Any, side: str, path: str, workload: Workload, state: Any, batch_size: int) -> Dict:
    """One measured run: from ``spark.read.parquet`` to the noop write's end."""
    with WorkerPeak() as peak:
        started = time.perf_counter()
        scored = SPARK_SIDES[side](spark.read.parquet(path), workload, state, batch_size)
        scored.write.format("noop").mode("overwrite").save()
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_mib": peak.mib}


def time_parquet_side(
    spark: Any, side: str, path: str, out_dir: str, workload: Workload, state: Any, batch_size: int, rows: int
) -> Dict:
    """One measured run of a Parquet side: the whole call, into an ``out_dir`` removed first."""
    shutil.rmtree(out_dir, ignore_errors=True)
    with WorkerPeak() as peak:
        started = time.perf_counter()
        result = PARQUET_SIDES[side](spark, path, out_dir, workload, state, batch_size)
        seconds = time.perf_counter() - started
    if result is not None and (result.rows != rows or result.parts_skipped):
        raise SystemExit(
            f"{workload.name}: {side} wrote {result.rows} rows of {rows}, skipped {result.parts_skipped} parts"
        )
    written = sum(
        os.path.getsize(os.path.join(out_dir, name)) for name in os.listdir(out_dir) if name.endswith(".parquet")
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"seconds": seconds, "peak_mib": peak.mib, "output_mib": written / 2**20}


def time_plain_loop(path: str, workload: Workload, state: Any, batch_size: int) -> Dict:
    with OwnPeak() as peak:
        started = time.perf_counter()
        plain_loop(path, workload, state, batch_size)
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_mib": peak.mib}


def warm_up_and_check(
    spark: Any, warm_path: str, out_dir: str, workload: Workload, state: Any, batch_size: int
) -> float:
    """Runs every side on the warm-up data (two partitions, so both executors' workers start;
    the Parquet sides write ``out_dir``, read back) and returns the largest |difference| of a
    Spark side's predictions from the plain loop's."""
    expected = plain_loop(warm_path, workload, state, batch_size, keep=True)
    predictions = {}
    for side, build in SPARK_SIDES.items():
        scored = build(spark.read.parquet(warm_path).repartition(2), workload, state, batch_size)
        predictions[side] = collected_predictions(scored)
    for side, write in PARQUET_SIDES.items():
        shutil.rmtree(out_dir, ignore_errors=True)
        write(spark, warm_path, out_dir, workload, state, batch_size)
        predictions[side] = written_predictions(out_dir)
        shutil.rmtree(out_dir, ignore_errors=True)
    worst = 0.0
    for side, got in predictions.items():
        difference = float(abs(got - expected).max()) if got.shape == expected.shape else float("inf")
        if not difference <= TOLERANCE:
            raise SystemExit(
                f"{workload.name}: {side}'s predictions differ from the plain loop's on the warm-up rows "
                f"(shape {got.shape} vs {expected.shape}, max |difference| {difference:.3g} > {TOLERANCE})"
            )
        worst = max(worst, difference)
    return worst


def measure(spark: Any, workload: Workload, data_dir: str, rows: int, args: argparse.Namespace) -> Dict:
    """Writes the workload's data, warms up and checks every side, then the measured rounds."""
    path = write_dataset(workload, os.path.join(data_dir, workload.name), rows)
    warm_path = write_dataset(workload, os.path.join(data_dir, f"{workload.name}-warm-up"), WARM_UP_ROWS[workload.name])
    torch.manual_seed(0)
    state = workload.factory().state_dict()
    partitions = spark.read.parquet(path).rdd.getNumPartitions()
    out_dir = os.path.join(data_dir, f"{workload.name}-predictions")
    worst = warm_up_and_check(spark, warm_path, out_dir, workload, state, args.batch_size)
    runs: Dict[str, List[Dict]] = {side: [] for side in [*SPARK_SIDES, *PARQUET_SIDES, PLAIN_LOOP]}
    for _ in range(args.repeats):
        for side in SPARK_SIDES:
            runs[side].append(time_spark_side(spark, side, path, workload, state, args.batch_size))
        for side in PARQUET_SIDES:
            runs[side].append(time_parquet_side(spark, side, path, out_dir, workload, state, args.batch_size, rows))
        runs[PLAIN_LOOP].append(time_plain_loop(path, workload, state, args.batch_size))
    mib = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)) / 2**20
    return {
        "rows": rows,
        "unit": workload.unit,
        "description": workload.describe(),
        "parquet_mib": round(mib, 1),
        "files": FILES,
        "spark_partitions": partitions,
        "warm_up_rows": WARM_UP_ROWS[workload.name],
        "warm_up_max_abs_difference": worst,
        "sides": summarize(runs, rows),
    }


def summarize(runs: Dict[str, List[Dict]], rows: int) -> Dict[str, Dict]:
    """Per side: the runs' rows/s, their median and range, per core, the ratios, the peak RSS."""
    out = {}
    for side, measured in runs.items():
        rates = [rows / run["seconds"] for run in measured]
        peaks = [run["peak_mib"] for run in measured if run["peak_mib"] is not None]
        cores = 1 if side == PLAIN_LOOP else EXECUTOR_CORES
        median = statistics.median(rates)
        out[side] = {
            "writes": WRITES[side],
            "seconds": [run["seconds"] for run in measured],
            "rows_per_s": rates,
            "median_rows_per_s": median,
            "min_rows_per_s": min(rates),
            "max_rows_per_s": max(rates),
            "cores": cores,
            "median_rows_per_s_per_core": median / cores,
            "peak_rss_mib": max(peaks) if peaks else None,
            "peak_rss_of": "this driver process" if side == PLAIN_LOOP else "an executor Python worker",
        }
        if side in PARQUET_SIDES:
            out[side]["output_mib"] = statistics.median(run["output_mib"] for run in measured)
    reference, loop = out["predict_batch_udf"], out[PLAIN_LOOP]
    for figures in out.values():
        figures["vs_predict_batch_udf"] = figures["median_rows_per_s"] / reference["median_rows_per_s"]
        figures["vs_plain_loop_per_core"] = figures["median_rows_per_s_per_core"] / loop["median_rows_per_s"]
    return out


def print_table(name: str, result: Dict, args: argparse.Namespace) -> None:
    unit = result["unit"]
    print(
        f"\n{name}: {result['rows']:,} {unit}, {result['description']}; {result['files']} Parquet files, "
        f"{result['parquet_mib']:.0f} MiB, read by Spark as {result['spark_partitions']} partitions; batch "
        f"{args.batch_size}; median of {args.repeats} run(s) after a warm-up; every side's predictions on "
        f"{result['warm_up_rows']:,} warm-up {unit} within {result['warm_up_max_abs_difference']:.1e} of the plain loop's"
    )
    print(
        f"| side | writes | {unit}/s | range | {unit}/s per core | vs predict_batch_udf | vs plain loop, per core "
        f"| peak RSS |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for side, figures in result["sides"].items():
        peak = figures["peak_rss_mib"]
        writes = figures["writes"] + (f", {figures['output_mib']:.0f} MiB" if "output_mib" in figures else "")
        print(
            f"| {side} | {writes} | {figures['median_rows_per_s']:,.0f} | {figures['min_rows_per_s']:,.0f}–"
            f"{figures['max_rows_per_s']:,.0f} | {figures['median_rows_per_s_per_core']:,.0f} "
            f"| {figures['vs_predict_batch_udf']:.2f} | {figures['vs_plain_loop_per_core']:.2f} "
            f"| {'–' if peak is None else f'{peak:,.0f} MiB'} |"
        )


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["tabular", "images", "both"], default="both")
    parser.add_argument("--rows", type=int, default=2_000_000, help="tabular rows")
    parser.add_argument("--images", type=int, default=20_000, help="JPEG images")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1024, help="rows a model call (sparkdl: its own, 1024)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    parser.add_argument("--keep-data", metavar="DIR", help="write the Parquet data into DIR and keep it")
    args = parser.parse_args(argv)
    for flag in ("rows", "images", "repeats", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    from _spark import local_cluster

    names = ["tabular", "images"] if args.workload == "both" else [args.workload]
    sizes = {"tabular": args.rows, "images": args.images}
    data_dir = args.keep_data or tempfile.mkdtemp(prefix="sparkdl-inference-")
    results: Dict[str, Dict] = {}
    try:
        spark = local_cluster("sparkdl-inference", pythonpath=(ROOT, BENCHMARKS))
        try:
            for name in names:
                results[name] = measure(spark, WORKLOADS[name], data_dir, sizes[name], args)
            import sparkdl

            where = os.path.dirname(os.path.dirname(sparkdl.__file__))
            versions = f"pyspark {spark.version}, torch {torch.__version__}, sparkdl {sparkdl.__version__} from {where}"
        finally:
            spark.stop()
    finally:
        if not args.keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)
    print(f"\nlocal-cluster[2,1,1024] (2 executors x 1 core) on this machine's {os.cpu_count()} cores, {versions}")
    for name, result in results.items():
        print_table(name, result, args)
    print(
        f"\nper core: a Spark side's rate / {EXECUTOR_CORES} executor cores; the plain loop runs on one. peak RSS: the "
        f"largest VmHWM of an executor Python worker in a measured run (reset before each); for the plain loop, this "
        f"driver process's."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "versions": versions, "workloads": results}, f, indent=2)


if __name__ == "__main__":
    main()
