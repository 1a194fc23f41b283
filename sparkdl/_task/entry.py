"""Task side of a launch: what each barrier task runs (:func:`_task_main`).

Connect to the driver's channel, prefix the task's output with its rank, set threads to the
task's cores, select the device Spark assigned (:mod:`sparkdl._runtime.device`), rendezvous, run the
function, report, clean up: the phases of :class:`_TaskRun`. Imported on the executors (the
stage's closure refers to :func:`_task_main`), so it needs nothing of the driver's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from sparkdl._net.channel import ChannelClient, ChannelError
from sparkdl._runtime.device import task_device
from sparkdl._spark import task_threads
from sparkdl._task.environment import environment, torchrun_environment
from sparkdl._task.heartbeat import Heartbeat
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
    """What each barrier task runs: the channel to the driver, the task's output and CPU
    settings around the phases of :class:`_TaskRun`, its error reported, its teardown."""
    # Where a launch's start-up went, for run_info["startup"]: unpickling this task (before this
    # line) is what imports torch and sparkdl in a new Python worker.
    marks = {"worker_started": _process_started(), "task_entered": time.time()}
    from pyspark import BarrierTaskContext

    barrier = BarrierTaskContext.get()
    rank = barrier.partitionId()
    client = _connect_to_driver(payload, barrier, rank)
    from sparkdl._task.allocator import keep_step_memory

    # Before anything is allocated for training: a fresh worker would give every step's memory
    # back to the kernel and fault it in again (sparkdl._task.allocator).
    keep_step_memory()
    task = _TaskRun(payload, barrier, rank, client, marks)
    # ``scopes`` closes after tear_down: the device stays selected until the process group is
    # torn down, and is restored before the worker runs its next task.
    with (
        rank_prefixed_output(rank, payload.quiet_console),
        forward_logs(client, rank),
        _task_cpu(task_threads(barrier), payload.flush_denormals),
        contextlib.ExitStack() as scopes,
    ):
        try:
            return task.run(scopes)
        except BaseException as exc:
            task.report_error(exc)
            raise
        finally:
            task.tear_down()


def _connect_to_driver(payload: _TaskPayload, barrier: Any, rank: int) -> ChannelClient:
    """The driver's progress channel, or an error naming the address every executor must reach."""
    try:
        return ChannelClient(
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


class _TaskRun:
    """One barrier task, phase by phase: report started, join the store, select the device, run
    the user's function (rendezvous, context, call) or the launched child, report the result or
    the error, tear down. Holds what the phases share and what the teardown must close."""

    def __init__(self, payload: _TaskPayload, barrier: Any, rank: int, client: ChannelClient, marks: dict) -> None:
        from sparkdl._runtime.liveness import Liveness

        self.payload, self.config, self.barrier, self.rank, self.client = payload, payload.config, barrier, rank, client
        self.marks = marks
        self.liveness = Liveness()
        self.heartbeat = Heartbeat(client, self.liveness, payload.config.heartbeat_interval_s)
        self.context: Any = None  # closed by tear_down once built
        self.runtime: Any = None

    def run(self, scopes: contextlib.ExitStack) -> List[tuple]:
        """The phases; ``[(rank, value)]`` with rank 0's value (the launch's result)."""
        host = self._report_started()
        payload = self.payload
        launched = payload.train_fn if isinstance(payload.train_fn, LaunchTarget) else None
        # A script this executor cannot see fails before anyone waits for this rank.
        script_path = (
            resolve_script(launched, self.rank, host) if launched is not None and launched.kind == "script" else None
        )
        gather = self._join_store()
        assignment = self._select_device(scopes, gather, host)
        if launched is not None:
            # The child creates the process group itself (env://); this task makes none.
            value = _run_launched(
                launched, payload, self.rank, host, script_path, assignment, self.client, self.liveness
            )
        else:
            value = self._run_function(self._build_context(gather, assignment))
        self.client.send({"kind": "done"})
        return [(self.rank, value if self.rank == 0 else None)]

    def _report_started(self) -> str:
        """Tells the driver this rank runs, and starts the heartbeat; the executor's address."""
        host = self.barrier.getTaskInfos()[self.rank].address.rsplit(":", 1)[0]
        self.client.send(
            {
                "kind": "started",
                "attempt": self.payload.attempt,
                "host": _task_host(self.barrier, self.rank),
                "address": host,
            }
        )
        self.heartbeat.start()
        return host

    def _join_store(self) -> Callable[[str], List[str]]:
        """Connects to the driver's rendezvous store; an all-gather of strings over it."""
        from sparkdl._runtime.rendezvous import join_store, store_all_gather

        payload, config = self.payload, self.config
        self.liveness.advance("connecting to the rendezvous store")
        # Through the driver's store, not Spark's barrier: every allGather of Spark's costs a
        # second (it polls once a second), every store round trip a millisecond.
        rendezvous_client = join_store(
            payload.rendezvous_address, payload.secret, self.rank, config.timeout_s, payload.encrypt
        )
        self.heartbeat.watch_drain(rendezvous_client)
        return store_all_gather(rendezvous_client, self.rank, config.num_workers, config.timeout_s)

    def _select_device(self, scopes: contextlib.ExitStack, gather: Callable, host: str) -> Any:
        """The device Spark assigned this task, and the network interface for its collectives."""
        self.liveness.advance("selecting the device")
        assignment = scopes.enter_context(task_device(self.barrier, self.config.use_gpu, gather))
        self.liveness.advance("choosing the network interface")
        # gloo/NCCL otherwise bind what the host name resolves to (127.0.1.1 on Debian, or
        # another network): the collectives go where Spark reaches this executor.
        gpu = assignment.device.type == "cuda"
        scopes.enter_context(
            environment(_collective_interface(host, self.payload.rendezvous_address[0], self.rank, gpu))
        )
        return assignment

    def _build_context(self, gather: Callable, assignment: Any) -> Any:
        """The process group (rendezvous), the strategy's runtime and the TrainContext over them."""
        from sparkdl._runtime.rendezvous import rendezvous
        from sparkdl.context import TrainContext

        payload, config = self.payload, self.config
        self.liveness.advance("rendezvous")
        addresses = [info.address for info in self.barrier.getTaskInfos()]
        env = rendezvous(
            self.rank,
            config.num_workers,
            addresses,
            gather,
            assignment.device,
            config.timeout_s,
            secret=payload.secret,
            encrypt=payload.encrypt,
            store_address=payload.rendezvous_address,
        )
        self.runtime = payload.strategy.create_runtime(env)
        self.marks["ready"] = time.time()
        self.context = TrainContext(
            env,
            self.runtime,
            self.client.send,
            dataset=payload.dataset,
            data_spec=payload.data_spec,
            reader=payload.reader,
            steps_per_epoch=payload.steps_per_epoch,
            store=payload.checkpoint_store,
            liveness=self.liveness,
            assignment=assignment,
            precision=config.precision,
            resize=config.resize_plan(payload.data_spec.batch_size if payload.data_spec else None),
            startup_marks=self.marks,
        )
        return self.context

    def _run_function(self, context: Any) -> Any:
        """The user's function (a fit's loop, or ``sparkdl.run``'s) on the context; its value."""
        from sparkdl._task.frameworks import framework_env, one_process_per_task
        from sparkdl.reporting import CurrentTask, current_task

        context.set_phase("training")
        # framework_env: a bare lightning.Trainer() then spans every task instead of training alone.
        task_env = {**_torchrun_env(self.payload, self.rank, None), **framework_env(self.config.num_workers)}
        with (
            environment(task_env),
            current_task(CurrentTask(self.rank, self.client.send, self.liveness.advance, context)),
            one_process_per_task(self.rank),
            output_to_driver(self.client),
        ):
            value = self.payload.train_fn(context)
        # A checkpoint still being written fails the rank here, reported like any error.
        context.wait_for_checkpoint()
        return value

    def report_error(self, exc: BaseException) -> None:
        """Sends the driver this rank's failure: its rank, host, phase and traceback."""
        from sparkdl._task.frameworks import explain
        from sparkdl._task.out_of_memory import explain_out_of_memory

        # explain: a framework's own "devices x num_nodes" error, told in sparkdl's terms; an
        # allocation failure, told with the memory limit it hit and what to change.
        told = explain_out_of_memory(explain(exc, self.rank), self.rank)
        failure = RankFailure.from_exception(
            self.rank, told, phase=self.liveness.phase, host=_task_host(self.barrier, self.rank)
        )
        if isinstance(exc, ChildFailure):  # the child's error and traceback, not this task's
            failure = dataclasses.replace(failure, exc_type=exc.exc_type, traceback=exc.child_traceback)
        with contextlib.suppress(Exception):
            self.client.send({"kind": "error", "failure": failure.to_json()})

    def tear_down(self) -> None:
        """Stops the heartbeat, closes the context and runtime, the process group and the channel."""
        from sparkdl._runtime.rendezvous import teardown

        try:
            self.heartbeat.stop()
            if self.context is not None:
                self.context.close()
            if self.runtime is not None:
                with contextlib.suppress(Exception):
                    self.runtime.close()
        finally:
            # Even when closing the context failed: the process group and the rendezvous
            # store's connection (or, without a driver's store, rank 0's store) must not outlive the task.
            teardown()
            self.client.close()


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
