"""The driver-side job monitor: root cause, cancel, watchdog and slot watch — no Spark.

:class:`JobMonitor` is fed what the progress channel would feed it (messages and disconnects)
and calls the ``cancel`` it is given; these tests wait on that call (an Event) or on the
monitor's threads, never on a sleep.
"""

from __future__ import annotations

import threading
import time
from typing import List

import pytest

from sparkdl._driver import JobMonitor
from sparkdl._driver.monitor import _is_peer_loss
from sparkdl._driver.progress import ProgressDisplay
from sparkdl._driver.watchdog import AutoWatchdog
from sparkdl.errors import InsufficientSlotsError, PeerLostError, RankFailure, SparkdlError, TrainingError
from sparkdl.strategies.parameter_server import ParameterServerError

WAIT_S = 10.0  # bound on every wait below; the events come much sooner


class _Cancel:
    """The ``cancel`` callable: counts calls, remembers when, and sets an Event."""

    def __init__(self) -> None:
        self.calls: List[float] = []
        self.called = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.calls.append(time.monotonic())
        self.called.set()


def _monitor(num_workers: int, settle_s: float = 1.0):
    cancel = _Cancel()
    monitor = JobMonitor(num_workers, cancel, ProgressDisplay(enabled=False))
    monitor.settle_s = settle_s
    return monitor, cancel


def _start(monitor: JobMonitor, *ranks: int) -> None:
    for rank in ranks:
        monitor.on_message(rank, {"kind": "started", "attempt": 1})


def _error(monitor: JobMonitor, rank: int, exc: BaseException, phase: str = "training epoch 0") -> None:
    """What the task side sends for an exception (a JSON record; the rank is the sender's)."""
    monitor.on_message(rank, {"kind": "error", "failure": RankFailure.from_exception(rank, exc, phase=phase).to_json()})


def _join_timers() -> None:
    """Waits for every pending settle timer, so no cancel can still come after the assertions."""
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer) and thread is not threading.current_thread():
            thread.join(WAIT_S)
            assert not thread.is_alive()


# ------------------------------------------------------------------------ failures and cancel


def test_a_rank_error_cancels_exactly_once_after_settle_s():
    monitor, cancel = _monitor(2, settle_s=0.3)
    _start(monitor, 0, 1)
    reported = time.monotonic()
    _error(monitor, 1, ValueError("bad batch"))
    _error(monitor, 0, RuntimeError("something else"))  # a second failure starts no second timer
    assert cancel.called.wait(WAIT_S)
    assert cancel.calls[0] - reported >= 0.3
    monitor.cancel_now()  # what the driver calls once the job is over: already cancelled, no-op
    _join_timers()
    assert len(cancel.calls) == 1
    assert [(f.rank, f.exc_type) for f in monitor.failures] == [(1, "ValueError"), (0, "RuntimeError")]
    assert TrainingError(monitor.failures).rank == 1


def test_of_nan_losses_the_earliest_step_is_the_root_cause_and_lost_peers_come_last():
    from sparkdl.errors import NonFiniteLossError

    monitor, cancel = _monitor(3, settle_s=0.2)
    _start(monitor, 0, 1, 2)
    # NaN gradients of rank 2 reached the others through the sync; all notice at the same check.
    _error(monitor, 0, NonFiniteLossError("loss is nan at epoch 2, step 6 on rank 0: the data is not the cause"))
    _error(monitor, 1, PeerLostError("rank 2 is gone"))
    _error(monitor, 2, NonFiniteLossError("loss is nan at epoch 2, step 5 on rank 2: column 'x' holds NaN values"))
    assert cancel.called.wait(WAIT_S)
    _join_timers()
    assert [f.rank for f in monitor.failures] == [2, 0, 1]
    assert TrainingError(monitor.failures).rank == 2


