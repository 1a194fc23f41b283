"""Real multi-process gloo groups for the unit tests: the parent hosts the store, each spawned
rank joins it, runs a function and saves what it recorded; the parent returns every rank's."""

from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Any, Callable, List

TIMEOUT = datetime.timedelta(seconds=60)


def join_group(rank: int, port: int, world_size: int) -> None:
    """In a spawned rank: one thread, loopback only, the parent's store, a gloo group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)


def cpu_env(rank: int, port: int, world_size: int):
    """The DistEnv of a spawned CPU rank that joined the parent's store with :func:`join_group`."""
    import torch

    from sparkdl.strategies.base import DistEnv

    return DistEnv(
        rank=rank,
        world_size=world_size,
        device=torch.device("cpu"),
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=port,
    )


def save_results(results: Any, out_dir: str, rank: int) -> None:
    import torch

    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def exit_without_finalizing() -> None:
    """Ends a spawned rank's process once its results are saved and its groups destroyed, before
    the interpreter's finalization: there, torch's gloo objects abort the process now and then
    ("terminate called without an active exception", SIGABRT) although destroy_process_group has
    returned. Measured with test_sharded's ranks: 6 of 180 spawns aborted (in the one whose whole
    output was kept, after both ranks had said that their group was destroyed); 0 of 140 ending
    here. It failed CI in both stacks once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_rank(rank: int, worker: Callable[..., None], port: int, out_dir: str) -> None:
    """A spawned rank: the worker, then the group torn down here, once, for every worker.

    After a worker that returned, the ranks pass a barrier first: a rank that tore its group
    down (and exited) while its peer still finished its last collective left that peer's gloo
    thread with a closed connection, and an exception on a gloo thread aborts the process
    (SIGABRT, seen in CI). A gloo thread still running at exit aborts it too ("terminate called
    without an active exception"), hence the teardown before exit, and the exit without the
    interpreter's finalization. After a worker that raised, no barrier: its peer may be gone,
    and the worker's error is what matters (torch.multiprocessing records it)."""
    import torch.distributed as dist

    try:
        worker(rank, port, out_dir)
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_without_finalizing()


def spawn_ranks(worker: Callable[..., None], world_size: int, out_dir: str) -> List[Any]:
    """Runs ``worker(rank, port, out_dir)`` in ``world_size`` processes and returns what each
    saved with :func:`save_results`, by rank. The store listens on a kernel-chosen port (no
    pick-then-bind race) and stays open until the ranks are done."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    mp.spawn(_run_rank, args=(worker, store.port, str(out_dir)), nprocs=world_size, join=True)
    del store
    return [torch.load(os.path.join(str(out_dir), f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
