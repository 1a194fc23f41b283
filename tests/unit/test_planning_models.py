"""``sparkdl plan``'s cost models and units: the standard formulas, checked on numbers worked by hand."""

from __future__ import annotations

import pytest

from sparkdl.errors import ConfigError
from sparkdl.planning.models import Measured, StrategyShape, predict, ring_allreduce_s, stops_scaling, sweep
from sparkdl.planning.units import bandwidth_bytes, latency_seconds

MB = 10**6

#: A 20 MB model, Adam (40 MB of state), 10 ms per step alone, a 1 Gbit/s link (125 MB/s), 50 us.
MODEL = Measured(
    batch_size=32,
    local_step_s=0.010,
    compute_step_s=0.009,
    data_rows_per_s=100_000,
    param_bytes=20 * MB,
    grad_bytes=20 * MB,
    optimizer_bytes=40 * MB,
    largest_unit_bytes=8 * MB,
    bandwidth=125 * MB,
    latency_s=50e-6,
)


def test_ring_allreduce_is_two_n_minus_one_over_n_of_the_bytes_plus_two_n_minus_one_latencies():
    # 2 workers: S/B + 2 alpha; 4 workers: 1.5 S/B + 6 alpha; a lone worker sends nothing.
    assert ring_allreduce_s(20 * MB, 2, 125 * MB, 50e-6) == pytest.approx(0.16 + 100e-6)
    assert ring_allreduce_s(20 * MB, 4, 125 * MB, 50e-6) == pytest.approx(0.24 + 300e-6)
    assert ring_allreduce_s(20 * MB, 1, 125 * MB, 50e-6) == 0.0


def test_allreduce_of_one_bucket_follows_the_backward_and_more_buckets_hide_behind_it():
    two = predict(MODEL, StrategyShape("allreduce", "AllReduce"), 2)
    # 20 MB is one DDP bucket: its allreduce starts when the backward ends: 10 ms + 160 ms + 2 x 50 us.
    assert two.step_s == pytest.approx(0.010 + 0.16 + 100e-6)
    assert two.samples_per_s == pytest.approx(2 * 32 / two.step_s)
    assert two.bound == "bandwidth" and two.wire_bytes_per_step == 20 * MB
    assert two.memory_per_rank_bytes == 80 * MB
    fast = predict(Measured(**{**MODEL.__dict__, "bandwidth": 100e9}), StrategyShape("allreduce", "AllReduce"), 2)
    assert fast.bound == "compute" and fast.efficiency > 0.95
    # 100 MB of gradients: 4 buckets; 3/4 of the 800 ms allreduce could hide, but only behind
    # the backward's 2/3 of the 9 ms compute.
    big = Measured(**{**MODEL.__dict__, "grad_bytes": 100 * MB, "param_bytes": 100 * MB})
    four = predict(big, StrategyShape("allreduce", "AllReduce"), 2)
    assert four.step_s == pytest.approx(0.010 + 0.8 + 4 * 100e-6 - 2 / 3 * 0.009)


def test_averaging_pays_one_allreduce_of_the_parameters_every_tau_steps_after_the_step():
    eight = predict(MODEL, StrategyShape("averaging", "MA", sync_every=8), 4)
    assert eight.step_s == pytest.approx(0.010 + (0.24 + 300e-6) / 8)
    assert eight.wire_bytes_per_step == int(1.5 * 20 * MB / 8)
    elastic = predict(MODEL, StrategyShape("elastic", "EA", sync_every=8), 4)
    assert elastic.step_s == pytest.approx(eight.step_s)
    assert elastic.memory_per_rank_bytes == eight.memory_per_rank_bytes + 20 * MB  # the center copy


def test_a_parameter_server_on_every_worker_moves_what_allreduce_does_and_fewer_shards_are_server_bound():
    allreduce = predict(MODEL, StrategyShape("allreduce", "AR"), 8)
    spread = predict(MODEL, StrategyShape("parameter_server", "PS"), 8)
    assert spread.wire_bytes_per_step == allreduce.wire_bytes_per_step
    one_shard = predict(MODEL, StrategyShape("parameter_server", "PS1", shards=1), 8)
    # One host serves all 8 workers: its link carries 8 times a worker's share.
    assert one_shard.bound == "server"
    assert one_shard.step_s - 0.010 == pytest.approx(8 * (spread.step_s - 0.010), rel=0.01)


def test_sharded_gathers_twice_and_reduce_scatters_holding_a_shard_of_the_state():
    gloo = predict(MODEL, StrategyShape("sharded", "FSDP"), 4)
    # gathers 2 x 3/4 S, reduce-scatter as an allreduce on gloo 2 x 3/4 S: 3 S = 60 MB per step.
    assert gloo.wire_bytes_per_step == 60 * MB
    nccl = predict(Measured(**{**MODEL.__dict__, "backend": "nccl"}), StrategyShape("sharded", "FSDP"), 4)
    assert nccl.wire_bytes_per_step == 45 * MB
    assert gloo.memory_per_rank_bytes == 80 * MB // 4 + 2 * 8 * MB


def test_a_data_path_slower_than_compute_is_what_bounds_the_step():
    # 32 rows at 1,000 rows/s: 32 ms of data path against 9 ms of compute, in a 40 ms loop step.
    slow_data = Measured(**{**MODEL.__dict__, "data_rows_per_s": 1_000, "local_step_s": 0.040, "bandwidth": 100e9})
    prediction = predict(slow_data, StrategyShape("averaging", "MA", sync_every=64), 2)
    assert prediction.bound == "data" and prediction.step_s == pytest.approx(0.040, rel=1e-3)


def test_where_a_strategy_stops_scaling_is_the_first_count_under_the_efficiency_floor():
    fast_link = Measured(**{**MODEL.__dict__, "bandwidth": 10e9 / 8 * 1.0, "latency_s": 20e-6})
    predictions = sweep(fast_link, [StrategyShape("allreduce", "AR")], [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    # 10 Gbit/s: 20 MB take 16 ms x 2(N-1)/N > 10 ms compute from N=2; latency grows with N.
    stop = stops_scaling(predictions, 0.8)
    assert stop is not None and stop.workers == 2 and stop.comm_bound == "bandwidth"
    efficiencies = [p.efficiency for p in predictions]
    assert efficiencies == sorted(efficiencies, reverse=True)  # never better with more workers
    assert predictions[-1].bound == "latency"  # 2 x 1023 x 20 us = 41 ms per bucket round


def test_units_as_links_are_sold():
    assert bandwidth_bytes("10Gbit") == 1.25e9 and bandwidth_bytes("100mbit") == 12.5e6
    assert bandwidth_bytes("10Gbps") == 1.25e9 and bandwidth_bytes("1.25GB/s") == 1.25e9
    assert bandwidth_bytes(5e8) == 5e8 and bandwidth_bytes(None) is None
    assert latency_seconds("50us") == pytest.approx(50e-6) and latency_seconds("0.2ms") == pytest.approx(2e-4)
    assert latency_seconds(1e-4) == 1e-4
    with pytest.raises(ConfigError, match=r"bandwidth='fast': give a link speed such as '10Gbit'"):
        bandwidth_bytes("fast")
    with pytest.raises(ConfigError, match=r"latency='-1us'"):
        latency_seconds("-1us")
