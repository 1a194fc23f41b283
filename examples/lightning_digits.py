"""PyTorch Lightning inside sparkdl tasks: digits trained with Lightning's DDP on sparkdl's process group.

    python examples/lightning_digits.py            # the Trainer, on local-cluster[2,1,1024]
    python examples/lightning_digits.py --fabric   # the same model with Lightning Fabric
    SPARKDL_MASTER=spark://host:7077 python examples/lightning_digits.py --workers 4

Each sparkdl task is one Lightning "node" of one process: ``devices=1, num_nodes=WORLD_SIZE``,
``strategy="ddp"``. sparkdl has created the process group and set the torchrun variables, so
Lightning detects torchelastic, starts no process and reuses the group. Each rank's batches come
from ``sparkdl.shard_dataset()`` (already this rank's shard, the same count on every rank), so the
Trainer must not add a DistributedSampler: ``use_distributed_sampler=False``. docs/frameworks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, Dict, Tuple

import lightning as L
import torch
from torch.utils.data import DataLoader

import sparkdl


def make_model() -> torch.nn.Module:
    """The quick start's MLP for 8x8 digits (64 features, 10 classes), seeded: every rank starts
    from the same weights (DDP would broadcast rank 0's anyway)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


class DigitsModule(L.LightningModule):
    """The MLP as a LightningModule; reports each epoch's mean loss (over all ranks) to the driver."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = make_model()
        self.lr = lr
        self.steps = 0  # optimizer steps this rank took (the test compares ranks)
        self._losses: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(features), labels)
        self.steps += 1
        self._losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        # A collective on every rank (the same step count everywhere), then one report from rank 0.
        loss = self.trainer.strategy.reduce(torch.stack(self._losses).mean(), reduce_op="mean")
        self._losses.clear()
        if self.trainer.is_global_zero:
            sparkdl.report(epoch=self.current_epoch + 1, loss=round(float(loss), 4))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def trainer_settings(epochs: int, accelerator: str = "cpu") -> Dict[str, Any]:
    """The Trainer arguments for a sparkdl task: one process per task, the shard as it is, and
    nothing written to the executor's working directory (no checkpoints, no logs)."""
    return dict(
        accelerator=accelerator,
        devices=1,  # one process per task; more fails fast (docs/frameworks.md)
        num_nodes=int(os.environ["WORLD_SIZE"]),  # the run's num_workers
        strategy="ddp",
        max_epochs=epochs,
        use_distributed_sampler=False,  # the shard dataset is already this rank's part
        enable_checkpointing=False,  # checkpoint through checkpoint_dir / ShardDataset.state_dict instead
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit_trainer(epochs: int = 5, lr: float = 0.05) -> Tuple[DigitsModule, L.Trainer]:
    """Runs in every task: fits a DigitsModule on this rank's shard with the Trainer."""
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    module = DigitsModule(lr)
    trainer = L.Trainer(**trainer_settings(epochs, accelerator))
    trainer.fit(module, DataLoader(sparkdl.shard_dataset(), batch_size=None))
    return module, trainer


def fit_fabric(epochs: int = 5, lr: float = 0.05) -> Tuple[torch.nn.Module, Any]:
    """Runs in every task: the same training with Lightning Fabric and a loop of one's own."""
    from lightning.fabric import Fabric

    fabric = Fabric(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        num_nodes=int(os.environ["WORLD_SIZE"]),
        strategy="ddp",
    )
    fabric.launch()  # under torchelastic: no process started, the existing group reused
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    # An IterableDataset gets no DistributedSampler from Fabric; the loader only moves batches to the device.
    loader = fabric.setup_dataloaders(DataLoader(sparkdl.shard_dataset(), batch_size=None))
    for epoch in range(epochs):
        total = torch.zeros(())
        for features, labels in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(features), labels)
            fabric.backward(loss)
            optimizer.step()
            total += loss.detach().cpu()
        loss = fabric.all_reduce(total / len(loader), reduce_op="mean")
        if fabric.global_rank == 0:
            sparkdl.report(epoch=epoch + 1, loss=round(float(loss), 4))
    return model.module, fabric


def train_with_trainer(ctx: Any, epochs: int = 5) -> Dict[str, torch.Tensor]:
    """``sparkdl.run`` target: rank 0's trained weights come back to the driver."""
    module, _ = fit_trainer(epochs)
    return {k: v.cpu() for k, v in module.net.state_dict().items()}


def train_with_fabric(ctx: Any, epochs: int = 5) -> Dict[str, torch.Tensor]:
    model, _ = fit_fabric(epochs)
    return {k: v.cpu() for k, v in model.state_dict().items()}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fabric", action="store_true", help="Lightning Fabric instead of the Trainer")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script
    from examples.digits import local_session, write_split

    spark = local_session("sparkdl-lightning-digits")
    with tempfile.TemporaryDirectory() as tmp:
        train_path, test_path = write_split(tmp)
        fn = train_with_fabric if args.fabric else train_with_trainer
        epochs = args.epochs
        state = sparkdl.run(
            lambda ctx: fn(ctx, epochs),
            num_workers=args.workers,
            data=train_path,
            feature_cols=["features"],
            label_col="label",
            batch_size=32,
        )
        print(f"held-out accuracy ({'Fabric' if args.fabric else 'Trainer'}): {accuracy(state, test_path):.3f}")
    spark.stop()


if __name__ == "__main__":
    main()
