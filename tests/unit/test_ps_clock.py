"""The SSP read rule alone: :class:`SSPClock` is pure bookkeeping (no threads, sockets or
process group), so every case is a few ticks and an assertion."""

from __future__ import annotations

import pytest

from sparkdl.strategies.parameter_server.clock import SSPClock
from sparkdl.strategies.parameter_server.wire import WireError

# ---- SSP clocks -------------------------------------------------------------------------------


def test_clock_staleness_and_the_read_rule():
    clock = SSPClock(3, max_staleness=2)
    for _ in range(3):
        clock.tick(0, clock.clocks[0])
    clock.tick(1, 0)
    assert clock.clocks == [3, 1, 0]
    assert clock.min_clock() == 0
    assert clock.staleness(3) == 3 and not clock.can_read(3)
    assert clock.blockers(3) == [2]  # rank 1 (clock 1) is within the bound, rank 2 is not
    assert clock.staleness(2) == 2 and clock.can_read(2)
    clock.tick(2, 0)
    assert clock.can_read(3) and clock.blockers(3) == []


def test_bulk_synchronous_and_fully_asynchronous_bounds():
    bsp = SSPClock(2, max_staleness=0)
    bsp.tick(0, 0)
    assert not bsp.can_read(1) and bsp.blockers(1) == [1]
    bsp.tick(1, 0)
    assert bsp.can_read(1) and bsp.staleness(1) == 0
    free = SSPClock(2, max_staleness=None)
    for c in range(50):
        free.tick(0, c)
    assert free.can_read(50) and free.staleness(50) == 50 and free.blockers(50) == []


def test_finished_workers_stop_holding_others_back_and_lost_ones_keep_blocking():
    clock = SSPClock(3, max_staleness=0)
    clock.tick(0, 0)
    clock.finish(1)
    assert clock.blockers(1) == [2]
    clock.lose(2, "gone")
    assert clock.blockers(1) == [2] and clock.lost == {2: "gone"}
    clock.finish(2)  # a worker that said BYE is finished, even if later marked lost
    assert clock.can_read(1)
    clock.finish(0)
    assert clock.min_clock() == 1  # everyone finished: the largest clock


def test_out_of_order_or_late_pushes_are_protocol_errors():
    clock = SSPClock(2, max_staleness=None)
    clock.tick(0, 0)
    with pytest.raises(WireError, match="pushed clock 0, expected 1"):
        clock.tick(0, 0)
    clock.finish(1)
    with pytest.raises(WireError, match="rank 1, which has left"):
        clock.tick(1, 0)


def test_a_lost_worker_keeps_its_clock_and_can_no_longer_push():
    clock = SSPClock(3, max_staleness=1)
    for c in range(2):
        clock.tick(0, c)
    clock.lose(1, "disconnected")
    assert clock.active() == [0, 1, 2]  # lost is not finished: it still counts for the bound
    assert clock.min_clock() == 0 and clock.staleness(2) == 2 and not clock.can_read(2)
    assert clock.blockers(2) == [1, 2]  # slowest first, ties by rank
    with pytest.raises(WireError, match="rank 1, which has left"):
        clock.tick(1, 0)
    assert clock.clocks == [2, 0, 0]
    clock.lose(1, "a second reason")
    assert clock.lost == {1: "disconnected"}  # the first reason is the one reported


def test_a_finished_worker_is_never_marked_lost_and_the_rest_set_the_pace():
    clock = SSPClock(3, max_staleness=1)
    clock.tick(2, 0)
    clock.finish(0)
    clock.lose(0, "its connection closed after BYE")
    assert clock.lost == {}
    with pytest.raises(WireError, match="rank 0, which has left"):
        clock.tick(0, 0)
    assert clock.active() == [1, 2] and clock.min_clock() == 0
    assert clock.staleness(2) == 2 and clock.blockers(2) == [1]
    clock.tick(1, 0)
    assert clock.can_read(2) and clock.staleness(2) == 1


def test_staleness_is_never_negative_and_no_bound_never_blocks():
    clock = SSPClock(2, max_staleness=0)
    for rank in range(2):
        clock.tick(rank, 0)
    assert clock.staleness(0) == 0 and clock.can_read(0)  # a reader behind the slowest
    free = SSPClock(2, max_staleness=None)
    free.tick(0, 0)
    free.lose(1, "gone")
    assert free.can_read(1) and free.blockers(1) == []


def test_one_worker_never_waits_for_anyone():
    clock = SSPClock(1, max_staleness=0)
    for c in range(3):
        assert clock.can_read(c)
        clock.tick(0, c)
    assert clock.min_clock() == 3 and clock.staleness(3) == 0
