"""Task side of a launch: what each barrier task runs (:func:`_task_main`).

Connect to the driver's channel, prefix the task's output with its rank, set threads to the
task's cores, select the device Spark assigned (:mod:`sparkdl._device`), rendezvous, run the
function, report, clean up. Imported on the executors (the stage's closure refers to
:func:`_task_main`), so it needs nothing of the driver's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from sparkdl._channel import ChannelClient, ChannelError
from sparkdl._device import task_device
from sparkdl.checkpoint import CheckpointStore
from sparkdl.errors import RankFailure

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl._launcher.config import LaunchConfig
    from sparkdl.data.batching import DataSpec
    from sparkdl.data.dataset import DatasetInfo
    from sparkdl.data.readers.base import DataReader
    from sparkdl.strategies.base import Strategy


@dataclasses.dataclass(frozen=True)
class _TaskPayload:
    """Everything a task needs; pickled once into the stage's closure."""

    train_fn: Callable[[Any], Any]
    strategy: Strategy
    config: LaunchConfig
    channel_address: tuple
    secret: bytes
    dataset: Optional[DatasetInfo]
    data_spec: Optional[DataSpec]
    reader: Optional[DataReader]
    steps_per_epoch: Optional[int]
    store: Optional[CheckpointStore] = None
    attempt: int = 1
    #: Encrypt sparkdl's own connections (Spark encrypts its RPC; see sparkdl._security).
    encrypt: bool = False
    #: The driver's rendezvous store for this launch, (host, port).
    store_address: Optional[tuple] = None


def _task_main(payload: _TaskPayload) -> List[tuple]:
    from pyspark import BarrierTaskContext

    barrier = BarrierTaskContext.get()
    rank = barrier.partitionId()
    client = ChannelClient(tuple(payload.channel_address), payload.secret, rank, timeout=30.0, encrypt=payload.encrypt)
    from sparkdl.context import Liveness

    liveness = Liveness()
    heartbeat = _Heartbeat(client, liveness, payload.config.heartbeat_interval_s)
    # ``scopes`` closes after the finally block below: the device stays selected until the
    # process group is torn down, and is restored before the worker runs its next task.
    with _rank_prefixed_output(rank), _forward_logs(client, rank), _task_threads(barrier.cpus()), contextlib.ExitStack() as scopes:
        context = None
        runtime = None
        try:
            from sparkdl._rendezvous import join_store, rendezvous, store_all_gather
            from sparkdl.context import TrainContext

            client.send({"kind": "started", "attempt": payload.attempt})
            heartbeat.start()
            config = payload.config
            liveness.advance("connecting to the rendezvous store")
            # Through the driver's store, not Spark's barrier: every allGather of Spark's costs a
            # second (it polls once a second), every store round trip a millisecond.
            store = join_store(payload.store_address, payload.secret, rank, config.timeout_s, payload.encrypt)
            gather = store_all_gather(store, rank, config.num_workers, config.timeout_s)
            liveness.advance("selecting the device")
            assignment = scopes.enter_context(task_device(barrier, config.use_gpu, gather))
            device = assignment.device
            liveness.advance("rendezvous")
            addresses = [info.address for info in barrier.getTaskInfos()]
            env = rendezvous(
                rank, config.num_workers, addresses, gather, device, config.timeout_s,
                secret=payload.secret, encrypt=payload.encrypt, store_address=payload.store_address,
            )
            runtime = payload.strategy.create_runtime(env)
            context = TrainContext(
                env,
                runtime,
                client.send,
                dataset=payload.dataset,
                data_spec=payload.data_spec,
                reader=payload.reader,
                steps_per_epoch=payload.steps_per_epoch,
                store=payload.store,
                liveness=liveness,
                assignment=assignment,
                precision=payload.config.precision,
            )
            context.set_phase("training")
            value = payload.train_fn(context)
            # A checkpoint still being written fails the rank here, reported like any error.
            context.wait_for_checkpoint()
            client.send({"kind": "done"})
            return [(rank, value if rank == 0 else None)]
        except BaseException as exc:
            failure = RankFailure.from_exception(rank, exc, phase=liveness.phase)
            with contextlib.suppress(Exception):
                client.send({"kind": "error", "failure": failure.to_json()})
            raise
        finally:
            from sparkdl._rendezvous import teardown

            try:
                heartbeat.stop()
                if context is not None:
                    context.close()
                if runtime is not None:
                    with contextlib.suppress(Exception):
                        runtime.close()
            finally:
                # Even when closing the context failed: the process group and the rendezvous
                # store (rank 0 listens) must not outlive the task.
                teardown()
                client.close()


class _Heartbeat:
    """Sends the rank's progress counter and phase to the driver's watchdog at a fixed rate."""

    def __init__(self, client: ChannelClient, liveness: Any, interval_s: float) -> None:
        self._client = client
        self._liveness = liveness
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._client.send({"kind": "heartbeat", "progress": self._liveness.progress, "phase": self._liveness.phase})
            except ChannelError:
                if self._stop.is_set():
                    return
                # The run's channel is gone: the driver (or Connect client) cancelled the run or
                # died. A rank blocked in user code would never notice, and a cancel does not
                # always kill a task stuck in Python (Spark Connect's interrupt does not), so the
                # rank ends its process rather than hold its task slot for good.
                sys.stderr.write("[sparkdl] the driver's channel closed while this rank was running: exiting\n")
                sys.stderr.flush()
                os._exit(70)
            if self._stop.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


@contextlib.contextmanager
def _task_threads(cores: int):
    """Torch and OpenMP threads = the task's cores: two ranks on a 2-core box each get one."""
    import torch

    cores = max(1, int(cores or 1))
    saved_env = os.environ.get("OMP_NUM_THREADS")
    saved_threads = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(cores)
    torch.set_num_threads(cores)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


class _PrefixedWriter(io.TextIOBase):
    """Prefixes every line with the rank, so interleaved executor logs stay readable."""

    def __init__(self, target: Any, prefix: str) -> None:
        self._target = target
        self._prefix = prefix
        self._at_line_start = True
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            out = []
            for piece in text.splitlines(keepends=True):
                if self._at_line_start:
                    out.append(self._prefix)
                out.append(piece)
                self._at_line_start = piece.endswith("\n")
            self._target.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._target.flush()


@contextlib.contextmanager
def _rank_prefixed_output(rank: int):
    saved = sys.stdout, sys.stderr
    sys.stdout = _PrefixedWriter(saved[0], f"[sparkdl rank {rank}] ")
    sys.stderr = _PrefixedWriter(saved[1], f"[sparkdl rank {rank}] ")
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved


class _ChannelLogHandler(logging.Handler):
    def __init__(self, client: ChannelClient) -> None:
        super().__init__(level=logging.INFO)
        self._client = client

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._client.send({"kind": "log", "level": record.levelno, "message": self.format(record)[:8000]})
        except Exception:  # noqa: BLE001 - logging must never fail the task
            pass


@contextlib.contextmanager
def _forward_logs(client: ChannelClient, rank: int):
    """Records of the ``sparkdl`` loggers go to the task's stderr and to the driver."""
    root = logging.getLogger("sparkdl")
    to_driver = _ChannelLogHandler(client)
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved_level, saved_propagate = root.level, root.propagate
    root.addHandler(to_driver)
    root.addHandler(to_stderr)
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(to_driver)
        root.removeHandler(to_stderr)
        root.setLevel(saved_level)
        root.propagate = saved_propagate
