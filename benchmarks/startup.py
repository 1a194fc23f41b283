"""Start-up: from ``fit`` called to the first training step, for an application's first fit and later ones.

    .venv/bin/python benchmarks/startup.py [--fits 3] [--rows 20000]

Starts a new ``local-cluster[2,1,1024]`` application twice, each in a fresh driver process (a
process that already fitted once has torch._dynamo and pandas imported), and, in each, waits until both
executors registered (Spark's own start-up is not sparkdl's), then fits the same small MLP on
the same Parquet ``--fits`` times. In the first application the first fit finds the executors
cold; in the second, ``sparkdl.warm_up(spark)`` ran when the session was created (what a
notebook's first cell or a job's start does; it runs in the background of the user's code, and
is waited for here so that its own time prints apart). Prints per fit the driver's preparation (data inspection, slot
check, loss and optimizer checks), the launch to the first batch on rank 0 (Spark schedules the
barrier stage, Python workers start and import, rendezvous, first batch read) and their sum. A
script that prints figures measured side by side in one run; on a shared machine compare the
rows, not the absolute seconds.
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


def _fits(rows: int, workdir: str, fits: int, warm_up: bool) -> Dict[str, Any]:
    from _spark import local_cluster

    import sparkdl

    spark = local_cluster(f"sparkdl-startup-{'warm-up' if warm_up else 'cold'}", pythonpath=(ROOT, os.path.join(ROOT, "benchmarks")))
    try:
        deadline = time.monotonic() + 120
        while spark.sparkContext._jsc.sc().getExecutorIds().size() < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # polling Spark's registration: it has no Python-side event
        warmed = 0.0
        if warm_up:
            # In a notebook or a job it runs in the background while the user's code goes on;
            # waited for here, so that its time is printed apart.
            started = time.time()
            sparkdl.warm_up(spark, wait=True)
            warmed = time.time() - started
        started = time.time()
        path = os.path.join(workdir, "warm" if warm_up else "cold")
        write_parquet(path, *synthetic(rows))  # the user's own set-up, meanwhile
        setup = time.time() - started
        out = []
        for _ in range(fits):
            called = time.time()
            model = sparkdl.TorchEstimator(
                model=make_mlp, optimizer=make_optimizer, num_workers=2, batch_size=64, epochs=1, progress=False,
            ).fit(path)
            info = model.run_info
            out.append({"prepare": info["prepare_seconds"], "launch": info["startup_seconds"], "whole": time.time() - called})
        return {"setup": setup, "warm_up": warmed, "fits": out}
    finally:
        spark.stop()


APPLICATIONS = {"cold": "cold executors", "warm-up": "sparkdl.warm_up(spark) at session start"}


def _application(kind: str, rows: int, fits: int) -> Dict[str, Any]:
    """One application in a fresh Python process: its figures as JSON."""
    command = [sys.executable, os.path.abspath(__file__), "--application", kind, "--rows", str(rows), "--fits", str(fits)]
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
            print(json.dumps(_fits(args.rows, workdir, args.fits, args.application == "warm-up")))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    runs = {label: _application(kind, args.rows, args.fits) for kind, label in APPLICATIONS.items()}
    print(f"\nlocal-cluster[2,1,1024], {args.rows} rows, MLP, 2 workers, 1 epoch per fit")
    print("| application | fit | prepare (driver) | launch → first batch | fit called → first batch |")
    print("|---|---:|---:|---:|---:|")
    for label, run in runs.items():
        for index, fit in enumerate(run["fits"], start=1):
            print(f"| {label} | {index}{' (first)' if index == 1 else ''} | {fit['prepare']:.2f} s | {fit['launch']:.2f} s | {fit['prepare'] + fit['launch']:.2f} s |")
    print(f"\nsparkdl.warm_up itself took {runs['sparkdl.warm_up(spark) at session start']['warm_up']:.1f} s (in the background of the user's code; waited for here)")


if __name__ == "__main__":
    main()
