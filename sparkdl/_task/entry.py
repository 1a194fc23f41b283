"""Task side of a launch: what each barrier task runs (:func:`_task_main`).

Connect to the driver's channel, prefix the task's output with its rank, set threads to the
task's cores, select the device Spark assigned (:mod:`sparkdl._runtime.device`), rendezvous, run the
function, report, clean up. Imported on the executors (the stage's closure refers to
:func:`_task_main`), so it needs nothing of the driver's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from sparkdl._net.channel import ChannelClient, ChannelError
from sparkdl._runtime.device import task_device
from sparkdl._spark import task_threads
from sparkdl._task.environment import environment, torchrun_environment
from sparkdl._task.output import forward_logs, output_to_driver, rank_prefixed_output
from sparkdl._task.script import ChildFailure, LaunchTarget, resolve_script, run_child
from sparkdl.checkpoint import CheckpointStore
from sparkdl.errors import RankFailure

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl._task.config import LaunchConfig
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
    checkpoint_store: Optional[CheckpointStore] = None
    attempt: int = 1
    #: Encrypt sparkdl's own connections (Spark encrypts its RPC; see sparkdl._net.policy).
    encrypt: bool = False
    #: The driver's rendezvous store for this launch, (host, port).
    rendezvous_address: Optional[tuple] = None
    #: The executor's console is the driver's (local mode), which shows the rank's output itself.
    quiet_console: bool = False
    #: Subnormal floats flushed to zero on this task's CPU (spark.sparkdl.flushDenormals).
    flush_denormals: bool = True


def _task_main(payload: _TaskPayload) -> List[tuple]:
    # Where a launch's start-up went, for run_info["startup"]: unpickling this task (before this
    # line) is what imports torch and sparkdl in a new Python worker.
    marks = {"worker_started": _process_started(), "task_entered": time.time()}
    from pyspark import BarrierTaskContext

    barrier = BarrierTaskContext.get()
    rank = barrier.partitionId()
    try:
        client = ChannelClient(
            tuple(payload.channel_address), payload.secret, rank, timeout=30.0, encrypt=payload.encrypt
        )
    except ChannelError as exc:
        # This rank cannot report anything: the message reaches the driver through Spark's job failure.
        host, port = payload.channel_address[0], payload.channel_address[1]
        raise ChannelError(
            f"rank {rank} on host {_task_host(barrier, rank)} cannot reach the driver's progress channel at {host}:{port} ({exc}). "
            f"Every executor must reach that address: it is spark.sparkdl.clientHost when set, else spark.driver.host (for a "
            f"Spark Connect client, the client's address on the route to the Connect server). Set spark.sparkdl.clientHost "
            f"to an address of the driver's or client's host that the executors can reach"
        ) from exc
    from sparkdl._runtime.liveness import Liveness
    from sparkdl._task.allocator import keep_step_memory

    # Before anything is allocated for training: a fresh worker would give every step's memory
    # back to the kernel and fault it in again (sparkdl._task.allocator).
    keep_step_memory()
    liveness = Liveness()
    heartbeat = _Heartbeat(client, liveness, payload.config.heartbeat_interval_s)
    # ``scopes`` closes after the finally block below: the device stays selected until the
    # process group is torn down, and is restored before the worker runs its next task.
    with (
        rank_prefixed_output(rank, payload.quiet_console),
        forward_logs(client, rank),
        _task_cpu(task_threads(barrier), payload.flush_denormals),
        contextlib.ExitStack() as scopes,
    ):
        context = None
        runtime = None
        try:
            from sparkdl._runtime.rendezvous import join_store, rendezvous, store_all_gather
            from sparkdl.context import TrainContext

            client.send(
                {
                    "kind": "started",
                    "attempt": payload.attempt,
                    "host": _task_host(barrier, rank),
                    "address": barrier.getTaskInfos()[rank].address.rsplit(":", 1)[0],
                }
            )
            heartbeat.start()
            config = payload.config
            launched = payload.train_fn if isinstance(payload.train_fn, LaunchTarget) else None
            host = barrier.getTaskInfos()[rank].address.rsplit(":", 1)[0]
            # A script this executor cannot see fails before anyone waits for this rank.
            script_path = (
                resolve_script(launched, rank, host) if launched is not None and launched.kind == "script" else None
            )
            liveness.advance("connecting to the rendezvous store")
            # Through the driver's store, not Spark's barrier: every allGather of Spark's costs a
            # second (it polls once a second), every store round trip a millisecond.
            rendezvous_client = join_store(
                payload.rendezvous_address, payload.secret, rank, config.timeout_s, payload.encrypt
            )
            heartbeat.watch_drain(rendezvous_client)
            gather = store_all_gather(rendezvous_client, rank, config.num_workers, config.timeout_s)
            liveness.advance("selecting the device")
            assignment = scopes.enter_context(task_device(barrier, config.use_gpu, gather))
            device = assignment.device
            liveness.advance("choosing the network interface")
            # gloo/NCCL otherwise bind what the host name resolves to (127.0.1.1 on Debian, or
            # another network): the collectives go where Spark reaches this executor.
            scopes.enter_context(
                environment(_collective_interface(host, payload.rendezvous_address[0], rank, device.type == "cuda"))
            )
            if launched is not None:
                # The child creates the process group itself (env://); this task makes none.
                value = _run_launched(launched, payload, rank, host, script_path, assignment, client, liveness)
                client.send({"kind": "done"})
                return [(rank, value if rank == 0 else None)]
            liveness.advance("rendezvous")
            addresses = [info.address for info in barrier.getTaskInfos()]
            env = rendezvous(
                rank,
                config.num_workers,
                addresses,
                gather,
                device,
                config.timeout_s,
                secret=payload.secret,
                encrypt=payload.encrypt,
                store_address=payload.rendezvous_address,
            )
            runtime = payload.strategy.create_runtime(env)
            marks["ready"] = time.time()
            context = TrainContext(
                env,
                runtime,
                client.send,
                dataset=payload.dataset,
                data_spec=payload.data_spec,
                reader=payload.reader,
                steps_per_epoch=payload.steps_per_epoch,
                store=payload.checkpoint_store,
                liveness=liveness,
                assignment=assignment,
                precision=payload.config.precision,
                resize=config.resize_plan(payload.data_spec.batch_size if payload.data_spec else None),
                startup_marks=marks,
            )
            context.set_phase("training")
            from sparkdl._task.frameworks import framework_env, one_process_per_task
            from sparkdl.reporting import CurrentTask, current_task

            # framework_env: a bare lightning.Trainer() then spans every task instead of training alone.
            task_env = {**_torchrun_env(payload, rank, None), **framework_env(config.num_workers)}
            with (
                environment(task_env),
                current_task(CurrentTask(rank, client.send, liveness.advance, context)),
                one_process_per_task(rank),
                output_to_driver(client),
            ):
                value = payload.train_fn(context)
            # A checkpoint still being written fails the rank here, reported like any error.
            context.wait_for_checkpoint()
            client.send({"kind": "done"})
            return [(rank, value if rank == 0 else None)]
        except BaseException as exc:
            from sparkdl._task.frameworks import explain

            # explain: a framework's own "devices x num_nodes" error, told in sparkdl's terms.
            failure = RankFailure.from_exception(
                rank, explain(exc, rank), phase=liveness.phase, host=_task_host(barrier, rank)
            )
            if isinstance(exc, ChildFailure):  # the child's error and traceback, not this task's
                failure = dataclasses.replace(failure, exc_type=exc.exc_type, traceback=exc.child_traceback)
            with contextlib.suppress(Exception):
                client.send({"kind": "error", "failure": failure.to_json()})
            raise
        finally:
            from sparkdl._runtime.rendezvous import teardown

            try:
                heartbeat.stop()
                if context is not None:
                    context.close()
                if runtime is not None:
                    with contextlib.suppress(Exception):
                        runtime.close()
            finally:
                # Even when closing the context failed: the process group and the rendezvous
                # store's connection (or, without a driver's store, rank 0's store) must not outlive the task.
                teardown()
                client.close()


def _collective_interface(host: str, driver_host: str, rank: int, gpu: bool) -> dict:
    """The interface variables gloo/NCCL read, for this rank (sparkdl._net.interfaces)."""
    from sparkdl._net.interfaces import collective_environment

    values, choice = collective_environment(host, driver_host, os.environ, rank, gpu)
    if choice is not None:
        logging.getLogger("sparkdl.network").debug(
            "rank %d: collectives on %s (%s): %s", rank, choice.name, choice.address, choice.reason
        )
    return values


def _task_host(barrier: Any, rank: int) -> str:
    """This task's executor address as Spark knows it, and the machine's own name."""
    import socket

    try:
        address = barrier.getTaskInfos()[rank].address.rsplit(":", 1)[0]
    except Exception:  # noqa: BLE001 - only a label for the error report
        address = ""
    name = socket.gethostname()
    return f"{name} ({address})" if address and address != name else name


def _torchrun_env(payload: _TaskPayload, rank: int, target: Optional[LaunchTarget]) -> dict:
    """torchrun's variables for this rank; MASTER_ADDR/PORT = the launch's rendezvous store."""
    run_id = target.run_id if target is not None else f"sparkdl-{payload.rendezvous_address[1]}"
    return torchrun_environment(
        rank,
        payload.config.num_workers,
        payload.rendezvous_address,
        run_id,
        payload.attempt - 1,
        payload.config.max_failures,
    )


def _run_launched(
    target: LaunchTarget,
    payload: _TaskPayload,
    rank: int,
    host: str,
    script_path: Optional[str],
    assignment: Any,
    client: ChannelClient,
    liveness: Any,
) -> Any:
    """``sparkdl.launch``: the target in a child process with the torchrun environment."""
    env = dict(os.environ)
    env.update(_torchrun_env(payload, rank, target))
    from sparkdl._task.frameworks import framework_env

    env.update(framework_env(payload.config.num_workers))
    # The child imports what this task imports (--py-files and addPyFile are on sys.path only here).
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry and os.path.exists(entry))
    env.update(PYTHONUNBUFFERED="1", SPARKDL_LAUNCHED="1")
    env.pop("SPARKDL_SHARD_DATA", None)
    if assignment.device_type == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = assignment.visible_devices  # LOCAL_RANK=0 is the task's GPU
    data = None
    if payload.dataset is not None:
        data = {
            "reader": payload.reader,
            "dataset": payload.dataset,
            "spec": payload.data_spec,
            "rank": rank,
            "world_size": payload.config.num_workers,
            "steps_per_epoch": payload.steps_per_epoch,
        }
    spec = {
        "store": list(payload.rendezvous_address),
        "encrypt": payload.encrypt,
        "rank": rank,
        "world_size": payload.config.num_workers,
    }
    liveness.advance(f"running {target.name}")
    return run_child(
        target,
        rank=rank,
        host=host,
        script_path=script_path,
        env=env,
        secret=payload.secret,
        spec=spec,
        data=data,
        send=client.send,
        advance=liveness.advance,
    )


def _process_started() -> Optional[float]:
    """Wall-clock time this process started (a Python worker Spark forked for a task), from
    Linux's /proc to the clock tick; None elsewhere."""
    try:
        with open("/proc/self/stat") as stat:
            # Field 22, after the command name (which may hold spaces): ticks since boot.
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class _Heartbeat:
    """Sends the rank's progress counter and phase to the driver's watchdog at a fixed rate."""

    def __init__(self, client: ChannelClient, liveness: Any, interval_s: float) -> None:
        self._client = client
        self._liveness = liveness
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-heartbeat", daemon=True)
        self._rendezvous: Any = None

    def watch_drain(self, rendezvous_client: Any) -> None:
        """From now on each beat also reads the driver's drain notice from the rendezvous store."""
        self._rendezvous = rendezvous_client

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._client.send({"kind": "heartbeat", **self._liveness.beat()})
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
            self._read_drain_notice()
            if self._stop.wait(self._interval_s):
                return

    def _read_drain_notice(self) -> None:
        from sparkdl._runtime.drain import DRAIN_KEY

        client, notice = self._rendezvous, self._liveness.drain
        if client is None or notice.requested():
            return
        try:
            if client.check([DRAIN_KEY]):
                notice.request(client.get(DRAIN_KEY).decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - a store gone with the driver is the channel's to report
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


@contextlib.contextmanager
def _task_cpu(cores: int, flush_denormals: bool):
    """The task's CPU settings, undone when it ends (Spark reuses the Python worker): torch and
    OpenMP threads = the task's cores (two ranks on a 2-core box each get one), and subnormal
    floats flushed to zero (:func:`sparkdl._task.config.flush_denormals`). The flush is a
    per-thread CPU flag that threads inherit when they are created: this thread's, and the
    threads the task creates (its OpenMP pool in a new worker, its decode threads)."""
    import torch

    cores = max(1, int(cores or 1))
    saved_env = os.environ.get("OMP_NUM_THREADS")
    saved_threads = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(cores)
    torch.set_num_threads(cores)
    flushing = flush_denormals and torch.set_flush_denormal(True)  # False where the CPU cannot
    try:
        yield
    finally:
        if flushing:
            torch.set_flush_denormal(False)  # Python workers start without it
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env
