"""Rendezvous: turns a barrier task into one rank of a torch.distributed process group."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this task sits in the job, and what strategies may use of the barrier stage.

    Attributes:
        peer_addresses: every task's ``host:port``, by rank (``BarrierTaskContext.getTaskInfos()``);
            empty outside a barrier task (tests build a DistEnv by hand).
        all_gather: the barrier's ``allGather`` (one string from every rank, in rank order; every
            rank must call it at the same point); None outside a barrier task. Strategies that
            need the barrier use these two instead of importing pyspark.
    """

    rank: int
    world_size: int
    device: torch.device
    backend: str
    master_addr: str
    master_port: int
    peer_addresses: Tuple[str, ...] = ()
    all_gather: Optional[Callable[[str], Sequence[str]]] = dataclasses.field(default=None, compare=False, repr=False)


def rendezvous(
    rank: int,
    world_size: int,
    task_addresses: Sequence[str],
    all_gather: Callable[[str], Sequence[str]],
    device: torch.device,
    timeout_s: float,
) -> DistEnv:
    """Creates the default process group of this job.

    Rank 0 opens the TCPStore on port 0 so the kernel picks a free port that is already bound —
    no pick-then-bind race (torch.elastic documents that race) — and ``all_gather`` (the barrier
    context's) hands the port to the others, which is also the barrier that orders the two.

    Args:
        rank: this task's rank (its barrier partition id).
        world_size: number of tasks.
        task_addresses: each task's ``host:port`` from ``BarrierTaskContext.getTaskInfos()``.
        all_gather: ``BarrierTaskContext.allGather``.
        device: the task's device; CUDA selects NCCL, anything else gloo.
        timeout_s: bound on store connection and on every collective.
    """
    host = task_addresses[0].rsplit(":", 1)[0]
    timeout = datetime.timedelta(seconds=timeout_s)
    store: Optional[dist.TCPStore] = None
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
        ports = all_gather(str(store.port))
    else:
        ports = all_gather("")
    port = int(ports[0])
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        device=device,
        backend=backend,
        master_addr=host,
        master_port=port,
        peer_addresses=tuple(task_addresses),
        all_gather=all_gather,
    )


def teardown() -> None:
    """Destroys the process group if this process has one (safe after failures)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group must not mask the original error
            pass
