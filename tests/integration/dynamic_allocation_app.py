"""The Spark application behind test_dynamic_allocation.py (its own process: dynamic allocation
is read when the SparkContext starts, and a process holds one).

Usage: python dynamic_allocation_app.py OUTPUT_JSON SCRATCH_DIR

``local-cluster[1,1,1024]`` with ``spark.dynamicAllocation.enabled=true``, as EMR and Dataproc
start every application: each entry point that launches ranks is called as a user would, and the
app records how long it took to refuse, what it said, and whether any Spark job ran before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def rank_value(ctx: Any) -> int:
    return ctx.rank


def refusal(tracker: Any, call: Callable[[], Any]) -> Dict[str, Any]:
    """What ``call`` did: the seconds to its error, the error, and the Spark jobs it started
    (``tracker``: the SparkContext's status tracker, taken before the job's code stops it)."""
    jobs_before = len(tracker.getJobIdsForGroup(None))
    started = time.monotonic()
    try:
        call()
        outcome: Dict[str, Any] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome["seconds"] = time.monotonic() - started
    outcome["jobs_started"] = len(tracker.getJobIdsForGroup(None)) - jobs_before
    return outcome


def main(output: str, scratch: str) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import sparkdl
    from sparkdl.cli import main as train_job
    from tests.cluster import local_cluster_builder
    from tests.models import digits_mlp

    spark = (
        local_cluster_builder("sparkdl-dynamic-allocation", shape="1,1,1024")
        .config("spark.dynamicAllocation.enabled", "true")
        .config("spark.dynamicAllocation.shuffleTracking.enabled", "true")
        .config("spark.executorEnv.PYTHONPATH", REPO_ROOT)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    rng = np.random.default_rng(0)
    features, labels = rng.random((256, 64), dtype=np.float32), rng.integers(0, 10, 256)
    url = os.path.join(scratch, "digits.parquet")
    pq.write_table(pa.table({"features": list(features), "label": labels}), url)
    frame = spark.createDataFrame(
        [(f.tolist(), int(y)) for f, y in zip(features, labels)], "features array<double>, label long"
    )
    estimator = sparkdl.TorchEstimator(model=digits_mlp, num_workers=1, epochs=1, progress=False)
    tracker = spark.sparkContext.statusTracker()
    results: Dict[str, Any] = {}
    try:
        results["fit_dataframe"] = refusal(tracker, lambda: estimator.fit(frame))
        results["fit_url"] = refusal(tracker, lambda: estimator.fit(url))
        results["run"] = refusal(tracker, lambda: sparkdl.run(rank_value, num_workers=1, progress=False))
        results["launch"] = refusal(tracker, lambda: sparkdl.launch(rank_value, num_workers=1, progress=False))
        results["compare"] = refusal(
            tracker,
            lambda: sparkdl.compare(digits_mlp, frame, strategies="allreduce", num_workers=1, epochs=1, progress=False),
        )
        results["plan"] = refusal(tracker, lambda: sparkdl.plan(digits_mlp, url, bandwidth="1Gbit", latency="50us"))
        job_output = os.path.join(scratch, "job")
        # The spark-submit job's code, in this process: its getOrCreate() finds this session (and stops it).
        results["job"] = refusal(
            tracker,
            lambda: train_job(
                [
                    "--data",
                    url,
                    "--model",
                    "tests.models:digits_mlp",
                    "--features",
                    "features",
                    "--label",
                    "label",
                    "--num-workers",
                    "1",
                    "--epochs",
                    "1",
                    "--quiet",
                    "--output",
                    job_output,
                ]
            ),
        )
        with open(os.path.join(job_output, "metrics.json")) as handle:
            metrics = json.load(handle)
        results["job"]["exit_code"] = metrics.get("exit_code")
        results["job"]["error"] = metrics.get("error")
    finally:
        spark.stop()
    with open(output, "w") as handle:
        json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
