"""The watchdog and Ctrl-C on a real cluster, through a real fit: the phase the fit loop was in
when a rank stalled, a relaunch the watchdog triggered, and an interrupted driver that cancels
the Spark job instead of leaving its tasks running.

Waits are on events: a FIFO the ranks write to (a blocking read), a pidfd that becomes readable
when a process exits, the driver's own exceptions."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import pytest
import torch

import sparkdl
from tests.integration.test_recovery import _estimator, _rank
from tests.models import accuracy

pytestmark = pytest.mark.spark

WAIT_S = 120.0  # bound on every wait below; the events come within seconds
STEPS = 1437 // 32  # one rank, batch_size=32: 44 steps per epoch
STALL_AT = STEPS + 5  # the loss's 49th call: step 5 of epoch 2, one step after the checkpoint at 48


def _join_checkpoint_writers() -> None:
    """The rank's part of the last checkpoint is stored, so the relaunch resumes from it for sure."""
    for thread in threading.enumerate():
        if thread.name.startswith("sparkdl-checkpoint"):
            thread.join()


class _StallOnce:
    """A cross-entropy loss that, at its ``at``-th call, blocks forever (a hung forward
    pass: no exception, heartbeats go on) — once per ``marker`` file, so the relaunch trains on."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker = marker
        self.at = at
        self.calls = 0

    def __call__(self, output, label):
        if _rank() < 0:  # the driver's preflight check of the loss (no process group there)
            return torch.nn.functional.cross_entropy(output, label)
        self.calls += 1
        if self.calls == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            _join_checkpoint_writers()
            threading.Event().wait()
        return torch.nn.functional.cross_entropy(output, label)


def test_a_rank_stalled_in_the_fit_loop_is_named_with_its_phase_and_the_relaunch_completes(
    spark, digits_df, digits_split, tmp_path
):
    """One rank, so the stalled rank is certain: with two, the other rank waits in the same step's
    gradient sync, and which of the two stood still first, as the driver's heartbeats saw it, is a
    race (on a loaded machine the waiting rank's heartbeats can be the older ones)."""
    stall = _StallOnce(str(tmp_path / "stalled-once"), at=STALL_AT)
    # watchdog_timeout_s=5: well above any legitimate pause of this small fit on a loaded 2-core
    # machine (a false alarm in the relaunch would fail it), and still a short test.
    model = _estimator(
        sparkdl.AllReduce(), str(tmp_path / "ckpt"), loss=stall, num_workers=1, epochs=2, watchdog_timeout_s=5
    ).fit(digits_df)

    first, second = model.run_info["attempts"]  # exactly two: the watchdog's failure, then the relaunch
    # The phase string the fit loop set for the step the rank hung in (steps count per epoch).
    assert first["error"].startswith(
        "training failed on rank 0 while training step 5 (forward, backward, sync, optimizer): WatchdogTimeout: "
        "rank 0 made no progress for "
    ), first
    assert "(watchdog_timeout_s=5)" in first["error"]
    assert second["error"] is None
    # The relaunch resumed from the checkpoint before the stall and trained to the end.
    assert model.run_info["steps"] == {"resumed_at": STEPS + 4, "run": STEPS - 4, "total": 2 * STEPS}
    assert [r["epoch"] for r in model.history] == [1, 2]
    _, (test_x, test_y) = digits_split
    assert accuracy(model.module, test_x, test_y) >= 0.85


# ------------------------------------------------------------------------ Ctrl-C


class _ReportPid:
    """A cross-entropy loss that, at its first call on a rank, writes ``<rank> <pid>`` to a FIFO."""

    def __init__(self, fifo: str) -> None:
        self.fifo = fifo
        self.reported = False

    def __call__(self, output, label):
        if not self.reported and _rank() >= 0:  # on a rank, not in the driver's preflight check
            self.reported = True
            with open(self.fifo, "w") as out:  # one short write: atomic on a pipe
                out.write(f"{_rank()} {os.getpid()}\n")
        return torch.nn.functional.cross_entropy(output, label)


def _read_pids(fd: int, count: int) -> dict:
    """Reads ``count`` ``<rank> <pid>`` lines from the FIFO, blocking (bounded) for each."""
    data = b""
    deadline = time.monotonic() + WAIT_S
    while data.count(b"\n") < count:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"the ranks did not start training within {WAIT_S:g}s (got {data!r})"
        data += os.read(fd, 4096)
    return {int(rank): int(pid) for rank, pid in (line.split() for line in data.decode().splitlines())}


def _wait_for_exit(pid: int) -> bool:
    """Whether process ``pid`` exited within WAIT_S: its pidfd turns readable when it does."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # already gone
    try:
        ready, _, _ = select.select([fd], [], [], WAIT_S)
        return bool(ready)
    finally:
        os.close(fd)


def test_ctrl_c_during_a_fit_cancels_the_spark_job(spark, digits_df, tmp_path, caplog):
    """A notebook user interrupts the kernel mid-fit: KeyboardInterrupt reaches them, and sparkdl
    cancels the job itself: Spark kills the ranks' tasks, and their processes end."""
    # Python's own handler: only KeyboardInterrupt, as under a Spark Connect client. (PySpark's,
    # installed with the SparkContext, would also cancel every job and hide sparkdl's part.)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    fifo = str(tmp_path / "pids")
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # read and write: never EOF while the ranks come and go
    tracker = spark.sparkContext.statusTracker()
    seen: dict = {}

    def interrupt_once_training() -> None:
        try:
            seen["pids"] = _read_pids(fd, 2)
            seen["stages"] = list(tracker.getActiveStageIds())
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: delivered to the main thread, in fit()

    interrupter = threading.Thread(target=interrupt_once_training, name="test-ctrl-c")
    estimator = _estimator(
        sparkdl.AllReduce(), None, loss=_ReportPid(fifo), epochs=10_000, max_failures=0, checkpoint_every=None
    )
    try:
        interrupter.start()
        with caplog.at_level("WARNING", logger="sparkdl"), pytest.raises(KeyboardInterrupt):
            estimator.fit(digits_df)
    finally:
        interrupter.join(WAIT_S)
        signal.signal(signal.SIGINT, previous)
        os.close(fd)
    pids = seen["pids"]
    assert sorted(pids) == [0, 1]
    # The killed ranks' hang-ups are the interrupt's doing, not reported as failures of theirs. (A
    # reported failure logs when its settle timer fires: wait for any such timer first.)
    for thread in threading.enumerate():
        if isinstance(thread, threading.Timer):
            thread.join(WAIT_S)
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    # The ranks' Python processes end (the tasks were killed), without waiting for the fit's epochs.
    for rank, pid in pids.items():
        assert _wait_for_exit(pid), f"rank {rank}'s process {pid} still runs {WAIT_S:g}s after Ctrl-C"
    # Cancelled, not failed: the barrier stage's one attempt ended with no failed task. (Without the
    # cancel, the ranks end their own processes once the driver's channel closes: a failed task.)
    # The stage's end has no Python-side event: poll the status tracker, bounded.
    (stage,) = seen["stages"]
    deadline = time.monotonic() + WAIT_S
    while stage in tracker.getActiveStageIds():
        assert time.monotonic() < deadline, "the training stage is still active"
        time.sleep(0.2)  # polling the scheduler's state, not synchronizing on it
    info = tracker.getStageInfo(stage)
    assert info is not None and (info.currentAttemptId, info.numFailedTasks) == (0, 0), info
    assert sparkdl.run(lambda ctx: ctx.rank, num_workers=2, spark=spark, progress=False) == 0  # the slots are free
