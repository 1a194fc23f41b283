"""The inference part of ``benchmarks/gpu_check.py``: sparkdl's scorer (what ``transform`` and
``sparkdl.predict`` run in each task) on one device, without Spark.

For each precision it scores every row of the check's Parquet with the same wide MLP: the
Arrow batches a task would get, the model built once, batches cut, converted, pinned and copied
to the device, the prediction column appended. It reports rows/s, and the feed alone (reading
the Parquet and making the model's inputs, nothing scored) in rows/s: the feed's headroom is
how much faster the input side is than scoring, so scoring is device-bound where it is > 1.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any, Dict, Iterator, List, Optional

import cloudpickle
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sparkdl.data.columns import ColumnInfo
from sparkdl.data.plan import InputPlan
from sparkdl.inference.api import inference_options
from sparkdl.inference.model_source import ModelRef, weights_bytes
from sparkdl.inference.outputs import Head
from sparkdl.inference.scorer import Scorer

#: Rows per Arrow batch handed to the scorer (Spark's ``maxRecordsPerBatch``).
ARROW_BATCH_ROWS = 10_000


class _Factory:
    """Builds the check's model (picklable, as a TorchModel's factory is)."""

    def __init__(self, build: Any, sizes: Dict[str, int]) -> None:
        self.build, self.sizes = build, sizes

    def __call__(self) -> torch.nn.Module:
        s = self.sizes
        return self.build(s["features"], s["hidden"], s["layers"], s["classes"])


def _batches(data_dir: str) -> Iterator[pa.RecordBatch]:
    for path in sorted(glob.glob(os.path.join(data_dir, "*.parquet"))):
        yield from pq.ParquetFile(path).iter_batches(ARROW_BATCH_ROWS, columns=["features"])


def _scorer(factory: _Factory, device: torch.device, precision: Optional[str], batch_size: int) -> Scorer:
    module = factory()
    state = weights_bytes(module)
    ref = ModelRef(f"gpu-check-{precision}", len(state), cloudpickle.dumps(factory), inline=state)
    plan = InputPlan.from_feature_cols(["features"], None).without_label()
    infos = {"features": ColumnInfo("features", "float", (None,), type_name="array<float>")}
    options = inference_options(batch_size=batch_size, use_gpu=device.type == "cuda", precision=precision)
    head = Head("", "prediction", factory.sizes["classes"], "raw")
    return Scorer(ref, plan, infos, [head], options, "prediction", "the check's Parquet")


def feed_rate(data_dir: str, factory: _Factory, batch_size: int) -> Dict[str, float]:
    """Rows/s of reading the Parquet and making the model's inputs (pinned on CUDA), no model."""
    scorer = _scorer(factory, torch.device("cpu"), None, batch_size)
    pin = torch.cuda.is_available()
    rows, started = 0, time.perf_counter()
    for batch in _batches(data_dir):
        for start in range(0, batch.num_rows, batch_size):
            ok, inputs = scorer.try_prepare(batch.slice(start, batch_size))
            assert ok, inputs
            tensor = torch.from_numpy(inputs)
            if pin:
                tensor.pin_memory()
            rows += len(tensor)
    return {"rows_per_s": rows / (time.perf_counter() - started)}


def score_runs(
    data_dir: str, build: Any, sizes: Dict[str, int], device: torch.device, precisions: List[Optional[str]]
) -> Dict[str, Any]:
    """The feed alone, then one scoring pass per precision (after one warm-up pass of 1 batch)."""
    factory = _Factory(build, sizes)
    batch_size = sizes["batch_size"] * 2  # no gradients: twice the training batch fits
    runs = []
    for precision in precisions:
        scorer = _scorer(factory, device, precision, batch_size)
        list(scorer(iter([next(_batches(data_dir))])))  # builds the model, CUDA context, kernels
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows, started = 0, time.perf_counter()
        for out in scorer(_batches(data_dir)):
            rows += out.num_rows
        elapsed = time.perf_counter() - started
        runs.append({"precision": precision or "fp32", "rows_per_s": rows / elapsed, "rows": rows})
    return {"batch_size": batch_size, "feed": feed_rate(data_dir, factory, batch_size), "runs": runs}


def print_scoring(report: Dict[str, Any]) -> None:
    scoring = report["scoring"]
    feed = scoring["feed"]["rows_per_s"]
    print()
    print(
        f"inference (sparkdl's scorer, batch {scoring['batch_size']}): the feed alone (read + inputs"
        f"{', pinned' if report['device'].startswith('cuda') else ''}) {feed:,.0f} rows/s"
    )
    print("| precision | rows/s | feed headroom |")
    print("|---|---:|---:|")
    for run in scoring["runs"]:
        print(f"| {run['precision']} | {run['rows_per_s']:,.0f} | {feed / run['rows_per_s']:.1f}x |")
