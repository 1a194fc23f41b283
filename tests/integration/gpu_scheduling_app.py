"""The Spark application behind test_gpu_scheduling.py (run as its own process: it needs a
SparkContext with GPU resources, and a process holds one SparkContext).

Usage: python gpu_scheduling_app.py DISCOVERY_SCRIPT OUTPUT_JSON

``local-cluster[2,1,1024]``: two standalone workers inside the driver JVM, each running the fake
discovery script (which hands out GPU "0" to one worker and "1" to the other), two executors
with one core and one GPU each, and tasks that request one GPU. The executors start with
``CUDA_VISIBLE_DEVICES=4,6``, as a cluster manager that isolates GPUs would set it, so Spark's
address "1" means physical GPU 6. torch here is a CPU build: what is tested for real is the
selection sparkdl makes from what Spark assigned, the errors and fallbacks, and the restore.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Dict, List

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

EXECUTOR_VISIBLE = "4,6"
LEAKED = "changed-by-train-fn"


def report(ctx: Any) -> List[Dict[str, Any]]:
    """Every rank's view, gathered to rank 0 (run() returns rank 0's value)."""
    import torch
    import torch.distributed as dist
    from pyspark import BarrierTaskContext

    barrier = BarrierTaskContext.get()
    assignment = ctx.device_assignment
    layer = torch.nn.Linear(4, 2).to(ctx.device)
    with ctx.autocast():
        autocast_dtype = str(layer(torch.ones(1, 4, device=ctx.device)).dtype)
    mine = {
        "rank": ctx.rank,
        "resources": {name: list(info.addresses) for name, info in barrier.resources().items()},
        "device": str(ctx.device),
        "spark_addresses": list(assignment.spark_addresses),
        "physical_ids": list(assignment.physical_ids),
        "visible_devices": assignment.visible_devices,
        "note": assignment.note,
        "warning": assignment.warning,
        "env_in_task": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pid": os.getpid(),
        "backend": dist.get_backend(),
        "precision": ctx.precision,
        "autocast_dtype": autocast_dtype,
    }
    # User code that changes the variable: the next task of this Python worker must not see it.
    os.environ["CUDA_VISIBLE_DEVICES"] = LEAKED
    everyone: List[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def worker_env(batches: Any) -> Any:
    """Arrow batches of (pid, CUDA_VISIBLE_DEVICES): run the way sparkdl's own stage runs
    (mapInArrow), so it lands on the same pool of Python workers."""
    import pyarrow as pa

    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({"pid": [os.getpid()], "env": [os.environ.get("CUDA_VISIBLE_DEVICES")]})


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


def inference(spark: Any) -> Dict[str, Any]:
    """TorchModel.transform in this application, whose tasks each get one GPU: what the scoring
    tasks were given (recorded by the model factory where each builds the model), the rows
    scored on the CPU fallback, and the error with useGpu=True."""
    import glob
    import tempfile

    import sparkdl
    from tests.models import CountingFactory, Poisonable

    builds = tempfile.mkdtemp(prefix="sparkdl-gpu-inference-")
    model = sparkdl.TorchModel.from_state(
        Poisonable().state_dict(), model=CountingFactory(builds), feature_cols=["features"], output_shape=[3]
    )
    frame = spark.createDataFrame([(i, [float(i % 5)] * 8) for i in range(64)], "id long, features array<float>")
    frame = frame.repartition(2)
    out: Dict[str, Any] = {"inference_rows": model.transform(frame).filter("prediction IS NOT NULL").count()}
    found = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(builds, "*.json")))]
    out["inference_builds"] = [b for b in found if b["pid"] != os.getpid()]
    try:
        model.copy().setUseGpu(True).transform(frame).collect()
        out["inference_required"] = None
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        out["inference_required"] = str(exc)[-4000:]
    return out


def main(discovery_script: str, output: str) -> None:
    import sparkdl
    from tests.cluster import local_cluster_builder

    spark = (
        local_cluster_builder("sparkdl-gpu-scheduling")
        .config("spark.worker.resource.gpu.amount", "1")
        .config("spark.worker.resource.gpu.discoveryScript", discovery_script)
        .config("spark.executor.resource.gpu.amount", "1")
        .config("spark.task.resource.gpu.amount", "1")
        .config("spark.executorEnv.CUDA_VISIBLE_DEVICES", EXECUTOR_VISIBLE)
        .config("spark.executorEnv.PYTHONPATH", REPO_ROOT)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # Both executors registered before the first run: on a loaded machine the second one's JVM
    # can take longer to come up than the launcher's 30 s slot wait (see test_failures.py).
    from sparkdl._driver.stage import check_slots

    check_slots(spark.sparkContext, 2, wait_s=300)
    collect = Collect()
    logging.getLogger("sparkdl").addHandler(collect)
    logging.getLogger("sparkdl").setLevel(logging.INFO)
    results: Dict[str, Any] = {}
    try:
        results["auto"] = sparkdl.run(report, num_workers=2, use_gpu=None, progress=False, spark=spark, timeout_s=120)
        results["auto_logs"] = list(collect.messages)
        # Right away, while the same Python workers sit idle: what does the next task see?
        after = spark.range(0, 2, 1, 2).mapInArrow(worker_env, "pid long, env string", barrier=True).collect()
        results["after"] = [row.asDict() for row in after]
        try:
            sparkdl.run(report, num_workers=2, use_gpu=True, progress=False, spark=spark, timeout_s=120, max_failures=2)
            results["required"] = None
        except sparkdl.TrainingError as error:
            results["required"] = {"message": str(error), "types": [f.exc_type for f in error.failures]}
        results["cpu_bf16"] = sparkdl.run(
            report, num_workers=2, use_gpu=False, precision="bf16-mixed", progress=False, spark=spark, timeout_s=120
        )
        results.update(inference(spark))
    finally:
        spark.stop()
    with open(output, "w") as handle:
        json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
