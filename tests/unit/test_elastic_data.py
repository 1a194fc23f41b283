"""Elastic resume's data path without Spark: the position replay matches the real stream, and an
N -> M resume reads every row of the interrupted epoch exactly once."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from sparkdl.data import reshard
from sparkdl.data.batching import batches, steps_per_epoch
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers.arrow import ArrowReader
from sparkdl.data.selection import shard_rows
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError
from tests.unit.test_arrow_reader import UNEVEN, write_ids

CASES = [
    pytest.param(dict(shuffle=True), id="shuffled"),
    pytest.param(dict(shuffle=False), id="ordered"),
    pytest.param(dict(shuffle=True, holdout=0.2), id="holdout"),
    pytest.param(dict(shuffle=True, filters=[("group", "!=", 1)]), id="filters"),
]


def _dataset(tmp_path, filters=None):
    return inspect_dataset(write_ids(str(tmp_path / "ids"), UNEVEN), ["id"], "label", filters=filters)


def _ids(batch) -> list:
    return [int(v) for v in np.asarray(batch[0])[:, 0]]


def _real_ids(dataset, spec, rank, world_size, start, stop):
    stream = batches(ArrowReader(), dataset, spec, rank, world_size)
    try:
        return [_ids(b) for b in itertools.islice(stream, start, stop)]
    finally:
        stream.close()


def _steps(dataset, spec, world_size):
    return steps_per_epoch(
        sum(shard_rows(dataset, world_size, spec.holdout, "train", spec.filters)), spec.batch_size, world_size
    )


@pytest.mark.parametrize("settings", CASES)
def test_the_position_replay_is_the_real_stream(tmp_path, settings):
    dataset = _dataset(tmp_path, settings.get("filters"))
    spec = DataSpec(batch_size=16, seed=3, **settings)
    for rank in range(2):
        replay = [b.tolist() for b in reshard.stream_positions(dataset, spec, rank, 2, 5, 40)]
        assert replay == _real_ids(dataset, spec, rank, 2, 5, 40)  # id == position in these files


@pytest.mark.parametrize("settings", CASES)
@pytest.mark.parametrize("old_world, new_world", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_a_resharded_epoch_reads_each_remaining_row_exactly_once(tmp_path, settings, old_world, new_world):
    dataset = _dataset(tmp_path, settings.get("filters"))
    spec = DataSpec(batch_size=8, seed=1, **settings)
    old_steps = _steps(dataset, spec, old_world)
    epoch, done = 1, old_steps // 3  # interrupted a third into the second epoch
    start = epoch * old_steps
    old = [reshard.StreamState(start + done, start, old_steps) for _ in range(old_world)]
    # What the old ranks would have read in the whole epoch, and what they did read before it stopped.
    whole = collections.Counter(
        i for r in range(old_world) for b in _real_ids(dataset, spec, r, old_world, start, start + old_steps) for i in b
    )
    before = collections.Counter(
        i for r in range(old_world) for b in _real_ids(dataset, spec, r, old_world, start, start + done) for i in b
    )
    new_steps = _steps(dataset, spec, new_world)
    plans = [reshard.plan_remainder(dataset, spec, old, j, new_world, new_steps) for j in range(new_world)]
    assert len({p.steps for p in plans}) == 1 and plans[0].steps > 0  # every rank runs the same steps
    assert all(p.next_start == (epoch + 1) * new_steps for p in plans)
    after = collections.Counter()
    for j, plan in enumerate(plans):
        got = [_ids(b) for b in reshard.remainder_batches(dataset, spec, plan, j)]
        assert len(got) == plan.steps and all(0 < len(b) <= spec.batch_size + 1 for b in got)
        after.update(i for b in got for i in b)
    assert before + after == whole

    # A checkpoint taken two steps into the resharded epoch resumes on yet another number of ranks.
    taken = 2
    states = [reshard.StreamState(p.next_start, None, new_steps, p.share, p.steps, taken) for p in plans]
    first = collections.Counter(
        i for p, j in zip(plans, range(new_world)) for b in p.batches()[:taken] for i in b.tolist()
    )
    again = collections.Counter()
    final_steps = _steps(dataset, spec, old_world)
    for j in range(old_world):
        plan = reshard.plan_remainder(dataset, spec, states, j, old_world, final_steps)
        again.update(i for b in reshard.remainder_batches(dataset, spec, plan, j) for i in _ids(b))
        assert plan.next_start == (epoch + 1) * final_steps
    assert before + first + again == whole


def test_too_few_rows_left_for_the_new_workers_is_a_clear_error(tmp_path):
    dataset = _dataset(tmp_path)
    spec = DataSpec(batch_size=1, shuffle=False)
    steps = _steps(dataset, spec, 1)
    old = [reshard.StreamState(steps - 1, 0, steps)]  # one row left
    with pytest.raises(ConfigError, match="1 row\\(s\\) left, fewer than num_workers=2"):
        reshard.plan_remainder(dataset, spec, old, 0, 2, _steps(dataset, spec, 2))


def test_petastorm_refuses_an_elastic_resume():
    with pytest.raises(ConfigError, match="reader='petastorm' cannot resume .* use reader='arrow'"):
        reshard.check_reader("petastorm")
