"""Keeps training frameworks (Lightning, Accelerate, plain DDP code) to one process per sparkdl task.

A sparkdl task is one rank of the job, already a torchrun "node" of one process (LOCAL_WORLD_SIZE=1).
A framework that starts processes of its own inside it (Lightning's ``ddp_spawn``/``ddp_notebook``
strategies, Accelerate's ``notebook_launcher``, ``torch.multiprocessing.spawn`` of DDP workers) would
start ranks nobody rendezvouses with: they bind fixed ports, join the wrong group or hang. Every such
launcher goes through ``torch.multiprocessing.start_processes``; while a task runs user code,
:func:`one_process_per_task` makes that call fail at once, naming the rank and the setting to change.
:func:`explain` adds the same rule to Lightning's own devices-times-nodes check, whose message
speaks of ``num_nodes`` without saying what a sparkdl task is.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from typing import Any, Callable, Dict, Iterator, Optional

from sparkdl.errors import ConfigError

_lock = threading.Lock()
_original: Optional[Callable[..., Any]] = None
_original_agent: Optional[Callable[..., Any]] = None
# The rank whose user code runs in this process now; None outside a task (the call passes through).
_active_rank: Optional[int] = None

_LIGHTNING_PRODUCT = re.compile(
    r"You set `devices=(?P<devices>[^`]*)` and `num_nodes=(?P<nodes>[^`]*)` in Lightning, but the product"
    r".*does not match the world size \((?P<world>\d+)\)",
    re.S,
)


class ProcessSpawnError(ConfigError):
    """A framework tried to start its own worker processes inside a sparkdl task."""


def _who() -> str:
    """Which framework's launcher made the call being guarded: the first Lightning or Accelerate
    frame on the stack (Accelerate goes through torch's elastic agent, so the target function
    alone does not tell)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith(("lightning", "pytorch_lightning", "lightning_fabric")):
            return "lightning"
        if module.startswith("accelerate"):
            return "accelerate"
        frame = frame.f_back
    return "torch"


def spawn_message(rank: int, world_size: Optional[int], nprocs: int, fn: Any) -> str:
    """The error for a ``start_processes(nprocs=...)`` call made inside rank ``rank``'s task."""
    world = f"WORLD_SIZE={world_size}" if world_size else "WORLD_SIZE"
    head = f"rank {rank}: "
    rule = f"but each sparkdl task is one process of the job (LOCAL_WORLD_SIZE=1, {world}, the run's num_workers): "
    who = _who()
    if who == "lightning":
        return (
            head + f"a Lightning strategy tried to start {nprocs} worker process(es) of its own (strategy='ddp_spawn', "
            "'ddp_notebook' or 'ddp_fork'; in a notebook, devices>1 picks 'ddp_notebook'), "
            + rule
            + f"use strategy='ddp', devices=1 and num_nodes={world_size or 'WORLD_SIZE'}: Lightning then joins the "
            "process group sparkdl started"
        )
    if who == "accelerate":
        return (
            head
            + f"Accelerate's notebook_launcher/debug_launcher tried to start {nprocs} worker process(es), "
            + rule
            + "call the training function directly in the task: Accelerator() joins the process group sparkdl "
            "started; scale with num_workers, not num_processes"
        )
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return (
        head + f"torch.multiprocessing.spawn/start_processes({name}, nprocs={nprocs}) was called inside a sparkdl "
        "task, " + rule + "run the worker's body directly with rank=RANK and world_size=WORLD_SIZE from the "
        "environment (sparkdl.run: the group exists already; sparkdl.launch: dist.init_process_group() joins it), "
        "and set num_workers to the number of ranks you want"
    )


def _guarded_start_processes(fn: Any, args: tuple = (), nprocs: int = 1, *rest: Any, **kwargs: Any) -> Any:
    rank = _active_rank
    if rank is None:
        assert _original is not None
        return _original(fn, args, nprocs, *rest, **kwargs)
    import os

    world = os.environ.get("WORLD_SIZE")
    raise ProcessSpawnError(spawn_message(rank, int(world) if world and world.isdigit() else None, nprocs, fn))


