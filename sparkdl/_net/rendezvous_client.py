"""A rank's handle on the rendezvous store (:mod:`sparkdl._net.rendezvous_store`): the
``torch.distributed.Store`` gloo and NCCL rendezvous through, over the store's wire protocol
(:mod:`sparkdl._net.rendezvous_wire`), admitted only with the job's secret."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from sparkdl._net.frames import HandshakeFailed, connect_retrying
from sparkdl._net.rendezvous_store import (
    MAX_CLIENT_CONNECTIONS,
    MAX_HANDSHAKE_S,
    Key,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    Value,
    _bytes,
    _key,
)
from sparkdl._net.rendezvous_wire import (  # the protocol
    BLOCKING,
    I64,
    MAX_FRAME_BYTES,
    MAX_ITEMS,
    REPLY_ITEMS,
    Framing,
    Message,
    Op,
    Status,
    WireError,
    client_handshake,
    decode,
    encode,
    store_key,
)
from sparkdl._net.server import (
    checked_secret,
    close_quietly,
    shutdown_quietly,
)

__all__ = ["StoreClient"]

logger = logging.getLogger("sparkdl.rendezvous")


class StoreClient(dist.Store):
    """A rank's handle on the store, for ``init_process_group(store=...)``, gloo and NCCL.

    Thread-safe (one connection per concurrent caller, :data:`MAX_CLIENT_CONNECTIONS` at most).
    Calls without a timeout use the store's (``set_timeout``). torch keeps only the C++ half of
    a Python store: keep a reference while a process group may use it.
    """

    def __init__(
        self,
        address: Tuple[str, int],
        secret: bytes,
        rank: int,
        timeout: datetime.timedelta,
        encrypt: bool = False,
        served_by: str = "rank 0",
    ) -> None:
        """Connects and authenticates.

        Args:
            address: the server's ``(host, port)``.
            secret: the per-job secret.
            rank: this rank (the server logs it).
            timeout: the store's timeout: the default for blocking calls, the bound on the
                others (on connecting and the handshake: at most 30 s). Zero: no limit.
            encrypt: encrypt every frame (else only authenticate it); the server must agree.

        Raises:
            StoreUnavailableError: unreachable, or the handshake failed (wrong secret).
        """
        super().__init__()
        self.set_timeout(timeout)
        self.address, self.rank = (str(address[0]), int(address[1])), int(rank)
        self.served_by = served_by  # where the server runs, for messages: "rank 0" or "the driver"
        self._secret, self._key, self._encrypt = checked_secret(secret), store_key(secret), encrypt
        self._pool = threading.Condition()
        self._idle: List[Tuple[socket.socket, Framing]] = []
        self._busy: Set[Tuple[socket.socket, Framing]] = set()
        self._slots = 0  # connections open or being opened
        self._clones: List[StoreClient] = []
        self._closed = False
        self._release(self._acquire(), healthy=True)

    def _bound_s(self) -> Optional[float]:
        return self.timeout.total_seconds() or None

    def _connect(self) -> Tuple[socket.socket, Framing]:
        bound, where = min(self._bound_s() or MAX_HANDSHAKE_S, MAX_HANDSHAKE_S), f"{self.address[0]}:{self.address[1]}"

        def attempt(sock: socket.socket, deadline: float) -> Framing:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return Framing(sock, client_handshake(sock, self._key, self.rank, deadline, self._encrypt))

        try:
            return connect_retrying(self.address, bound, attempt, f"the rendezvous store on {self.served_by}")
        except (HandshakeFailed, WireError) as exc:  # HandshakeFailed names the store and its address
            raise StoreUnavailableError(
                f"rank {self.rank}: "
                + (
                    str(exc)
                    if isinstance(exc, HandshakeFailed)
                    else f"handshake with the rendezvous store at {where} failed: {exc}"
                )
            ) from exc
        except OSError as exc:
            raise StoreUnavailableError(
                f"rank {self.rank} cannot reach the rendezvous store on {self.served_by} at {where}: {exc}"
            ) from exc

    def _closed_error(self) -> StoreError:
        return StoreError(
            f"rank {self.rank}: the rendezvous store client is closed (the job's process group was torn down)"
        )

    def _acquire(self) -> Tuple[socket.socket, Framing]:
        with self._pool:
            while not self._idle and self._slots >= MAX_CLIENT_CONNECTIONS and not self._closed:
                self._pool.wait()
            if self._closed:
                raise self._closed_error()
            if self._idle:
                self._busy.add(self._idle[-1])
                return self._idle.pop()
            self._slots += 1
        try:
            connection = self._connect()
        except BaseException:
            self._release(None, healthy=False)
            raise
        with self._pool:
            self._busy.add(connection)
        return connection

    def _release(self, connection: Optional[Tuple[socket.socket, Framing]], healthy: bool) -> None:
        with self._pool:
            self._busy.discard(connection)
            if connection is not None and healthy and not self._closed:
                self._idle.append(connection)
            else:
                self._slots -= 1
                if connection is not None:
                    close_quietly(connection[0])
            self._pool.notify()

    def _call(self, op: Op, items: Sequence[bytes], wait: Optional[datetime.timedelta] = None) -> Tuple[bytes, ...]:
        """One request and its reply; ``wait``: how long a blocking op may wait (0: no limit)."""
        timeout_ms = 0 if wait is None else min(max(int(wait.total_seconds() * 1000), 0), (1 << 32) - 1)
        if len(items) > MAX_ITEMS:
            raise StoreError(
                f"rendezvous store: a {op.name} request of {len(items)} items exceeds the limit of {MAX_ITEMS}"
            )
        body = encode(Message(op, Status.OK, tuple(items), timeout_ms))
        if len(body) > MAX_FRAME_BYTES:
            raise StoreError(
                f"rendezvous store: a {op.name} request of {len(body)} bytes exceeds the limit of {MAX_FRAME_BYTES}"
            )
        bound = self._bound_s()
        if op in BLOCKING:  # the server answers TIMEOUT at timeout_ms; the margin lets that win
            bound = None if not timeout_ms else timeout_ms / 1000 + max(10.0, timeout_ms / 10000)
        connection = self._acquire()
        healthy = False
        try:
            connection[1].send(body, self._bound_s())
            reply_body = connection[1].recv(None if bound is None else time.monotonic() + bound)
            if reply_body is None:
                raise ConnectionAbortedError("the store closed the connection")
            reply = decode(reply_body)
            want = 1 if reply.status != Status.OK else len(items) if op == Op.MULTI_GET else REPLY_ITEMS.get(op, 0)
            if (
                reply.op != op
                or len(reply.items) != want
                or (op in (Op.ADD, Op.NUM_KEYS) and reply.status == Status.OK and len(reply.items[0]) != 8)
            ):
                raise WireError(f"malformed reply to {op.name}")
            healthy = True
        except (WireError, OSError) as exc:
            if self._closed:
                raise StoreError(f"rank {self.rank}: the rendezvous store client was closed during {op.name}") from exc
            raise StoreUnavailableError(
                f"rank {self.rank} lost the rendezvous store at {self.address[0]}:{self.address[1]} during {op.name} ({exc}); "
                f"it runs on {self.served_by}, which has probably failed or ended the job: see its error"
            ) from exc
        finally:
            self._release(connection, healthy)
        if reply.status == Status.OK:
            return reply.items
        text = reply.items[0].decode("utf-8", "replace")
        if reply.status == Status.TIMEOUT:
            raise StoreTimeoutError(
                f"rank {self.rank}: rendezvous store {op.name} {text} (the ranks that set them did not get there in time)"
            )
        raise StoreError(f"rank {self.rank}: rendezvous store refused {op.name}: {text}")

    def close(self) -> None:
        """Closes every connection, and the clones'; later calls raise StoreError. Idempotent."""
        with self._pool:
            if self._closed:
                return
            self._closed = True
            idle, busy, clones = self._idle, list(self._busy), self._clones
            self._idle, self._clones = [], []
            self._slots -= len(idle)
            self._pool.notify_all()
        for sock, _ in idle:
            close_quietly(sock)
        for sock, _ in busy:  # its caller closes it once woken: no descriptor reused under it
            shutdown_quietly(sock)
        for clone in clones:
            clone.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # torch.distributed.Store. C++ calls deleteKey and getNumKeys by those names: aliases.

    def set(self, key: Key, value: Value) -> None:
        self._call(Op.SET, (_key(key), _bytes(value)))

    def get(self, key: Key) -> bytes:
        """Waits for ``key`` (the store's timeout), like TCPStore, and returns its value."""
        return self._call(Op.GET, (_key(key),), self.timeout)[0]

    def add(self, key: Key, value: int) -> int:
        return I64.unpack(self._call(Op.ADD, (_key(key), I64.pack(int(value))))[0])[0]

    def check(self, keys: Sequence[Key]) -> bool:
        return self._call(Op.CHECK, [_key(key) for key in keys])[0] == b"\x01"

    def wait(self, keys: Sequence[Key], timeout: Optional[datetime.timedelta] = None) -> None:
        """Until every key exists; StoreTimeoutError (a RuntimeError, as torch's store-based
        barrier expects) names the missing ones."""
        self._call(Op.WAIT, [_key(key) for key in keys], self.timeout if timeout is None else timeout)

    def compare_set(self, key: Key, expected_value: Value, desired_value: Value) -> bytes:
        return self._call(Op.COMPARE_SET, (_key(key), _bytes(expected_value), _bytes(desired_value)))[0]

    def delete_key(self, key: Key) -> bool:
        return self._call(Op.DELETE, (_key(key),))[0] == b"\x01"

    def num_keys(self) -> int:
        return I64.unpack(self._call(Op.NUM_KEYS, ())[0])[0]

    deleteKey, getNumKeys = delete_key, num_keys

    def multi_get(self, keys: Sequence[Key]) -> List[bytes]:
        """Waits for every key (the store's timeout); their values in order."""
        return list(self._call(Op.MULTI_GET, [_key(key) for key in keys], self.timeout))

    def multi_set(self, keys: Sequence[Key], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise StoreError(f"multi_set with {len(keys)} keys and {len(values)} values")
        self._call(Op.MULTI_SET, [part for key, value in zip(keys, values) for part in (_key(key), _bytes(value))])

    def append(self, key: Key, value: Value) -> None:
        self._call(Op.APPEND, (_key(key), _bytes(value)))

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "StoreClient":
        """Another client of the store (torch clones a group's store to split or shrink it);
        kept by this one, and closed with it."""
        twin = StoreClient(self.address, self._secret, self.rank, self.timeout, self._encrypt, self.served_by)
        with self._pool:
            if not self._closed:
                self._clones.append(twin)
                return twin
        twin.close()
        raise self._closed_error()
