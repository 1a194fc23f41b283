"""The rendezvous store: the key-value store ``torch.distributed`` rendezvouses through, ours.

torch's ``TCPStore`` listens on every interface, answers anyone and accepts their writes, and
lives as long as something holds a process group using it (DDP does, in a reused Python worker).
Instead the driver runs a :class:`StoreServer` per launch on its channel address only (rank 0 on
its own task address, for launchers without a driver); every rank talks to it through a
:class:`~sparkdl._net.rendezvous_client.StoreClient` (a ``torch.distributed.Store`` gloo and NCCL use like any other); the launch
closes the server, :func:`sparkdl._runtime.rendezvous.teardown` the clients.

The protocol (HMAC-SHA256 handshake keyed from the per-job secret, length-prefixed frames) is
in :mod:`sparkdl._net.rendezvous_wire`; a full store (:data:`MAX_STORE_BYTES`, :data:`MAX_STORE_KEYS`)
refuses writes. The driver also publishes notices to every rank here (:meth:`StoreServer.publish`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Dict, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from sparkdl._net.rendezvous_wire import (  # the protocol
    HEADER,
    I64,
    MAX_FRAME_BYTES,
    MAX_KEY_BYTES,
    MAX_TEXT_BYTES,
    MAX_VALUE_BYTES,
    REQUEST_ITEMS,
    U32,
    Framing,
    Message,
    Op,
    Status,
    WireError,
    decode,
    encode,
    server_handshake,
    store_key,
)
from sparkdl._net.server import (
    HANDSHAKE_S,
    MAX_PENDING_HANDSHAKES,
    ThreadedServer,
)
from sparkdl.errors import PeerLostError

__all__ = ["StoreError", "StoreServer", "StoreTimeoutError", "StoreUnavailableError"]

logger = logging.getLogger("sparkdl.rendezvous")

MAX_STORE_BYTES, MAX_STORE_KEYS = 64 << 20, 1 << 16  # all authenticated peers can make us hold
MAX_HANDSHAKE_S = 30.0  #: a client's bound on connecting and its handshake (retried meanwhile)
MAX_CLIENT_CONNECTIONS = 8  #: per client, one per concurrent caller: a blocked ``wait`` holds up no ``check``


class StoreError(dist.DistStoreError):
    """The store refused a request or is closed (a ``DistStoreError``, so a ``RuntimeError``)."""


class StoreUnavailableError(StoreError, PeerLostError):
    """Unreachable, failed handshake or broken connection: the store's process (the driver, or
    rank 0) ended or failed, usually a consequence, not a cause."""


class StoreTimeoutError(StoreError, PeerLostError):
    """A blocking call ran out of time; the message names the keys still missing."""


def _names(keys: Sequence[bytes]) -> str:
    shown = ", ".join(repr(key.decode("utf-8", "replace")) for key in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


Key = Union[str, bytes]
Value = Union[bytes, bytearray, memoryview, str]


def _bytes(value: Value) -> bytes:
    # C++ hands values as bytes; Python callers (torch's store-based barrier) pass str too.
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def _key(key: Key) -> bytes:
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if len(data) > MAX_KEY_BYTES:
        raise StoreError(f"rendezvous store: key of {len(data)} bytes exceeds the limit of {MAX_KEY_BYTES}")
    return data


class _Refused(Exception):
    """A well-formed request over a limit: answered with ERROR."""


class StoreServer(ThreadedServer):
    """Rank 0's store: bytes to bytes in memory, served to authenticated ranks, one thread per
    connection. Blocking requests wait on a condition; ``close()`` closes the listener, wakes
    every waiter and drops every connection."""

    def __init__(
        self,
        host: str,
        secret: bytes,
        timeout_s: float,
        handshake_timeout_s: Optional[float] = None,
        encrypt: bool = False,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        """Listens on ``(host, 0)``: that address only, the kernel picks the port.

        Args:
            host: the address to listen on (the driver's channel host, or rank 0's task address).
            secret: the per-job secret (the key is :func:`store_key` of it).
            timeout_s: bound on the rest of a request once it started, and on each reply.
            handshake_timeout_s: how long a new peer has to authenticate (``min(timeout_s, 5)``).
            encrypt: encrypt every frame (else only authenticate it); clients must agree.
            max_pending_handshakes: connections at most that have not authenticated yet.

        Raises:
            ValueError: an empty secret. OSError: ``host`` cannot be bound.
        """
        self._key = store_key(secret)
        self._timeout_s = float(timeout_s)
        self._handshake_s = (
            min(self._timeout_s, HANDSHAKE_S) if handshake_timeout_s is None else float(handshake_timeout_s)
        )
        self._encrypt = encrypt
        self._data: Dict[bytes, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        #: Requests waiting for keys right now (GET, WAIT, MULTI_GET).
        self.blocked_requests = 0
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, 0), family=family, backlog=128)
        self.address: Tuple[str, int] = listener.getsockname()[:2]
        super().__init__(listener, "sparkdl-rendezvous", logger, max_pending_handshakes=max_pending_handshakes)

    @property
    def port(self) -> int:
        return self.address[1]

    def close(self) -> None:
        """Closes the listener and every connection, waking blocked waits. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        super().close()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        rank: Optional[int] = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._handshake_s)
            try:
                session = server_handshake(
                    conn, self._key, time.monotonic() + self._handshake_s, self._encrypt, self._authenticated
                )
            except TimeoutError:
                raise WireError(f"handshake not completed within {self._handshake_s:g}s") from None
            rank = session.client_rank
            frames = Framing(conn, session)
            while (body := frames.recv(None, idle_s=self._timeout_s)) is not None:
                reply = self._answer(decode(body))
                if reply is None:  # closing while the request waited
                    break
                frames.send(encode(reply), self._timeout_s)
        except (WireError, OSError, ValueError) as exc:  # TimeoutError is an OSError
            if not self._closed.is_set():
                who = "unauthenticated peer" if rank is None else f"rank {rank}"
                self._log_drop(
                    peer, exc, "rendezvous store: dropping %s (%s): %s", who, peer, exc, authenticated=rank is not None
                )
        finally:
            self._forget_connection(conn)
            self._release()

    def _answer(self, request: Message) -> Optional[Message]:
        op, items = Op(request.op), request.items
        want = REQUEST_ITEMS.get(op)
        if (
            request.status != Status.OK
            or (want is not None and len(items) != want)
            or (op == Op.MULTI_SET and len(items) % 2)
        ):
            raise WireError(f"malformed {op.name} request ({len(items)} items, status {request.status})")
        keys = items[0::2] if op == Op.MULTI_SET else items if op in (Op.CHECK, Op.WAIT, Op.MULTI_GET) else items[:1]
        try:
            if any(len(key) > MAX_KEY_BYTES for key in keys):
                raise _Refused(f"a key exceeds the limit of {MAX_KEY_BYTES} bytes")
            with self._cond:
                out = self._apply(op, items, keys, request.timeout_ms / 1000.0 if request.timeout_ms else None)
        except _Refused as exc:
            return Message(op, Status.ERROR, (str(exc).encode(),))
        except TimeoutError as exc:
            return Message(op, Status.TIMEOUT, (str(exc).encode("utf-8", "replace")[:MAX_TEXT_BYTES],))
        return None if out is None else Message(op, Status.OK, tuple(out))

    def _apply(
        self, op: Op, items: Sequence[bytes], keys: Sequence[bytes], timeout_s: Optional[float]
    ) -> Optional[Sequence[bytes]]:
        """Serves one request, under the condition; None when the server closes meanwhile."""
        data = self._data
        if op in (Op.SET, Op.MULTI_SET):
            if any(len(value) > MAX_VALUE_BYTES for value in items[1::2]):  # all or nothing
                raise _Refused(f"a value exceeds the limit of {MAX_VALUE_BYTES} bytes")
            for key, value in zip(items[0::2], items[1::2]):
                self._put(key, value)
            return ()
        if op == Op.APPEND:
            self._put(items[0], data.get(items[0], b"") + items[1])
            return ()
        if op == Op.ADD:
            if len(items[1]) != I64.size:
                raise WireError(f"ADD amount of {len(items[1])} bytes")
            try:
                value = int(data.get(items[0], b"0").decode("ascii")) + I64.unpack(items[1])[0]
            except (UnicodeDecodeError, ValueError):
                raise _Refused(f"ADD on {_names(keys)}, whose value is not an integer") from None
            if not -(1 << 63) <= value < (1 << 63):
                raise _Refused(f"ADD on {_names(keys)} overflows 64 bits")
            self._put(items[0], str(value).encode("ascii"))
            return (I64.pack(value),)
        if op == Op.CHECK:
            return (b"\x01" if all(key in data for key in keys) else b"\x00",)
        if op == Op.COMPARE_SET:
            key, expected, desired = items
            current = data.get(key)
            if current == expected or (current is None and not expected):
                self._put(key, desired)
                return (desired,)
            return (expected if current is None else current,)
        if op == Op.DELETE:
            old = data.pop(items[0], None)
            self._bytes -= 0 if old is None else len(items[0]) + len(old)
            return (b"\x00" if old is None else b"\x01",)
        if op == Op.NUM_KEYS:
            return (I64.pack(len(data)),)
        # GET, WAIT, MULTI_GET: until every key exists.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._stopping:
            missing = [key for key in keys if key not in data]
            if not missing:
                if op == Op.WAIT:
                    return ()
                values = [data[key] for key in keys]
                if sum(len(value) + U32.size for value in values) + HEADER.size > MAX_FRAME_BYTES:
                    raise _Refused(f"the values of {len(values)} keys do not fit in one frame")
                return values
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {_names(missing)}")
            self.blocked_requests += 1
            try:
                self._cond.wait(left)
            finally:
                self.blocked_requests -= 1
        return None

    def publish(self, key: Key, value: Value) -> None:  # the server's own process (the driver) tells every rank
        with self._cond:
            self._put(_key(key), _bytes(value))

    def _put(self, key: bytes, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise _Refused(f"value of {len(value)} bytes exceeds the limit of {MAX_VALUE_BYTES}")
        old = self._data.get(key)
        if old is None and len(self._data) >= MAX_STORE_KEYS:
            raise _Refused(f"the store is full ({MAX_STORE_KEYS} keys)")
        grown = self._bytes + len(value) - (len(old) if old is not None else -len(key))
        if grown > MAX_STORE_BYTES:
            raise _Refused(f"the store is full ({MAX_STORE_BYTES} bytes)")
        self._data[key], self._bytes = value, grown
        self._cond.notify_all()