def _guarded_launch_agent(config: Any, entrypoint: Any, *args: Any, **kwargs: Any) -> Any:
    rank = _active_rank
    if rank is None:
        assert _original_agent is not None
        return _original_agent(config, entrypoint, *args, **kwargs)
    import os

    world = os.environ.get("WORLD_SIZE")
    nprocs = int(getattr(config, "nproc_per_node", 1) or 1)
    raise ProcessSpawnError(spawn_message(rank, int(world) if world and world.isdigit() else None, nprocs, entrypoint))


def _install() -> None:
    """Routes ``torch.multiprocessing.start_processes`` through the guard, once per process.

    Both names are replaced: ``torch.multiprocessing.spawn`` calls the module-level name of
    ``torch.multiprocessing.spawn``; Lightning looks up ``mp.start_processes`` at call time. The
    elastic agent's ``launch_agent`` is guarded too: Accelerate's ``notebook_launcher`` starts
    one (binding MASTER_PORT) before any process, and imports it inside the function, so it sees
    the guard. Outside a task the guards call the originals: a Python worker that Spark reuses
    keeps working as before.
    """
    global _original, _original_agent
    if _original is not None:
        return
    import torch.distributed.launcher.api as launcher_api
    import torch.multiprocessing  # noqa: F401  (loads torch.multiprocessing.spawn)

    spawn_module = sys.modules["torch.multiprocessing.spawn"]
    _original, _original_agent = spawn_module.start_processes, launcher_api.launch_agent
    spawn_module.start_processes = _guarded_start_processes  # type: ignore[attr-defined]
    sys.modules["torch.multiprocessing"].start_processes = _guarded_start_processes  # type: ignore[attr-defined]
    launcher_api.launch_agent = _guarded_launch_agent  # type: ignore[assignment]


def reset_framework_state() -> None:
    """Forgets Accelerate's process-wide state (a Borg shared by every ``Accelerator``).

    Spark reuses Python workers: without this, the next run's ``Accelerator()`` in the same
    worker would keep the previous run's world size and process group. Lightning keeps no such
    state. A no-op when Accelerate was never imported.
    """
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    with contextlib.suppress(Exception):  # a newer Accelerate without these: nothing to reset
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@contextlib.contextmanager
def one_process_per_task(rank: int) -> Iterator[None]:
    """While the block runs (the user's code in rank ``rank``'s task), starting worker processes
    through ``torch.multiprocessing.start_processes`` or torch's elastic agent raises
    :class:`ProcessSpawnError`; framework state left by an earlier task is cleared on entry and
    exit (:func:`reset_framework_state`).

    DataLoader workers and subprocesses are unaffected: they do not go through these.
    """
    global _active_rank
    with _lock:
        _install()
        previous, _active_rank = _active_rank, rank
    reset_framework_state()
    try:
        yield
    finally:
        reset_framework_state()
        with _lock:
            _active_rank = previous


def framework_env(world_size: int) -> Dict[str, str]:
    """Environment defaults that make a bare ``lightning.Trainer()`` train across the job.

    Without them ``Trainer()`` (devices="auto", num_nodes=1) picks a single-device strategy and
    every rank trains alone on its shard, silently. ``PL_TRAINER_*`` are Lightning's documented
    env defaults: explicit arguments still win (and ``devices=2`` still fails, through
    :func:`explain`). Fabric's ``LT_*`` variables are not set: they override explicit arguments.
    """
    return {"PL_TRAINER_NUM_NODES": str(world_size), "PL_TRAINER_DEVICES": "1"}


def explain(exc: BaseException, rank: int) -> BaseException:
    """``exc``, or a :class:`~sparkdl.errors.ConfigError` saying what to change when ``exc`` is a
    framework's complaint about more than one process per task (Lightning's devices*num_nodes !=
    WORLD_SIZE). The original stays the ``__cause__`` and its traceback is kept."""
    match = _LIGHTNING_PRODUCT.search(str(exc)) if isinstance(exc, ValueError) else None
    if match is None:
        return exc
    world = match.group("world")
    new = ConfigError(
        f"rank {rank}: Lightning was given devices={match.group('devices')} and num_nodes={match.group('nodes')}, "
        f"but each sparkdl task is one process (LOCAL_WORLD_SIZE=1) of WORLD_SIZE={world} (the run's num_workers): "
        f"use devices=1 and num_nodes={world}. Lightning said: {exc}"
    )
    new.__cause__ = exc
    return new.with_traceback(exc.__traceback__)
