"""What checkpointing costs: seconds per checkpoint and the slowdown of an epoch.

    .venv/bin/python benchmarks/checkpoint_cost.py [--rows 40000] [--epochs 3]

Trains the same job three times on a local-cluster[2,1,2048] Spark session — no checkpoints,
a checkpoint at every epoch's end, and one every 20 steps — for a small (85k parameters) and a
larger (4.3M parameters) MLP, and prints the mean epoch time (epochs after the first), the
number of checkpoints per epoch, the seconds each checkpoint took (timed around it on rank 0)
and the resulting slowdown against the run without checkpoints.
A checkpoint gathers every rank's model, optimizer and strategy state to rank 0, which writes
one file to the local disk here (HDFS or an object store add their own latency).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from allreduce_vs_ddp import FEATURES, synthetic, write_parquet  # noqa: E402


class MLP:
    """A picklable factory for an MLP of a given width (travels to the executors by value)."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def __call__(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES, self.hidden), torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, self.hidden), torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, 10),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    from _spark import local_cluster

    import sparkdl

    spark = local_cluster("sparkdl-benchmark-checkpoints", executor_memory_mb=2048, pythonpath=(ROOT, os.path.join(ROOT, "benchmarks")))
    workdir = tempfile.mkdtemp(prefix="sparkdl-ckpt-bench-")
    rows = []
    try:
        data = os.path.join(workdir, "data")
        features, labels = synthetic(args.rows)
        write_parquet(data, features, labels)
        steps_per_epoch = args.rows // (2 * args.batch_size)
        for hidden in (256, 2048):
            factory = MLP(hidden)
            params = sum(p.numel() for p in factory().parameters())
            baseline = None
            for label, every in (("none", False), ("every epoch", None), ("every 20 steps", 20)):
                checkpoint_dir = os.path.join(workdir, f"ckpt-{hidden}-{label.replace(' ', '-')}")
                model = sparkdl.TorchEstimator(
                    model=factory, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), num_workers=2,
                    batch_size=args.batch_size, epochs=args.epochs, progress=False,
                    checkpoint_dir=None if every is False else checkpoint_dir,
                    checkpoint_every=every if every else None,
                ).fit(data)
                epoch_seconds = float(np.mean([r["seconds"] for r in model.history[1:]]))
                per_epoch = 0 if every is False else (1 + (steps_per_epoch - 1) // every if every else 1)
                if baseline is None:
                    baseline = epoch_seconds
                stats = model.run_info["checkpoints"]
                # Measured around each checkpoint on rank 0 (gather, serialize, write, barrier).
                cost = stats["seconds"] / stats["count"] if stats["count"] else 0.0
                size = ""
                if every is not False:
                    files = [f for f in os.listdir(checkpoint_dir) if f.startswith("ckpt-")]
                    size = f"{os.path.getsize(os.path.join(checkpoint_dir, files[-1])) / 1e6:.1f} MB"
                rows.append((f"{params / 1e6:.2f}M", label, epoch_seconds, per_epoch, cost, epoch_seconds / baseline - 1, size))
    finally:
        spark.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nrows={args.rows} workers=2 batch/worker={args.batch_size} steps/epoch={args.rows // (2 * args.batch_size)}")
    print("| model params | checkpoints | epoch seconds | checkpoints/epoch | seconds per checkpoint (measured) | epoch slowdown | file size |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for params, label, seconds, count, cost, slowdown, size in rows:
        print(f"| {params} | {label} | {seconds:.2f} | {count} | {cost:.3f} | {slowdown:+.0%} | {size} |")


if __name__ == "__main__":
    main()
