"""The rendezvous store: the key-value store ``torch.distributed`` rendezvouses through, ours.

torch's ``TCPStore`` listens on every interface, answers anyone and accepts their writes, and
lives as long as something holds a process group using it (DDP does, in a reused Python worker).
Instead the driver runs a :class:`StoreServer` per launch on its channel address only (rank 0 on
its own task address, for launchers without a driver); every rank talks to it through a
:class:`StoreClient` (a ``torch.distributed.Store`` gloo and NCCL use like any other); the launch
closes the server, :func:`sparkdl._runtime.rendezvous.teardown` the clients.

The protocol (HMAC-SHA256 handshake keyed from the per-job secret, length-prefixed frames) is
in :mod:`sparkdl._net.rendezvous_wire`; a full store (:data:`MAX_STORE_BYTES`, :data:`MAX_STORE_KEYS`)
refuses writes. The driver also publishes notices to every rank here (:meth:`StoreServer.publish`).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import torch.distributed as dist

from sparkdl._net.rendezvous_wire import (  # the protocol
    BLOCKING, HEADER, I64, MAX_FRAME_BYTES, MAX_ITEMS, MAX_KEY_BYTES, MAX_TEXT_BYTES, MAX_VALUE_BYTES, REPLY_ITEMS, REQUEST_ITEMS, U32,
    Framing, Message, Op, Status, WireError, client_handshake, decode, encode, server_handshake, store_key,
)
from sparkdl._net.frames import HandshakeFailed, connect_retrying
from sparkdl._net.server import HANDSHAKE_S, MAX_PENDING_HANDSHAKES, ThreadedServer, checked_secret, close_quietly, shutdown_quietly
from sparkdl.errors import PeerLostError

__all__ = ["StoreClient", "StoreError", "StoreServer", "StoreTimeoutError", "StoreUnavailableError"]

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
        self._handshake_s = min(self._timeout_s, HANDSHAKE_S) if handshake_timeout_s is None else float(handshake_timeout_s)
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
                session = server_handshake(conn, self._key, time.monotonic() + self._handshake_s, self._encrypt, self._authenticated)
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
                self._log_drop(peer, exc, "rendezvous store: dropping %s (%s): %s", who, peer, exc, authenticated=rank is not None)
        finally:
            self._forget_connection(conn)
            self._release()

    def _answer(self, request: Message) -> Optional[Message]:
        op, items = Op(request.op), request.items
        want = REQUEST_ITEMS.get(op)
        if request.status != Status.OK or (want is not None and len(items) != want) or (op == Op.MULTI_SET and len(items) % 2):
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

    def _apply(self, op: Op, items: Sequence[bytes], keys: Sequence[bytes], timeout_s: Optional[float]) -> Optional[Sequence[bytes]]:
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


class StoreClient(dist.Store):
    """A rank's handle on the store, for ``init_process_group(store=...)``, gloo and NCCL.

    Thread-safe (one connection per concurrent caller, :data:`MAX_CLIENT_CONNECTIONS` at most).
    Calls without a timeout use the store's (``set_timeout``). torch keeps only the C++ half of
    a Python store: keep a reference while a process group may use it.
    """

    def __init__(self, address: Tuple[str, int], secret: bytes, rank: int, timeout: datetime.timedelta, encrypt: bool = False, served_by: str = "rank 0") -> None:
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
            raise StoreUnavailableError(f"rank {self.rank}: " + (str(exc) if isinstance(exc, HandshakeFailed) else f"handshake with the rendezvous store at {where} failed: {exc}")) from exc
        except OSError as exc:
            raise StoreUnavailableError(f"rank {self.rank} cannot reach the rendezvous store on {self.served_by} at {where}: {exc}") from exc

    def _closed_error(self) -> StoreError:
        return StoreError(f"rank {self.rank}: the rendezvous store client is closed (the job's process group was torn down)")

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
            raise StoreError(f"rendezvous store: a {op.name} request of {len(items)} items exceeds the limit of {MAX_ITEMS}")
        body = encode(Message(op, Status.OK, tuple(items), timeout_ms))
        if len(body) > MAX_FRAME_BYTES:
            raise StoreError(f"rendezvous store: a {op.name} request of {len(body)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
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
            if reply.op != op or len(reply.items) != want or (op in (Op.ADD, Op.NUM_KEYS) and reply.status == Status.OK and len(reply.items[0]) != 8):
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
            raise StoreTimeoutError(f"rank {self.rank}: rendezvous store {op.name} {text} (the ranks that set them did not get there in time)")
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
