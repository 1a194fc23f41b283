"""Ranks for the benchmarks that run without Spark: one process per rank, pinned to a core,
joined in a real gloo group through sparkdl's own rendezvous store (as a task joins it)."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable, Dict, Optional, Tuple

#: (the store's address, the job's secret): what a rank needs to join; None for a lone rank.
Store = Optional[Tuple[Tuple[str, int], bytes]]


def join(rank: int, world_size: int, store: Store, core: int = -1):
    """In a rank's process: pins it to core ``core + rank`` (``core`` < 0: no pinning), one torch
    thread, and the gloo group (a lone rank's without a store). Returns the rank's DistEnv;
    ``sparkdl._runtime.rendezvous.teardown`` ends it."""
    import torch

    from sparkdl._runtime.rendezvous import rendezvous

    if core >= 0:
        os.sched_setaffinity(0, {(core + rank) % os.cpu_count()})
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    if store is None:
        return rendezvous(0, 1, ["127.0.0.1:0"], lambda value: [value], cpu, timeout_s=60)
    address, secret = store
    addresses = ["127.0.0.1:0"] * world_size
    return rendezvous(rank, world_size, addresses, None, cpu, timeout_s=60, secret=secret, store_address=address)


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any) -> Dict[int, Any]:
    """Runs ``target(rank, world_size, store, *args)`` in one spawned process per rank, beside a
    rendezvous store in this one, and returns what each returned, by rank. Every process is
    ended before this returns, also when a rank fails (its peers would wait in a collective)."""
    from sparkdl._net.channel import new_secret
    from sparkdl._net.rendezvous_store import StoreServer

    secret = new_secret()
    server = StoreServer("127.0.0.1", secret, 60.0)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_rank_process, args=(target, rank, world_size, (server.address, secret), args, results))
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        by_rank = dict(results.get(timeout=3600) for _ in processes)
        for process in processes:
            process.join(timeout=60)
        return by_rank
    finally:
        server.close()
        for process in processes:
            if process.is_alive():
                process.kill()


def _rank_process(target: Callable[..., Any], rank: int, world_size: int, store: Store, args: tuple, results) -> None:
    results.put((rank, target(rank, world_size, store, *args)))
