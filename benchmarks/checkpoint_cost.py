"""What checkpointing costs: the training stall per checkpoint and the slowdown of an epoch,
asynchronous writes (the default) and synchronous ones side by side in one run.

    .venv/bin/python benchmarks/checkpoint_cost.py [--rows 40000] [--epochs 3]

Trains the same job on a local-cluster[2,1,2048] Spark session — no checkpoints, then a
checkpoint at every epoch's end and one every 20 steps, each written in the background
(``checkpoint_async=True``, the default) and synchronously (``checkpoint_async=False``) — for a small (85k parameters)
and a larger (4.35M parameters, Adam: 52 MB of state) MLP. It prints the mean epoch time (epochs
after the first), the checkpoints per epoch, the training thread's stall per checkpoint (timed
around ``save_checkpoint`` on rank 0: the copy to host memory when asynchronous; the copy, the
write and the barrier when synchronous), the background write per checkpoint (serialize, store,
commit), the stall as a share of the synchronous one, the epoch slowdown against the run
without checkpoints, and the checkpoint's size. Every rank writes its own part (its share of the
replicated model and optimizer state) to the local disk here; HDFS or an object store add their
own latency to the write, which the asynchronous path keeps off the training thread.
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

MODES = (
    ("none", False, None),
    ("every epoch", None, True),
    ("every epoch", None, False),
    ("every 20 steps", 20, True),
    ("every 20 steps", 20, False),
)


class MLP:
    """A picklable factory for an MLP of a given width (travels to the executors by value)."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def __call__(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES, self.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, self.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, 10),
        )


def _fit(data: str, factory: MLP, args: argparse.Namespace, checkpoint_dir, every, async_write):
    import sparkdl

    estimator = sparkdl.TorchEstimator(
        model=factory,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        num_workers=2,
        batch_size=args.batch_size,
        epochs=args.epochs,
        progress=False,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=every or None,
        checkpoint_async=async_write,
    )
    return estimator.fit(data)


def _size(checkpoint_dir: str) -> float:
    """MB of the newest checkpoint: every rank's part and the manifest."""
    newest = sorted(name for name in os.listdir(checkpoint_dir) if name.startswith("ckpt-"))[-1]
    directory = os.path.join(checkpoint_dir, newest)
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    from _spark import local_cluster

    spark = local_cluster(
        "sparkdl-benchmark-checkpoints", executor_memory_mb=2048, pythonpath=(ROOT, os.path.join(ROOT, "benchmarks"))
    )
    workdir = tempfile.mkdtemp(prefix="sparkdl-ckpt-bench-")
    rows = []
    try:
        data = os.path.join(workdir, "data")
        features, labels = synthetic(args.rows)
        write_parquet(data, features, labels)
        steps_per_epoch = args.rows // (2 * args.batch_size)
        for hidden in (256, 2048):
            factory = MLP(hidden)
            params = f"{sum(p.numel() for p in factory().parameters()) / 1e6:.2f}M"
            measured = []
            for label, every, async_write in MODES:
                checkpoint_dir = None if every is False else os.path.join(workdir, f"ckpt-{hidden}-{len(measured)}")
                model = _fit(data, factory, args, checkpoint_dir, every, async_write)
                row = {
                    "params": params,
                    "label": label,
                    "epoch": float(np.mean([r["seconds"] for r in model.history[1:]])),
                }
                if checkpoint_dir is not None:
                    stats = model.run_info["checkpoints"]
                    row.update(
                        mode="async" if async_write else "sync",
                        per_epoch=1 + (steps_per_epoch - 1) // every if every else 1,
                        stall=stats["seconds"] / stats["count"],
                        write=stats["write_seconds"] / stats["written"] if stats["written"] else None,
                        size=f"{_size(checkpoint_dir):.1f} MB",
                    )
                measured.append(row)
            baseline = measured[0]["epoch"]
            for row in measured[1:]:
                # Against the run without checkpoints, and the synchronous stall of the same schedule.
                sync = next(r for r in measured[1:] if r["label"] == row["label"] and r["mode"] == "sync")
                row.update(slowdown=row["epoch"] / baseline - 1, share=row["stall"] / sync["stall"])
            rows.extend(measured)
    finally:
        spark.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\nrows={args.rows} workers=2 batch/worker={args.batch_size} steps/epoch={args.rows // (2 * args.batch_size)}"
    )
    print(
        "| model params | checkpoints | write | epoch seconds | checkpoints/epoch | stall per checkpoint | background write per checkpoint | stall vs sync | epoch slowdown | checkpoint size |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        cells = [
            _cell(row, "stall", "{:.3f} s"),
            _cell(row, "write", "{:.3f} s"),
            _cell(row, "share", "{:.0%}"),
            _cell(row, "slowdown", "{:+.0%}"),
        ]
        print(
            f"| {row['params']} | {row['label']} | {row.get('mode', '–')} | {row['epoch']:.2f} | {row.get('per_epoch', 0)} | {' | '.join(cells)} | {row.get('size', '')} |"
        )


def _cell(row, key, form):
    return form.format(row[key]) if row.get(key) is not None else "–"


if __name__ == "__main__":
    main()
