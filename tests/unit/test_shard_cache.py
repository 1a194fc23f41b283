"""The shard cache (sparkdl.data.shard_cache) without Spark: passes served from memory hand out
exactly the batches streamed passes do, memory stays within the budget, and the driver's
decision follows the setting, the shard's size and the memory a task has."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import numpy as np
import pyarrow.compute as pc
import pytest

from sparkdl._driver.settings import DataSettings
from sparkdl.data import shard_cache
from sparkdl.data.batching import batches
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers.arrow import ArrowReader
from sparkdl.data.readers.petastorm import PetastormReader
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError
from tests.unit.test_arrow_reader import CONFIGS, write_ids

UNEVEN = [[300, 40, 17, 5], [100], [64, 64]]  # 7 row groups, 590 rows
BIG = 1 << 40


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    return write_ids(tmp_path_factory.mktemp("uneven"), UNEVEN)


def _cached(spec: DataSpec, budget: int) -> DataSpec:
    decision = shard_cache.Decision("memory", budget, 0, budget, "test")
    return dataclasses.replace(spec, shard_cache=decision)


def _stream(reader, info, spec, rank, world_size, count):
    stream = batches(reader, info, spec, rank, world_size)
    try:
        return list(itertools.islice(stream, count))
    finally:
        stream.close()


def _assert_same(streamed, cached):
    assert len(streamed) == len(cached)
    for (fa, la), (fb, lb) in zip(streamed, cached):
        np.testing.assert_array_equal(fa, fb)
        np.testing.assert_array_equal(la, lb)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_passes_from_memory_hand_out_the_batches_streamed_passes_do(uneven, config, world_size):
    """Same seed, same rows in the same order, pass after pass (shuffled or not, filters, the
    hold-out, row striding at 8 ranks > 7 row groups); and the later passes read nothing."""
    kwargs = CONFIGS[config]
    info = inspect_dataset(uneven, ["id", "vec"], "label", filters=kwargs.get("filters"))
    spec = DataSpec(batch_size=16, seed=5, shuffle_buffer_batches=2, **kwargs)
    rank = world_size - 1
    streamed = _stream(ArrowReader(), info, spec, rank, world_size, 80)  # several passes
    reader = ArrowReader()
    cached = _stream(reader, info, _cached(spec, BIG), rank, world_size, 80)
    _assert_same(streamed, cached)
    stats = reader.shard_cache.stats()
    assert stats["held_bytes"] > 0 and stats["served_row_groups"] > 0 and stats["streamed_row_groups"] == 0
    assert not stats["full"]


def test_without_a_budget_the_reader_keeps_nothing(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    reader = ArrowReader()
    _stream(reader, info, DataSpec(batch_size=16), 0, 1, 60)
    assert reader.shard_cache is None


def test_a_budget_too_small_keeps_what_fits_says_so_once_and_changes_no_batch(uneven, caplog):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    spec = DataSpec(batch_size=16, seed=3)
    streamed = _stream(ArrowReader(), info, spec, 0, 1, 120)
    reader = ArrowReader()
    budget = 4_000  # less than the largest row group (300 rows of three numeric columns)
    with caplog.at_level(logging.WARNING, logger="sparkdl.data"):
        cached = _stream(reader, info, _cached(spec, budget), 0, 1, 120)
    _assert_same(streamed, cached)
    stats = reader.shard_cache.stats()
    assert 0 < stats["held_bytes"] <= budget and stats["full"] and stats["streamed_row_groups"] > 0
    warnings = [r.getMessage() for r in caplog.records if "shard cache" in r.getMessage()]
    assert len(warnings) == 1 and "read from Parquet every pass" in warnings[0], warnings


def test_the_footers_estimate_a_ranks_decoded_bytes(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    assert len(info.row_group_bytes) == info.num_row_groups and all(size > 0 for size in info.row_group_bytes)
    for world_size in (1, 2, 8):
        for rank in range(world_size):
            reader = ArrowReader()
            steps = 200  # more than a pass: every row group of the shard was read once
            _stream(reader, info, _cached(DataSpec(batch_size=4, shuffle=False), BIG), rank, world_size, steps)
            held = reader.shard_cache.stats()["held_bytes"]
            estimate = shard_cache.rank_bytes(info, rank, world_size)
            assert 0.7 * held <= estimate <= 2.0 * held, (world_size, rank, held, estimate)


def test_the_estimate_leaves_out_the_holdout(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    whole = shard_cache.rank_bytes(info, 0, 1)
    assert shard_cache.rank_bytes(info, 0, 1, holdout=0.25) == pytest.approx(0.75 * whole, rel=0.01)


def _decide(info, setting, memory, caches=True):
    return shard_cache.decide(setting, info, 2, 0.0, caches, memory, "spark.executor.memory=test")


def test_auto_keeps_a_shard_that_fits_half_a_tasks_memory_and_streams_one_that_does_not(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    largest = max(shard_cache.rank_bytes(info, rank, 2) for rank in range(2))
    fits = _decide(info, "auto", 4 * largest)
    assert fits.budget_bytes == 2 * largest and "kept in memory" in fits.reason
    streams = _decide(info, "auto", largest)  # half of it is too little
    assert streams.budget_bytes is None and "every pass streams" in streams.reason
    assert "spark.executor.memory=test" in streams.reason and streams.shard_bytes == largest


def test_memory_keeps_a_shard_that_fits_and_refuses_one_that_cannot_with_the_numbers(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    largest = max(shard_cache.rank_bytes(info, rank, 2) for rank in range(2))
    assert _decide(info, "memory", largest).budget_bytes == largest
    with pytest.raises(
        ConfigError,
        match=r"shard_cache='memory': a rank's shard .* takes about .* more than the .* a task has \(spark\.executor\.memory=test\)",
    ):
        _decide(info, "memory", largest // 2)


def test_none_and_readers_that_cannot_cache_stream(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label")
    assert _decide(info, "none", BIG).budget_bytes is None
    assert not PetastormReader.caches_row_groups and ArrowReader.caches_row_groups
    decision = _decide(info, "memory", BIG, caches=False)
    assert decision.budget_bytes is None and "the reader streams every pass" in decision.reason


def test_an_unknown_setting_is_a_config_error_naming_the_valid_ones():
    with pytest.raises(ConfigError, match="shard_cache='disk' is unknown; valid: 'auto', 'memory', 'none'"):
        DataSettings(feature_cols=["x"], shard_cache="disk")
    assert DataSettings(feature_cols=["x"]).shard_cache == "auto"


@pytest.mark.parametrize(
    "conf, expected",
    [
        ({}, (1 << 30, "spark.executor.memory=1g")),
        ({"spark.executor.memory": "2g"}, (2 << 30, "spark.executor.memory=2g")),
        (
            {"spark.executor.memory": "4g", "spark.executor.pyspark.memory": "512m"},
            (512 << 20, "spark.executor.pyspark.memory=512m"),
        ),
        (
            {"spark.executor.memory": "4096", "spark.executor.cores": "4"},
            (1 << 30, "spark.executor.memory=4096 shared by 4 concurrent tasks"),
        ),
        (
            {"spark.executor.memory": "4g", "spark.executor.cores": "4", "spark.task.cpus": "2"},
            (2 << 30, "spark.executor.memory=4g shared by 2 concurrent tasks"),
        ),
    ],
)
def test_a_tasks_memory_comes_from_sparks_settings(conf, expected):
    assert shard_cache.task_memory_bytes(conf.get) == expected


def test_a_filter_that_keeps_nothing_of_a_row_group_is_remembered_as_empty(uneven):
    info = inspect_dataset(uneven, ["id", "vec"], "label", filters=pc.field("id") < 300)  # only the first row group
    reader = ArrowReader()
    spec = _cached(DataSpec(batch_size=8, seed=1, filters=pc.field("id") < 300), BIG)
    _stream(reader, info, spec, 0, 1, 100)
    stats = reader.shard_cache.stats()
    assert stats["row_groups"] == 1 and stats["rows"] == 300 and stats["served_row_groups"] > 0


def test_the_training_stages_own_cpus_per_task_decide_how_many_ranks_share_an_executors_memory():
    conf = {"spark.executor.memory": "4g", "spark.executor.cores": "4", "spark.task.cpus": "1"}
    # resources=Resources(cpus=4): one rank per 4-core executor has all of its memory.
    assert shard_cache.task_memory_bytes(conf.get, task_cpus=4) == (4 << 30, "spark.executor.memory=4g")
    assert shard_cache.task_memory_bytes(conf.get, task_cpus=0.5) == (
        512 << 20,
        "spark.executor.memory=4g shared by 8 concurrent tasks",
    )
