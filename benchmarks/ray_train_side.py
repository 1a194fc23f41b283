"""The Ray Train side of ``benchmarks/allreduce_vs_ddp.py``: Ray Train's ``TorchTrainer`` fed by
Ray Data from the same Parquet, with the same model, optimizer, per-worker batch, workers and
threads. Prints one JSON line: per-epoch samples/s of all workers, the whole call, start-up.

It runs in its own virtualenv, never sparkdl's (ray is no dependency of the package):

    benchmarks/ray_env                 # creates .venv-ray (pinned ray and the stack's torch)
    .venv-ray/bin/python benchmarks/ray_train_side.py --path DATA --model mlp --batch-size 64 --epochs 3

``allreduce_vs_ddp.py --ray`` runs it for its Ray Train row. The workers take one CPU each, as
sparkdl's tasks do; Ray Data's read tasks get the CPUs the workers leave (``ray.init(num_cpus=3)``
on 2 cores: one CPU of headroom for the data pipeline, oversubscribed as Ray's own examples run).
The model and optimizer are the ones of allreduce_vs_ddp.py, imported from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def model_fn(name: str):
    """The model builder ``name`` stands for: a key of allreduce_vs_ddp.MODELS, or ``module:function``
    (a module of benchmarks/, e.g. ``_parity_workload:make_model``)."""
    import importlib

    from allreduce_vs_ddp import MODELS

    module, _, function = name.rpartition(":")
    return getattr(importlib.import_module(module), function) if module else MODELS[name]


def train_loop(config) -> None:
    import torch
    import torch.distributed as dist
    from allreduce_vs_ddp import held_out_accuracy, make_optimizer
    from ray import train
    from ray.train.torch import prepare_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = prepare_model(model_fn(config["model"])())  # DDP on gloo
    optimizer = make_optimizer(model.parameters())
    shard = train.get_dataset_shard("train")
    context = train.get_context()
    world = context.get_world_size()
    batch = config["batch_size"]
    first_batch = None
    for epoch in range(config["epochs"]):
        dist.barrier()
        start, samples = time.time(), 0
        # Equal steps per worker (DDP needs them): Ray splits the rows evenly with equal=True.
        for batch_data in shard.iter_torch_batches(
            batch_size=batch, drop_last=True, local_shuffle_buffer_size=8 * batch, dtypes=None
        ):
            if first_batch is None:
                first_batch = time.time()
            y = batch_data["label"].long()
            x = batch_data["features"].reshape(len(y), -1).float()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            samples += len(y)
        dist.barrier()
        seconds = time.time() - start
        record = {"epoch": epoch, "samples": samples * world, "seconds": seconds, "first_batch": first_batch or 0.0}
        if context.get_world_rank() == 0:
            if config["test"] and epoch == config["epochs"] - 1:
                record["accuracy"] = held_out_accuracy(model.module, config["test"])
            # Written by rank 0 itself: what a trainer hands back of its reports differs between
            # Ray Train's versions, a file does not.
            with open(config["metrics"], "a") as out:
                out.write(json.dumps(record) + "\n")
        train.report(record)


def summary(metrics: str, called: float, whole: float) -> dict:
    """The run's figures from rank 0's metrics file: per-epoch samples/s, the whole call, start-up
    (called -> first batch), the first batch's time.time() and the held-out accuracy."""
    with open(metrics) as lines:
        history = [json.loads(line) for line in lines]
    first = next((row["first_batch"] for row in history if row.get("first_batch")), None)
    return {
        "rates": [row["samples"] / row["seconds"] for row in history if row.get("seconds")],
        "whole": whole,
        "startup": (first - called) if first else whole,
        "first_batch": first,
        "accuracy": next((row["accuracy"] for row in history if "accuracy" in row), None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True, help="the Parquet directory allreduce_vs_ddp.py wrote")
    parser.add_argument("--model", default="mlp", help="a name of allreduce_vs_ddp.MODELS or module:function")
    parser.add_argument("--test", default=None, help="an .npz of held-out features, labels: report the accuracy")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    called = time.time()
    # Loopback only, as every sparkdl benchmark: Ray would otherwise bind the machine's address.
    ray.init(
        num_cpus=args.workers + 1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",
    )
    metrics = os.path.join(tempfile.mkdtemp(prefix="sparkdl-ray-"), "metrics.jsonl")
    try:
        dataset = ray.data.read_parquet(os.path.abspath(args.path))

        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "model": args.model,
                "batch_size": args.batch_size,
                "epochs": args.epochs,
                "metrics": metrics,
                "test": args.test and os.path.abspath(args.test),
            },
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}),
            datasets={"train": dataset},
            run_config=RunConfig(storage_path=os.path.join(os.path.abspath(args.path), "..", "ray-results")),
        )
        result = trainer.fit()
        if result.error is not None:
            raise result.error
        whole = time.time() - called
        print(json.dumps({**summary(metrics, called, whole), "ray": ray.__version__}))
    finally:
        ray.shutdown()
        shutil.rmtree(os.path.dirname(metrics), ignore_errors=True)


if __name__ == "__main__":
    main()
