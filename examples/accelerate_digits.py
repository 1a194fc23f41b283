"""Hugging Face Accelerate inside sparkdl tasks: digits trained with Accelerate's DDP on sparkdl's process group.

    python examples/accelerate_digits.py           # local-cluster[2,1,1024]
    SPARKDL_MASTER=spark://host:7077 python examples/accelerate_digits.py --workers 4

``Accelerator()`` finds the process group sparkdl created (and the torchrun variables), so it
joins it: ``num_processes == WORLD_SIZE``, ``process_index == RANK``. ``prepare`` takes the model
and optimizer only. The DataLoader over ``sparkdl.shard_dataset()`` is NOT prepared: each rank
already reads its own shard, and a prepared loader over an IterableDataset would let rank 0 read
and dispatch its batches to every rank (the other shards never read, half the data lost) or, with
``dispatch_batches=False``, fail on ``batch_size=None``. docs/frameworks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Dict, Tuple

import torch
from torch.utils.data import DataLoader

import sparkdl


def make_model() -> torch.nn.Module:
    """The quick start's MLP for 8x8 digits (64 features, 10 classes), seeded alike on every rank.
    Defined here, not imported, so that run as a script it ships to the executors by value."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def accuracy(state: Dict[str, torch.Tensor], path: str) -> float:
    """Share of the digits Parquet rows at ``path`` the weights ``state`` classify right."""
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    features = torch.tensor(np.stack(table.column("features").to_numpy(zero_copy_only=False)).astype("float32"))
    labels = torch.tensor(table.column("label").to_numpy())
    model = make_model()
    model.load_state_dict(state)
    with torch.no_grad():
        return float((model(features).argmax(1) == labels).float().mean())


def fit_accelerate(epochs: int = 5, lr: float = 0.05) -> Tuple[torch.nn.Module, Any, int]:
    """Runs in every task: trains the MLP on this rank's shard; returns the unwrapped model, the
    Accelerator and the number of optimizer steps taken."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    loader = DataLoader(sparkdl.shard_dataset(), batch_size=None)  # not prepared: already this rank's shard
    steps = 0
    for epoch in range(epochs):
        total, batches = torch.zeros((), device=accelerator.device), 0
        for features, labels in loader:
            features, labels = features.to(accelerator.device), labels.to(accelerator.device)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(features), labels)
            accelerator.backward(loss)
            optimizer.step()
            total += loss.detach()
            batches += 1
            steps += 1
        loss = accelerator.reduce(total / batches, reduction="mean")  # every rank: same batch count
        if accelerator.is_main_process:
            sparkdl.report(epoch=epoch + 1, loss=round(float(loss), 4))
    return accelerator.unwrap_model(model), accelerator, steps


def train_with_accelerate(ctx: Any, epochs: int = 5) -> Dict[str, torch.Tensor]:
    """``sparkdl.run`` target: rank 0's trained weights come back to the driver."""
    model, _, _ = fit_accelerate(epochs)
    return {k: v.cpu() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
    from examples.digits import local_session, write_split  # on the driver only

    spark = local_session("sparkdl-accelerate-digits")
    with tempfile.TemporaryDirectory() as tmp:
        train_path, test_path = write_split(tmp)
        epochs = args.epochs
        state = sparkdl.run(
            lambda ctx: train_with_accelerate(ctx, epochs),
            num_workers=args.workers,
            data=train_path,
            feature_cols=["features"],
            label_col="label",
            batch_size=32,
        )
        print(f"held-out accuracy (Accelerate): {accuracy(state, test_path):.3f}")
    spark.stop()


if __name__ == "__main__":
    main()
