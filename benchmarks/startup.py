"""Start-up: from ``fit`` called to the first training step, for an application's first fit and later ones.

    .venv/bin/python benchmarks/startup.py [--fits 3] [--rows 20000]

Starts a new ``local-cluster[2,1,1024]`` application three times, each in a fresh driver
process (a process that already fitted once has imported what a first fit imports), and, in
each, waits until both executors registered (Spark's own start-up is not sparkdl's), then fits
the same small MLP on the same Parquet ``--fits`` times. In the first application the first fit
is the application's first Spark job and finds the executors cold; in the second, one Spark job
without Python ran before it (as reading or counting a DataFrame would: the JVMs' own first-job
cost, paid by whatever job comes first, is then behind it), and the executors' Python workers
are still cold; in the third, ``sparkdl.warm_up(spark)`` ran when the session was created (what
a notebook's first cell or a job's start does; it runs in the background of the user's code,
and is waited for here so that its own time prints apart).

Prints per fit ``run_info["startup"]``: the driver's preparation (data inspection, slot check,
loss and optimizer checks), Spark scheduling the barrier stage and forking a Python worker, the
new worker's imports (unpickling the task: torch, pyarrow, sparkdl; "reused" for a worker that
ran an earlier task), the rendezvous, the first step (model, DDP, optimizer, whose first one in
a process imports torch._dynamo, first batch read) and their sum. A script that prints figures
measured side by side in one run; on a shared machine compare the rows, not the absolute
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from allreduce_vs_ddp import make_mlp, make_optimizer, synthetic, write_parquet  # noqa: E402


def _fits(rows: int, workdir: str, fits: int, kind: str) -> Dict[str, Any]:
    from _spark import local_cluster

    import sparkdl

    spark = local_cluster(f"sparkdl-startup-{kind}", pythonpath=(ROOT, os.path.join(ROOT, "benchmarks")))
    try:
        deadline = time.monotonic() + 120
        while spark.sparkContext._jsc.sc().getExecutorIds().size() < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # polling Spark's registration: it has no Python-side event
        first_job = 0.0
        if kind == "spark-job":
            # The application's first Spark job, with no Python in it (what reading or counting a
            # DataFrame would be): the JVMs load and compile what every job runs.
            started = time.time()
            spark.range(0, 1000, 1, 2).selectExpr("sum(id)").collect()
            first_job = time.time() - started
        warmed = 0.0
        if kind == "warm-up":
            # In a notebook or a job it runs in the background while the user's code goes on;
            # waited for here, so that its time is printed apart.
            started = time.time()
            sparkdl.warm_up(spark, wait=True)
            warmed = time.time() - started
        started = time.time()
        path = os.path.join(workdir, kind)
        write_parquet(path, *synthetic(rows))  # the user's own set-up, meanwhile
        setup = time.time() - started
        out = []
        for _ in range(fits):
            called = time.time()
            model = sparkdl.TorchEstimator(
                model=make_mlp,
                optimizer=make_optimizer,
                num_workers=2,
                batch_size=64,
                epochs=1,
                progress=False,
            ).fit(path)
            info = model.run_info
            out.append({**info["startup"], "launch": info["startup_seconds"], "whole": time.time() - called})
        return {"setup": setup, "first_job": first_job, "warm_up": warmed, "fits": out}
    finally:
        spark.stop()


APPLICATIONS = {
    "cold": "cold executors: the fit is the application's first Spark job",
    "spark-job": "cold executors, after the application's first Spark job (no Python)",
    "warm-up": "sparkdl.warm_up(spark) at session start",
}


def _application(kind: str, rows: int, fits: int) -> Dict[str, Any]:
    """One application in a fresh Python process: its figures as JSON."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--application",
        kind,
        "--rows",
        str(rows),
        "--fits",
        str(fits),
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fits", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--application", choices=sorted(APPLICATIONS), help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args()
    if args.application:
        workdir = tempfile.mkdtemp(prefix="sparkdl-startup-")
        try:
            print(json.dumps(_fits(args.rows, workdir, args.fits, args.application)))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    runs = {label: _application(kind, args.rows, args.fits) for kind, label in APPLICATIONS.items()}
    print(f"\nlocal-cluster[2,1,1024], {args.rows} rows, MLP, 2 workers, 1 epoch per fit")
    print(
        "| application | fit | prepare (driver) | schedule (Spark) | worker imports | rendezvous | first step "
        "| fit called → first batch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, run in runs.items():
        for index, fit in enumerate(run["fits"], start=1):
            phases = " | ".join(
                "reused" if fit[name] is None else f"{fit[name]:.2f} s"
                for name in ("prepare", "schedule", "worker_imports", "rendezvous", "first_step")
            )
            print(
                f"| {label} | {index}{' (first)' if index == 1 else ''} | {phases} | {fit['prepare'] + fit['launch']:.2f} s |"
            )
    print(f"\nthe application's first Spark job (no Python) took {runs[APPLICATIONS['spark-job']]['first_job']:.1f} s")
    print(
        f"sparkdl.warm_up itself took {runs[APPLICATIONS['warm-up']]['warm_up']:.1f} s (in the background of the user's code; waited for here)"
    )


if __name__ == "__main__":
    main()