def test_a_silent_disconnect_of_an_unfinished_rank_is_worker_lost_and_the_root_cause():
    monitor, cancel = _monitor(2)
    _start(monitor, 0, 1)
    monitor.on_message(0, {"kind": "heartbeat", "progress": 7, "phase": "training epoch 1"})
    # The survivor's torch/gloo error reaches the driver before the dead rank's socket closes.
    _error(monitor, 1, RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"))
    monitor.on_disconnect(0, clean=False)
    assert cancel.called.wait(WAIT_S)
    first = monitor.failures[0]
    assert (first.rank, first.exc_type, first.phase) == (0, "WorkerLost", "training epoch 1")
    assert "exited without reporting an error" in first.message
    assert [f.rank for f in monitor.failures] == [0, 1]
    assert str(TrainingError(monitor.failures)).startswith(
        "training failed on rank 0 while training epoch 1: WorkerLost"
    )
    _join_timers()
    assert len(cancel.calls) == 1


def test_a_peer_lost_error_then_a_silent_disconnect_names_the_dead_rank():
    monitor, cancel = _monitor(3)
    _start(monitor, 0, 1, 2)
    monitor.on_message(2, {"kind": "heartbeat", "progress": 3, "phase": "training epoch 0"})
    # A parameter-server complaint: a PeerLostError, whatever its message says.
    _error(monitor, 0, ParameterServerError("rank 0: the worker on rank 2 stopped answering", 2))
    assert monitor.failures[0].peer_loss
    monitor.on_disconnect(2, clean=False)
    assert cancel.called.wait(WAIT_S)
    error = TrainingError(monitor.failures)
    assert (error.rank, error.exc_type) == (2, "WorkerLost")
    assert "also rank 0: ParameterServerError" in str(error)


def test_disconnects_that_are_consequences_are_not_reported():
    monitor, cancel = _monitor(4, settle_s=0.05)
    _start(monitor, 0, 1, 2, 3)
    monitor.on_message(0, {"kind": "done"})
    monitor.on_disconnect(0, clean=False)  # finished first: its hang-up is not a loss
    monitor.on_disconnect(1, clean=True)  # hung up cleanly
    assert monitor.failures == []
    _error(monitor, 2, ValueError("bad batch"))  # a rank failed on its own...
    monitor.on_disconnect(3, clean=False)  # ...so Spark killing the others is a consequence
    assert cancel.called.wait(WAIT_S)
    assert [(f.rank, f.exc_type) for f in monitor.failures] == [(2, "ValueError")]


def test_wait_disconnected_returns_once_every_rank_hung_up():
    monitor, _ = _monitor(2)
    _start(monitor, 0, 1)
    waiter = threading.Thread(target=monitor.wait_disconnected, args=(WAIT_S,))
    waiter.start()
    monitor.on_disconnect(0, clean=True)
    monitor.on_disconnect(1, clean=True)
    waiter.join(WAIT_S)
    assert not waiter.is_alive()


# ------------------------------------------------------------------------ peer loss: class, not name


def test_peer_loss_is_recorded_from_the_exception_class_and_survives_json():
    record = RankFailure.from_exception(1, ParameterServerError("the parameter server on rank 1 is shutting down"))
    assert record.peer_loss and record.exc_type == "ParameterServerError"
    assert RankFailure.from_json(record.to_json()) == record

    class MyStrategyLostItsPeer(PeerLostError):
        pass

    assert RankFailure.from_exception(0, MyStrategyLostItsPeer("gone")).peer_loss
    assert not RankFailure.from_exception(0, ValueError("bad")).peer_loss
    assert issubclass(ParameterServerError, SparkdlError) and issubclass(ParameterServerError, RuntimeError)
    # A record from a task that sent no such field (and every driver-made one) is no peer loss.
    assert not RankFailure.from_json({"rank": 2, "exc_type": "RuntimeError", "message": "x"}).peer_loss


def test_is_peer_loss_uses_the_field_and_torch_messages_not_the_error_name():
    def record(exc_type: str, message: str, peer_loss: bool = False) -> RankFailure:
        return RankFailure(rank=1, exc_type=exc_type, message=message, traceback="", peer_loss=peer_loss)

    assert _is_peer_loss(
        record("ParameterServerError", "the parameter server on rank 0 is shutting down", peer_loss=True)
    )
    assert not _is_peer_loss(record("ParameterServerError", "the parameter server on rank 0 is shutting down"))
    assert _is_peer_loss(record("DistBackendError", "[gloo] Connection reset by peer"))
    assert _is_peer_loss(record("RuntimeError", "Broken pipe"))
    assert not _is_peer_loss(record("ValueError", "bad batch"))


# ------------------------------------------------------------------------ watchdog


def test_the_watchdog_fails_the_rank_whose_progress_stands_still_and_names_its_phase():
    monitor, cancel = _monitor(3, settle_s=0.05)
    _start(monitor, 2)
    monitor.on_message(2, {"kind": "done"})  # longest still, but finished: never a hang
    _start(monitor, 0, 1)
    monitor.on_message(1, {"kind": "heartbeat", "progress": 5, "phase": "rendezvous"})
    stop = threading.Event()

    def progressing_rank_0() -> None:
        step = 0
        while not stop.wait(0.02):  # a heartbeat every 20 ms, each with a new counter
            step += 1
            monitor.on_message(0, {"kind": "heartbeat", "progress": step, "phase": "training epoch 0"})

    feeder = threading.Thread(target=progressing_rank_0)
    watchdog = threading.Thread(target=monitor.watch, args=(0.5, stop))
    feeder.start()
    watchdog.start()
    try:
        assert cancel.called.wait(WAIT_S)
        watchdog.join(WAIT_S)
        assert not watchdog.is_alive()  # it reports one hang and stops
    finally:
        stop.set()
        feeder.join(WAIT_S)
    (failure,) = monitor.failures
    assert (failure.rank, failure.exc_type, failure.phase) == (1, "WatchdogTimeout", "rendezvous")
    assert "rank 1 made no progress for" in failure.message and "watchdog_timeout_s=0.5" in failure.message
    assert str(TrainingError(monitor.failures)).startswith(
        "training failed on rank 1 while rendezvous: WatchdogTimeout"
    )


def test_the_watchdog_clock_starts_when_the_last_rank_starts():
    """Rank 0 waits at the rendezvous while rank 1's task is slow to start: no hang of rank 0's.
    Once rank 1 started, rank 1 is the one that stands still, and is named."""
    monitor, cancel = _monitor(2, settle_s=0.05)
    _start(monitor, 0)
    monitor.on_message(0, {"kind": "heartbeat", "progress": 1, "phase": "connecting to the rendezvous store"})
    stop = threading.Event()
    watchdog = threading.Thread(target=monitor.watch, args=(0.3, stop))
    watchdog.start()
    try:
        # Twice the timeout with rank 0 standing still: the watchdog must not fire. An absence
        # has no event to wait on; the wait is the time that passes.
        assert not cancel.called.wait(0.6), monitor.failures
        _start(monitor, 1)
        monitor.on_message(1, {"kind": "heartbeat", "progress": 1, "phase": "rendezvous"})
        step = 1
        while not cancel.called.wait(0.02):  # rank 0 moves on; rank 1 stands still
            step += 1
            monitor.on_message(0, {"kind": "heartbeat", "progress": step, "phase": "training epoch 1"})
            assert step < WAIT_S / 0.02, "the watchdog never fired"
        watchdog.join(WAIT_S)
    finally:
        stop.set()
    (failure,) = monitor.failures
    assert (failure.rank, failure.exc_type, failure.phase) == (1, "WatchdogTimeout", "rendezvous")


def test_under_auto_a_rank_that_stops_inside_a_fast_step_is_named_after_the_step_bound_with_its_host():
    """Two ranks at a fast pace; rank 1 stops inside a step. The auto policy (its floor scaled
    down to 0.4 s for the test) names it after the step bound, not the phase bound, and says
    which figure it used. Before the warm-up's steps the phase bound holds."""
    monitor, cancel = _monitor(2, settle_s=0.05)
    for rank in (0, 1):
        monitor.on_message(rank, {"kind": "started", "attempt": 1, "host": f"host-{rank}"})
    policy = AutoWatchdog(warmup_steps=3, compute_floor_s=0.4, phase_s=WAIT_S * 10, check_every_s=0.05)

    def beat(rank: int, step: int) -> None:
        monitor.on_message(
            rank,
            {
                "kind": "heartbeat",
                "progress": step,
                "phase": f"training step {step}",
                "step_part": "compute",
                "steps": step,
                "slowest_load_s": 0.001,
                "slowest_compute_s": 0.01,
            },
        )

    beat(1, 5)  # rank 1's last step: it stands still from now on
    stop = threading.Event()
    watchdog = threading.Thread(target=monitor.watch, args=(policy, stop))
    watchdog.start()
    started = time.monotonic()
    try:
        step = 0
        while not cancel.called.wait(0.02):  # rank 0 moves on
            step += 1
            beat(0, step)
            assert step < WAIT_S / 0.02, "the watchdog never fired"
        watchdog.join(WAIT_S)
    finally:
        stop.set()
    (failure,) = monitor.failures
    assert (failure.rank, failure.exc_type, failure.host) == (1, "WatchdogTimeout", "host-1")
    assert failure.phase == "training step 5"
    assert failure.message.startswith("rank 1 made no progress for ")  # the error adds "ran on host host-1"
    assert "watchdog_timeout_s='auto': 10 x the slowest step's compute" in failure.message
    # Not before the warm-up: rank 0 reached 3 steps only after 3 of its heartbeats.
    assert 0.4 <= time.monotonic() - started < WAIT_S


def test_the_watchdog_stops_quietly_when_told_to():
    monitor, cancel = _monitor(1)
    _start(monitor, 0)
    stop = threading.Event()
    watchdog = threading.Thread(target=monitor.watch, args=(60.0, stop))
    watchdog.start()
    stop.set()
    watchdog.join(WAIT_S)
    assert not watchdog.is_alive()
    assert monitor.failures == [] and not cancel.called.is_set()


# ------------------------------------------------------------------------ slot watch (Connect)


def test_watch_start_cancels_when_fewer_ranks_than_num_workers_started():
    monitor, cancel = _monitor(3)
    _start(monitor, 0)
    monitor.watch_start(0.2, threading.Event())
    assert isinstance(monitor.slots_missing, InsufficientSlotsError)
    assert (
        "num_workers=3 needs 3 concurrent task slots, but 1 of the barrier stage's tasks started within slot_wait_s=0.2s"
        in str(monitor.slots_missing)
    )
    assert len(cancel.calls) == 1
    assert monitor.failures == []  # no rank failed: the launcher raises slots_missing instead
    monitor.cancel_now()  # the driver's call after the job ended: already cancelled
    assert len(cancel.calls) == 1


@pytest.mark.parametrize("late", [False, True])
def test_watch_start_does_nothing_when_every_rank_started(late):
    monitor, cancel = _monitor(2)
    _start(monitor, 0)
    if not late:
        _start(monitor, 1)
    watcher = threading.Thread(target=monitor.watch_start, args=(WAIT_S * 3, threading.Event()))
    begun = time.monotonic()
    watcher.start()
    if late:
        _start(monitor, 1)  # the last task starts during the wait: the watch ends then
    watcher.join(WAIT_S)
    assert not watcher.is_alive() and time.monotonic() - begun < WAIT_S
    assert monitor.slots_missing is None and not cancel.called.is_set()


def test_watch_start_stops_when_the_stage_ends_first():
    monitor, cancel = _monitor(2)
    stop = threading.Event()
    watcher = threading.Thread(target=monitor.watch_start, args=(WAIT_S * 3, stop))
    watcher.start()
    stop.set()
    watcher.join(WAIT_S)
    assert not watcher.is_alive()
    assert monitor.slots_missing is None and not cancel.called.is_set()


# ------------------------------------------------------------------------ lost hosts


def test_a_rank_that_goes_silent_is_a_lost_host_and_its_executors_are_dropped_first():
    monitor, cancel = _monitor(2, settle_s=0.05)
    monitor.on_message(0, {"kind": "started", "attempt": 1, "host": "h1 (198.18.0.2)", "address": "198.18.0.2"})
    monitor.on_message(1, {"kind": "started", "attempt": 1, "host": "h2 (198.18.0.3)", "address": "198.18.0.3"})
    stop = threading.Event()
    dropped = []

    def heartbeats_of_rank_0() -> None:  # rank 0 keeps talking, whatever its progress
        while not stop.wait(0.02):
            monitor.on_message(0, {"kind": "heartbeat", "progress": 0, "phase": "training step 3"})

    feeder = threading.Thread(target=heartbeats_of_rank_0)
    watcher = threading.Thread(
        target=monitor.watch_hosts, args=(0.5, stop, lambda address: dropped.append((address, len(monitor.failures))))
    )
    feeder.start()
    watcher.start()
    try:
        assert cancel.called.wait(WAIT_S)
        watcher.join(WAIT_S)
        assert not watcher.is_alive()
    finally:
        stop.set()
        feeder.join(WAIT_S)
    (failure,) = monitor.failures
    assert (failure.rank, failure.exc_type, failure.host) == (1, "HostLost", "h2 (198.18.0.3)")
    assert (
        "no word from rank 1 on host h2 (198.18.0.3)" in failure.message
        and "spark.sparkdl.hostTimeout=0.5s" in failure.message
    )
    # Spark was told to drop that host's executors before the failure was raised.
    assert dropped == [("198.18.0.3", 0)]
    assert "(rank 1 ran on host h2 (198.18.0.3))" in str(TrainingError(monitor.failures))


def test_finished_or_disconnected_ranks_are_never_lost_hosts():
    monitor, cancel = _monitor(2, settle_s=0.05)
    _start(monitor, 0, 1)
    monitor.on_message(0, {"kind": "done"})
    monitor.on_disconnect(1, clean=True)
    stop = threading.Event()
    watcher = threading.Thread(target=monitor.watch_hosts, args=(0.1, stop, lambda address: None))
    watcher.start()
    assert not cancel.called.wait(0.6)  # six timeouts' worth of silence: nothing
    stop.set()
    watcher.join(WAIT_S)
    assert monitor.failures == []
