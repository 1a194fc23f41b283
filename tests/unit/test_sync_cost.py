"""``sparkdl plan``'s per-synchronization cost (γ): timed on two real gloo ranks with each
strategy's own code, and charged once per synchronization by the models."""

from __future__ import annotations

import logging
import time
import types

import pytest
import torch

from sparkdl.planning.models import Measured, StrategyShape, predict
from sparkdl.planning.sync_cost import sync_overheads
from sparkdl.strategies import AllReduce, ElasticAveraging, ModelAveraging, ParameterServer, ShardedDataParallel
from sparkdl.strategies.averaging import _ModelAveragingRuntime
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

WORLD = 2
#: What the slow strategy's every synchronization adds, on the rank's own time.
ADDED_S = 0.030


class _SlowSyncRuntime(_ModelAveragingRuntime):
    def _sync(self) -> None:
        super()._sync()
        time.sleep(ADDED_S)  # work of the rank's own, done at each synchronization (not a wait on anyone)


class SlowSyncAveraging:
    """ModelAveraging(sync_every=4) whose every synchronization costs ADDED_S more on each rank
    (what sync_overheads uses of a strategy; no Strategy subclass: that would register a name)."""

    warmup_steps = 0

    def create_runtime(self, env):
        return _SlowSyncRuntime(env, 4, 0, None)


def _strategies():
    return [
        (StrategyShape("allreduce", "AllReduce"), AllReduce()),
        (StrategyShape("averaging", "MA4", sync_every=4), ModelAveraging(sync_every=4)),
        (StrategyShape("averaging", "slow MA4", sync_every=4), SlowSyncAveraging()),
        (StrategyShape("elastic", "EA2", sync_every=2), ElasticAveraging(sync_every=2)),
        (StrategyShape("sharded", "SDP"), ShardedDataParallel(min_params=1)),
        (StrategyShape("parameter_server", "PS"), ParameterServer()),
    ]


def _model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, WORLD)
    env = cpu_env(rank, port, WORLD)
    ctx = types.SimpleNamespace(world_size=WORLD, dist_env=env, logger=logging.getLogger("test"))
    generator = torch.Generator().manual_seed(rank)
    kept = [
        (torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)) for _ in range(4)
    ]

    def build():
        torch.manual_seed(0)
        return _model(), lambda params: torch.optim.SGD(params, lr=0.01)

    def step(model, optimizer, features, labels):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()

    measured = Measured(
        batch_size=16,
        local_step_s=0.0005,
        compute_step_s=0.0005,
        data_rows_per_s=float("inf"),
        param_bytes=4 * sum(p.numel() for p in _model().parameters()),
        grad_bytes=4 * sum(p.numel() for p in _model().parameters()),
        optimizer_bytes=0,
        largest_unit_bytes=4 * 64 * 32,
        bandwidth=1e9,
        latency_s=50e-6,
    )
    save_results(sync_overheads(ctx, _strategies(), build, step, kept, measured, part_s=0.3), out_dir, rank)


def test_each_synchronizing_strategy_gets_its_measured_cost_and_a_costlier_sync_measures_costlier(tmp_path):
    ranks = spawn_ranks(_worker, WORLD, str(tmp_path))
    for overheads in ranks:
        # Timed: every strategy that synchronizes with collectives; the parameter server is not.
        assert set(overheads) == {"AllReduce", "MA4", "slow MA4", "EA2", "SDP"}, overheads
        assert all(seconds >= 0 for seconds in overheads.values()), overheads
        # The same averaging with ADDED_S more work per synchronization measures that much more.
        assert overheads["slow MA4"] - overheads["MA4"] == pytest.approx(ADDED_S, abs=0.012), overheads


def test_the_models_charge_the_cost_once_per_synchronization():
    base = Measured(
        batch_size=32,
        local_step_s=0.010,
        compute_step_s=0.009,
        data_rows_per_s=100_000,
        param_bytes=10**6,
        grad_bytes=10**6,
        optimizer_bytes=0,
        largest_unit_bytes=10**6,
        bandwidth=125e6,
        latency_s=50e-6,
    )
    charged = Measured(**{**base.__dict__, "sync_overhead_s": {"AR": 0.004, "MA": 0.008, "EA": 0.008, "SDP": 0.002}})
    shapes = {
        "AR": (StrategyShape("allreduce", "AR"), 1),
        "MA": (StrategyShape("averaging", "MA", sync_every=8), 8),
        "EA": (StrategyShape("elastic", "EA", sync_every=4), 4),
        "SDP": (StrategyShape("sharded", "SDP"), 1),
    }
    for label, (shape, tau) in shapes.items():
        for workers in (2, 16):
            added = predict(charged, shape, workers).step_s - predict(base, shape, workers).step_s
            assert added == pytest.approx(charged.sync_overhead_s[label] / tau), label
    # A strategy the calibration did not time is charged its transfer alone.
    ps = StrategyShape("parameter_server", "PS")
    assert predict(charged, ps, 4).step_s == predict(base, ps, 4).step_s
