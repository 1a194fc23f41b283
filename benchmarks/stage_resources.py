"""ETL and training with different task resources in one Spark application (``resources=``).

    .venv/bin/python benchmarks/stage_resources.py [--rows 40000] [--epochs 3] [--repeats 2]

One ``local-cluster[1,2,2048]`` application (one executor with 2 cores, ``spark.task.cpus=1``):

1. ETL writes the training Parquet with Spark SQL: 1 CPU per task, two tasks at a time;
2. the same fit (a compute-bound MLP, one rank) twice per repeat, side by side: with the
   application's 1 CPU per task, and with ``resources=sparkdl.Resources(cpus=2)`` — the training
   stage's own resource profile, 2 torch threads in its one task;
3. ETL again: ``model.transform`` and an aggregation, back at 1 CPU per task.

It prints each stage's resource profile id as Spark's status store recorded it (what the UI's
Stages tab and a SparkListener show), and the two fits' steady samples/s and their ratio (the
machine is shared: the ratio is the figure). A script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _spark import local_cluster  # noqa: E402


def _model():
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )


def _stages(sc):
    """(stage id, name, resource profile id, tasks) of every stage this application ran."""
    tracker, store = sc._jsc.sc().statusTracker(), sc._jsc.sc().statusStore()
    stages = set()
    for job in sc.statusTracker().getJobIdsForGroup(None):
        info = tracker.getJobInfo(job)
        if info.isDefined():
            stages.update(int(stage) for stage in info.get().stageIds())
    rows = []
    for stage in sorted(stages):
        data = store.lastStageAttempt(stage)
        rows.append((stage, str(data.name())[:60], int(data.resourceProfileId()), int(data.numTasks())))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=40000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import sparkdl

    spark = local_cluster("stage-resources", executor_memory_mb=2048, workers=1, cores_per_worker=2)
    sc = spark.sparkContext
    out = tempfile.mkdtemp(prefix="stage-resources-")
    path = os.path.join(out, "train.parquet")
    # 1. ETL at the default profile: features from Spark SQL, written as Parquet by 4 tasks.
    spark.range(0, args.rows, 1, 4).selectExpr(
        "transform(sequence(1, 64), i -> cast(rand(7) * i AS float)) AS features",
        "cast(id % 10 AS bigint) AS label",
    ).write.parquet(path)

    rates = {"1 CPU per task (application default)": [], "resources=Resources(cpus=2)": []}
    profile_ids = {}
    model = None
    for _ in range(args.repeats):
        for name, resources in (
            ("1 CPU per task (application default)", None),
            ("resources=Resources(cpus=2)", sparkdl.Resources(cpus=2)),
        ):
            model = sparkdl.TorchEstimator(
                model=_model,
                num_workers=1,
                epochs=args.epochs,
                batch_size=args.batch_size,
                progress=False,
                shard_cache="memory",
                resources=resources,
            ).fit(path)
            # Steady rate: the epochs after the first (which reads and caches the Parquet).
            rates[name].append(statistics.median(epoch["samples_per_sec"] for epoch in model.history[1:]))
            profile_ids[name] = (model.run_info.get("resources") or {}).get("stage_resource_profile_ids", [0])
    # 3. ETL again, at the default profile.
    predictions = model.transform(spark.read.parquet(path))
    predictions.groupBy("prediction").count().collect()

    print(f"\n{'stage':>5}  {'resource profile':>16}  {'tasks':>5}  name")
    for stage, name, profile, tasks in _stages(sc):
        print(f"{stage:>5}  {profile:>16}  {tasks:>5}  {name}")
    print(
        f"\nsteady samples/s, median of {args.repeats} fits each (MLP 64-512-512-10, batch {args.batch_size}, one rank):"
    )
    base = statistics.median(rates["1 CPU per task (application default)"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:<40} {median:>10,.0f}  x{median / base:.2f}   (stage resource profile {profile_ids[name]})")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
