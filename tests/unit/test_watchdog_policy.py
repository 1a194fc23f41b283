"""The watchdog's policies (sparkdl._driver.watchdog) on their own, and the step timings a rank's
heartbeat carries (sparkdl._runtime.liveness) measured on a real clock."""

from __future__ import annotations

import threading

import pytest

from sparkdl._driver.watchdog import AutoWatchdog, FixedWatchdog, RankProgress, watchdog_policy
from sparkdl._runtime.liveness import COMPUTE, LOAD, Liveness
from sparkdl._task.config import LaunchConfig
from sparkdl.errors import ConfigError
from sparkdl.strategies import AllReduce, ElasticAveraging, ModelAveraging, ParameterServer


def _stepping(idle_s: float, steps: int = 100, part: str = COMPUTE, load: float = 0.02, compute: float = 0.01):
    return RankProgress(
        idle_s=idle_s,
        phase="training step",
        step_part=part,
        steps=steps,
        slowest_load_s=load,
        slowest_compute_s=compute,
    )


def test_a_fixed_bound_is_the_same_in_every_phase():
    policy = FixedWatchdog(30.0)
    for progress in (_stepping(1.0), RankProgress(idle_s=1.0, phase="checkpointing step 4")):
        allowance = policy.allowance(0, {0: progress})
        assert allowance.seconds == 30.0 and allowance.why == "watchdog_timeout_s=30"


def test_auto_judges_a_step_by_the_slowest_step_seen_on_any_rank_with_a_floor_and_a_cap():
    policy = AutoWatchdog()
    # 10 ms steps: the floor (6 s) is the bound, not 10 x 10 ms.
    fast = {0: _stepping(3.0), 1: _stepping(0.1)}
    allowance = policy.allowance(0, fast)
    assert allowance.seconds == policy.compute_floor_s
    assert "10 x the slowest step's compute" in allowance.why and "0.01s" in allowance.why
    # A 2 s step somewhere (rank 1's): 10 x 2 s for every rank.
    slow = {0: _stepping(3.0), 1: _stepping(0.1, compute=2.0)}
    assert policy.allowance(0, slow).seconds == pytest.approx(20.0)
    # A rank waiting for its batch gets the data floor (object storage has slow moments).
    waiting = {0: _stepping(3.0, part=LOAD), 1: _stepping(0.1)}
    allowance = policy.allowance(0, waiting)
    assert allowance.seconds == policy.load_floor_s and "wait for a batch" in allowance.why
    # Never more than the phase bound.
    glacial = {0: _stepping(3.0, compute=500.0)}
    assert policy.allowance(0, glacial).seconds == policy.phase_s


def test_auto_keeps_the_phase_bound_until_every_rank_knows_its_pace_and_while_any_rank_is_outside_a_step():
    policy = AutoWatchdog(warmup_steps=20)
    warming = {0: _stepping(3.0), 1: _stepping(0.1, steps=19)}
    allowance = policy.allowance(0, warming)
    assert allowance.seconds == policy.phase_s and "the first 20 steps set the pace" in allowance.why
    # Rank 1 writes a checkpoint; rank 0 may wait for it in the next step's collective.
    checkpointing = {0: _stepping(30.0), 1: RankProgress(idle_s=30.0, phase="checkpointing step 400", steps=100)}
    for rank in (0, 1):
        allowance = policy.allowance(rank, checkpointing)
        assert allowance.seconds == policy.phase_s and "rank 1 is outside a training step" in allowance.why


def test_the_setting_selects_the_policy_and_the_warm_up_covers_two_sync_cycles():
    assert watchdog_policy(None) is None
    assert watchdog_policy(45) == FixedWatchdog(45.0)
    assert watchdog_policy("auto") == AutoWatchdog()
    assert watchdog_policy("auto", AllReduce().steps_per_sync_cycle()).warmup_steps == 10
    assert (
        watchdog_policy("auto", ModelAveraging(sync_every=64, warmup_steps=8).steps_per_sync_cycle()).warmup_steps
        == 145
    )
    assert watchdog_policy("auto", ElasticAveraging(sync_every=8).steps_per_sync_cycle()).warmup_steps == 17
    assert ParameterServer().steps_per_sync_cycle() == 1
    for bad in (0, -1, "fast", True, float("nan")):
        with pytest.raises(ConfigError, match="'auto'"):
            watchdog_policy(bad)
        with pytest.raises(ConfigError, match="watchdog_timeout_s"):
            LaunchConfig(num_workers=1, watchdog_timeout_s=bad)
    assert LaunchConfig(num_workers=1, watchdog_timeout_s="auto").heartbeat_interval_s == 1.0
    assert LaunchConfig(num_workers=1, watchdog_timeout_s=5).heartbeat_interval_s == 1.0
    assert LaunchConfig(num_workers=1, watchdog_timeout_s=600).heartbeat_interval_s == 2.0


def test_liveness_times_the_parts_of_steps_and_nothing_else():
    liveness = Liveness()
    pause = threading.Event()  # never set: its wait is the time the step part takes
    liveness.advance("loading data (step 1)", LOAD)
    pause.wait(0.05)
    liveness.advance("training step 1", COMPUTE)
    pause.wait(0.12)
    liveness.advance("checkpointing step 1")  # ends the compute part; a checkpoint is no step
    pause.wait(0.3)
    liveness.advance("loading data (step 2)", LOAD)
    beat = liveness.beat()
    assert beat["steps"] == 1 and beat["step_part"] == LOAD and beat["phase"] == "loading data (step 2)"
    assert 0.05 <= beat["slowest_load_s"] < 0.12
    assert 0.12 <= beat["slowest_compute_s"] < 0.3  # the checkpoint's 0.3 s is not counted
    assert beat["progress"] == 4
