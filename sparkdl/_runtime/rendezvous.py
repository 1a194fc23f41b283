"""Rendezvous: turns a barrier task into one rank of a torch.distributed process group."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import secrets
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparkdl._net.rendezvous_client import StoreClient
from sparkdl._net.rendezvous_store import StoreServer
from sparkdl.strategies.base import DistEnv


def rendezvous(
    rank: int,
    world_size: int,
    task_addresses: Sequence[str],
    all_gather: Optional[Callable[[str], Sequence[str]]],
    device: torch.device,
    timeout_s: float,
    secret: Optional[bytes] = None,
    encrypt: bool = False,
    store_address: Optional[Tuple[str, int]] = None,
) -> DistEnv:
    """Creates the default process group of this job, rendezvousing through sparkdl's store.

    With ``store_address`` (what the launcher does) the store is the driver's
    :class:`~sparkdl._net.rendezvous_store.StoreServer`, whose address every task already has: no Spark
    barrier round is needed (each ``allGather`` costs a second: Spark polls it once a second),
    and ``DistEnv.all_gather`` goes through the store too (:func:`store_all_gather`).
    Without one (launchers without a driver, tests), rank 0 starts the server on its own task
    address only, port 0 (the kernel picks a free port that is already bound: no pick-then-bind
    race), and ``all_gather`` hands its address to the others. Either way every rank talks to it
    through a :class:`~sparkdl._net.rendezvous_client.StoreClient` (admitted only with the job's secret), the
    store ``init_process_group`` gets; no rank returns before every rank is in the group.
    :func:`teardown` closes this process's part.

    Args:
        rank: this task's rank (its barrier partition id).
        world_size: number of tasks.
        task_addresses: each task's ``host:port`` from ``BarrierTaskContext.getTaskInfos()``.
        all_gather: ``BarrierTaskContext.allGather``; with ``store_address``, the task's
            :func:`store_all_gather` if it already gathered (its rounds go on), else None.
        device: the task's device; CUDA selects NCCL, anything else gloo.
        timeout_s: bound on store connection and on every collective.
        secret: the per-job secret every rank shares (the launcher's); may be omitted for a
            single rank only, which then gets a fresh random one.
        encrypt: encrypt the store's frames (they are authenticated either way), and tell the
            strategies to encrypt theirs (``DistEnv.encrypt``).
        store_address: the driver's store, (host, port).

    Raises:
        ValueError: no secret for more than one rank.
        OSError: rank 0 cannot listen on its task address.
        sparkdl._net.rendezvous_store.StoreError: the store cannot be reached or failed the handshake.
    """
    global _active
    if secret is None:
        if world_size != 1:
            raise ValueError("rendezvous of more than one rank needs the job's secret")
        secret = secrets.token_bytes(32)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        if store_address is not None:
            client = join_store(store_address, secret, rank, timeout_s, encrypt)
            gather = all_gather or store_all_gather(client, rank, world_size, timeout_s)
        else:
            client = _rank0_store(rank, task_addresses, all_gather, secret, timeout_s, encrypt)
            gather = all_gather
        dist.init_process_group(backend, store=client, rank=rank, world_size=world_size, timeout=timeout)
        # gloo's init returns on a rank as soon as its own side of every pair is connected; a
        # rank whose function then ends at once would tear the group down while a slower peer
        # still completes its connections (it fails with "Connection closed by peer"). No rank
        # leaves the rendezvous before every rank is in the group.
        _wait_for_every_rank(client, rank, world_size, timeout)
    except BaseException:
        _close_store()
        raise
    return DistEnv(
        rank=rank,
        world_size=world_size,
        device=device,
        backend=backend,
        master_addr=client.address[0],
        master_port=client.address[1],
        peer_addresses=tuple(task_addresses),
        all_gather=gather,
        encrypt=encrypt,
    )


def join_store(
    address: Tuple[str, int], secret: bytes, rank: int, timeout_s: float, encrypt: bool = False
) -> StoreClient:
    """This process's client of the store at ``address`` (the driver's): the one it already
    has for that address, else a new one (closing what an earlier task left behind)."""
    global _active
    address = (address[0], int(address[1]))
    if (
        _active is not None
        and _active.server is None
        and _active.client is not None
        and _active.client.address == address
        and not _active.client.closed
    ):
        return _active.client
    # A process runs one job's tasks at a time: a store an earlier one left (it never reached
    # its teardown) closes now, so that it does not keep listening.
    _close_store()
    client = StoreClient(
        address, secret, rank, datetime.timedelta(seconds=timeout_s), encrypt=encrypt, served_by="the driver"
    )
    _active = _Rendezvous(None, client)
    return client


def store_all_gather(client: StoreClient, rank: int, world_size: int, timeout_s: float) -> Callable[[str], List[str]]:
    """An ``allGather`` through the store: every rank's string in rank order, once all ranks
    called it (the n-th call of every rank pairs up, as with Spark's)."""
    rounds = itertools.count()
    timeout = datetime.timedelta(seconds=timeout_s)

    def all_gather(value: str) -> List[str]:
        prefix = f"{_GATHER_PREFIX}{next(rounds)}/"
        client.set(f"{prefix}{rank}", value.encode("utf-8"))
        keys = [f"{prefix}{peer}" for peer in range(world_size)]
        client.wait(keys, timeout)
        return [value.decode("utf-8") for value in client.multi_get(keys)]

    return all_gather


def _rank0_store(
    rank: int,
    task_addresses: Sequence[str],
    all_gather: Callable[[str], Sequence[str]],
    secret: bytes,
    timeout_s: float,
    encrypt: bool,
) -> StoreClient:
    """Without a driver's store: rank 0 serves one on its task address, ``all_gather`` tells
    the others where; returns this rank's client."""
    global _active
    _close_store()
    host = _host_of(task_addresses[0])
    server: Optional[StoreServer] = None
    if rank == 0:
        try:
            server = StoreServer(host, secret, timeout_s, encrypt=encrypt)
        except OSError as exc:
            raise OSError(
                exc.errno, f"rank 0 cannot listen for the rendezvous on its task address {host}: {exc.strerror or exc}"
            ) from exc
        _active = _Rendezvous(server, None)
        # The bound address, not the name: every rank then connects to the very address
        # rank 0 listens on, however each resolves the host name.
        published = all_gather(f"{server.address[0]} {server.port}")
    else:
        published = all_gather("")
    store_host, port_text = published[0].rsplit(" ", 1)
    client = StoreClient(
        (store_host, int(port_text)), secret, rank, datetime.timedelta(seconds=timeout_s), encrypt=encrypt
    )
    _active = _Rendezvous(server, client)
    return client


def _wait_for_every_rank(client: StoreClient, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """A barrier through the store (backend-agnostic: no device, no collective)."""
    client.set(f"{_JOINED_PREFIX}{rank}", b"1")
    client.wait([f"{_JOINED_PREFIX}{peer}" for peer in range(world_size)], timeout)


_JOINED_PREFIX = "sparkdl/joined/"
_GATHER_PREFIX = "sparkdl/gather/"


def _host_of(address: str) -> str:
    """The host of a ``host:port`` task address (``[v6]:port`` too)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclasses.dataclass
class _Rendezvous:
    """This process's store: the server if this rank serves it (rank 0 without a driver's
    store; None otherwise) and the rank's client. Held here,
    not by torch (which keeps only the C++ half of a Python store), until :func:`teardown`."""

    server: Optional[StoreServer]
    client: Optional[StoreClient]


_active: Optional[_Rendezvous] = None


def active_store() -> Optional[Tuple[Optional[StoreServer], Optional[StoreClient]]]:
    """This process's rendezvous store (server, client), or None outside a rendezvous."""
    state = _active
    return None if state is None else (state.server, state.client)


def teardown() -> None:
    """Destroys the process group if this process has one, then closes the rendezvous store:
    this rank's client connections and, on a rank that serves it, the server, listener included — whatever
    still refers to the store (a DDP module, a group) cannot keep it listening. Safe after
    failures and when called twice."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group must not mask the original error
            pass
    _close_store(drain_s=_DRAIN_S)


#: How long rank 0's store waits at teardown for the other ranks to hang up first.
_DRAIN_S = 5.0


def _close_store(drain_s: float = 0.0) -> None:
    global _active
    state, _active = _active, None
    if state is None:
        return
    for part in (state.client, state.server):
        if part is not None:
            try:
                if part is state.server and drain_s > 0:
                    part.wait_idle(drain_s)  # the other ranks hang up first: no reply is cut off
                part.close()
            except Exception:  # noqa: BLE001 - as above
                pass
