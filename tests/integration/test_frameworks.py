"""Lightning (Trainer, Fabric) and Accelerate inside real sparkdl tasks: DDP on sparkdl's process group.

Real local-cluster Spark, real gloo, the real frameworks (the latest stack's ``frameworks`` extra).
The frameworks are imported inside the tests and the task functions, never at module level: the
petastorm stack, which lacks them, still collects this module, and its selection
(``petastorm or not (spark or slow)``) leaves these ``spark`` tests out.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import sparkdl

pytestmark = pytest.mark.spark

EPOCHS = 3
WORKERS = 2
# A trained MLP scores ~0.95 on the held-out digits after 3 epochs; untrained ~0.1, and labels fed
# out of step with features (a broken shard) stay near chance.
MIN_ACCURACY = 0.85


@pytest.fixture(scope="module")
def digits_paths(tmp_path_factory):
    from examples.digits import write_split

    return write_split(str(tmp_path_factory.mktemp("framework-digits")))


def _run(train_fn, train_path, **kwargs):
    return sparkdl.run(
        train_fn,
        num_workers=WORKERS,
        data=train_path,
        feature_cols=["features"],
        label_col="label",
        batch_size=32,
        progress=False,
        timeout_s=60,
        **kwargs,
    )


def _across_ranks(ctx, net: torch.nn.Module, steps: int, group_before) -> dict:
    """What every rank saw, gathered to rank 0 over sparkdl's group: step counts, the spread of
    the final weights, child processes, and whether the framework kept sparkdl's group."""
    import psutil
    import torch.distributed as dist

    flat = torch.cat([p.detach().cpu().flatten() for p in net.parameters()])
    weights = [torch.zeros_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(weights, flat)
    mine = {
        "rank": ctx.rank,
        "steps": steps,
        "steps_per_epoch": len(sparkdl.shard_dataset()),
        "children": [p.name() for p in psutil.Process().children(recursive=True)],
        "same_group": dist.group.WORLD is group_before and dist.is_initialized(),
    }
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return {
        "ranks": everyone,
        "weight_spread": max(float((w - weights[0]).abs().max()) for w in weights),
        "state": {k: v.detach().cpu() for k, v in net.state_dict().items()},
    }


def _trainer_fn(ctx):
    import torch.distributed as dist

    from examples.lightning_digits import fit_trainer

    group = dist.group.WORLD
    module, trainer = fit_trainer(epochs=EPOCHS)
    assert trainer.world_size == ctx.world_size and trainer.global_rank == ctx.rank, (
        trainer.world_size,
        trainer.global_rank,
    )
    return _across_ranks(ctx, module.net, module.steps, group)


def _fabric_fn(ctx):
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from examples.lightning_digits import fit_fabric

    group = dist.group.WORLD
    steps = 0

    def count(*_):
        nonlocal steps
        steps += 1

    # Count optimizer steps through a hook: the example's loop stays the user's loop.
    handle = register_optimizer_step_post_hook(count)
    try:
        model, fabric = fit_fabric(epochs=EPOCHS)
    finally:
        handle.remove()
    assert fabric.world_size == ctx.world_size and fabric.global_rank == ctx.rank
    return _across_ranks(ctx, model, steps, group)


def _accelerate_fn(ctx):
    import torch.distributed as dist

    from examples.accelerate_digits import fit_accelerate

    group = dist.group.WORLD
    model, accelerator, steps = fit_accelerate(epochs=EPOCHS)
    assert accelerator.num_processes == ctx.world_size and accelerator.process_index == ctx.rank
    return _across_ranks(ctx, model, steps, group)


def _check(result, test_path, accuracy):
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == list(range(WORKERS))
    steps_per_epoch = ranks[0]["steps_per_epoch"]
    assert steps_per_epoch > 0
    # Every rank stepped once per batch of its shard, the same count: no sampler cut the shard again.
    assert [r["steps"] for r in ranks] == [EPOCHS * steps_per_epoch] * WORKERS, ranks
    assert all(r["same_group"] for r in ranks), "the framework replaced sparkdl's process group"
    assert all(r["children"] == [] for r in ranks), f"the framework started processes: {ranks}"
    # DDP kept the replicas identical; ranks that trained alone would differ by far more.
    assert result["weight_spread"] < 1e-5, result["weight_spread"]
    assert accuracy(result["state"], test_path) > MIN_ACCURACY


def test_lightning_trainer_trains_digits_with_ddp_on_sparkdls_group(spark, digits_paths):
    from examples.lightning_digits import accuracy

    train_path, test_path = digits_paths
    _check(_run(_trainer_fn, train_path), test_path, accuracy)


def test_lightning_fabric_trains_digits_with_ddp_on_sparkdls_group(spark, digits_paths):
    from examples.lightning_digits import accuracy

    train_path, test_path = digits_paths
    _check(_run(_fabric_fn, train_path), test_path, accuracy)


def test_accelerate_trains_digits_with_ddp_on_sparkdls_group(spark, digits_paths):
    from examples.accelerate_digits import accuracy

    train_path, test_path = digits_paths
    _check(_run(_accelerate_fn, train_path), test_path, accuracy)


def _devices_two_fn(ctx):
    import lightning as L
    from torch.utils.data import DataLoader

    from examples.lightning_digits import DigitsModule, trainer_settings

    settings = dict(trainer_settings(EPOCHS), devices=2)  # the mistake: two processes per task
    L.Trainer(**settings).fit(DigitsModule(), DataLoader(sparkdl.shard_dataset(), batch_size=None))


def _ddp_spawn_fn(ctx):
    import lightning as L
    from torch.utils.data import DataLoader

    from examples.lightning_digits import DigitsModule, trainer_settings

    settings = dict(trainer_settings(EPOCHS), strategy="ddp_spawn")  # Lightning would start its own processes
    L.Trainer(**settings).fit(DigitsModule(), DataLoader(sparkdl.shard_dataset(), batch_size=None))


def test_lightning_with_devices_2_fails_fast_naming_the_rank_and_the_setting(spark, digits_paths):
    started = time.monotonic()
    with pytest.raises(sparkdl.TrainingError) as raised:
        _run(_devices_two_fn, digits_paths[0], watchdog_timeout_s=60)
    message = str(raised.value)
    assert "training failed on rank" in message  # the driver names the rank(s)
    assert "Lightning was given devices=2 and num_nodes=2" in message, message
    assert f"use devices=1 and num_nodes={WORKERS}" in message, message
    assert time.monotonic() - started < 60


def test_a_framework_starting_its_own_processes_fails_fast_naming_the_rank(spark, digits_paths):
    started = time.monotonic()
    with pytest.raises(sparkdl.TrainingError) as raised:
        _run(_ddp_spawn_fn, digits_paths[0], watchdog_timeout_s=60)
    message = str(raised.value)
    # Every rank fails so: one rank's report, or both grouped ("ranks 0, 1"), by when the stage is cancelled.
    assert "ProcessSpawnError" in message and re.search(
        r"ranks? 0(, 1)?: a Lightning strategy tried to start", message
    ), message
    assert isinstance(raised.value, sparkdl.ConfigError)  # a setting: raised as one, not retried
    assert f"use strategy='ddp', devices=1 and num_nodes={WORKERS}" in message, message
    assert time.monotonic() - started < 60
