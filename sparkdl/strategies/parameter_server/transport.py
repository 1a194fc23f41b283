"""The parameter server's connections: one :class:`ShardServer` per rank, and each worker's
:class:`ShardClient` to every other rank's server.

What travels on them (the handshake, the frames) is described in
:mod:`sparkdl.strategies.parameter_server.wire`; what a server does with a request is its
:class:`Backend`'s business (the rank's shards).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Dict, Optional, Protocol, Sequence, Set, Tuple, Union

from sparkdl._net.frames import FrameProtection, HandshakeFailed, connect_retrying
from sparkdl._net.server import HANDSHAKE_S, ThreadedServer, checked_secret
from sparkdl._net.server import close_quietly as _close_quietly
from sparkdl.strategies.parameter_server.wire import (
    MAX_ERROR_BYTES,
    REQUEST_KINDS,
    Header,
    IntegrityError,
    Kind,
    ParameterServerError,
    WireError,
    client_handshake,
    read_header,
    read_request_header,
    receive_payload,
    send_frame,
    server_handshake,
)

logger = logging.getLogger("sparkdl.parameter_server")

# An unauthenticated peer gets this long to prove the secret (ThreadedServer caps how many may
# try at once, the oldest go first): a flood of idle connections must not hold threads for long.
MAX_HANDSHAKE_S = HANDSHAKE_S


def _configure(sock: socket.socket) -> None:
    # Requests are a small header then a large payload, answered by the peer: Nagle's algorithm
    # with delayed ACKs would add tens of milliseconds to every round trip.
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


class Backend(Protocol):
    """What a :class:`ShardServer` serves: the shard store of one rank."""

    def buffer_for(self, rank: int, header: Header, deadline: float) -> memoryview:
        """Validates a request header from ``rank`` and returns the buffer its payload is read
        into (exactly ``header.length`` bytes). Raises WireError for a bad header."""

    def handle(self, rank: int, header: Header) -> Tuple[Header, memoryview]:
        """Serves a request whose payload is in the buffer; returns the reply. Raises
        ParameterServerError (sent to the client as an ERROR frame) or WireError (dropped)."""

    def disconnected(self, rank: int, clean: bool, reason: str) -> None:
        """An authenticated worker went away (``clean``: after saying BYE)."""


class ByteCounter:
    """Thread-safe byte counter shared by a rank's worker and server threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, count: int) -> None:
        with self._lock:
            self._value += count

    @property
    def value(self) -> int:
        with self._lock:
            return self._value

    def set(self, value: int) -> None:
        with self._lock:
            self._value = value


class ShardServer(ThreadedServer):
    """Serves one rank's parameter shards to the other ranks' workers.

    One thread accepts; each connection gets a thread that authenticates it and then serves its
    requests one at a time (a worker has at most one request outstanding per server). Protocol
    violations drop that connection only, with a warning naming the peer.
    """

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        rank: int,
        world_size: int,
        backend: Backend,
        timeout_s: float,
        sent: Optional[ByteCounter] = None,
        encrypt: bool = False,
    ) -> None:
        """Starts serving on an already bound and listening socket.

        Args:
            listener: a listening socket (see :func:`listen`).
            secret: the per-job secret every worker proves.
            rank: this server's rank (workers learn it in the handshake).
            world_size: valid client ranks are ``0..world_size-1`` except ``rank``.
            backend: the shard store requests go to.
            timeout_s: bound on the rest of a frame once it has started, and on sending a reply.
            sent: counts the bytes this server sends (replies).
            encrypt: encrypt every frame (they are integrity-protected either way); workers
                must use the same setting or they are refused at the handshake.
        """
        self._secret = checked_secret(secret)
        self.encrypt = bool(encrypt)
        self.rank = rank
        self.world_size = world_size
        self._backend = backend
        self._timeout_s = timeout_s
        self._handshake_s = min(timeout_s, MAX_HANDSHAKE_S)
        self.sent = sent if sent is not None else ByteCounter()
        self._ranks_seen: Set[int] = set()
        self.address: Tuple[str, int] = listener.getsockname()[:2]
        super().__init__(listener, f"sparkdl-ps{rank}", logger)

    def _authenticate(self, conn: socket.socket) -> Tuple[int, FrameProtection]:
        _configure(conn)
        deadline = time.monotonic() + self._handshake_s
        try:
            conn.settimeout(self._handshake_s)
            # Its pending-handshake slot is freed before the server proves itself: a worker told
            # it is in is never then dropped to make room (ThreadedServer caps pending ones).
            rank, keys = server_handshake(conn, self._secret, self.rank, deadline, self.encrypt, self._authenticated)
        except TimeoutError:
            raise WireError(f"handshake not completed within {self._handshake_s:g}s") from None
        if not 0 <= rank < self.world_size or rank == self.rank:
            raise WireError(f"authenticated peer claims an invalid rank {rank}")
        with self._lock:
            if rank in self._ranks_seen:
                # A worker connects exactly once; a second connection is a bug or a replay.
                raise WireError(f"rank {rank} is already connected (or was, and left)")
            self._ranks_seen.add(rank)
        return rank, keys

    def _serve(self, conn: socket.socket, peer: object) -> None:
        rank: Optional[int] = None
        clean = False
        reason = "connection closed"
        try:
            rank, keys = self._authenticate(conn)
            while True:
                header = read_request_header(conn, self._timeout_s)
                if header is None:
                    reason = "disconnected without saying bye (its task probably died)"
                    break
                if header.rank != rank:
                    raise WireError(f"frame claims rank {header.rank} on rank {rank}'s connection")
                if header.kind == Kind.BYE:
                    if header.length:
                        raise WireError("BYE with a payload")
                    receive_payload(conn, keys.opener, header, memoryview(b""), time.monotonic() + self._timeout_s)
                    clean = True
                    break
                if header.kind not in REQUEST_KINDS:
                    raise WireError(f"unexpected {Kind(header.kind).name} frame from a worker")
                deadline = time.monotonic() + self._timeout_s
                buffer = self._backend.buffer_for(rank, header, deadline)
                if len(buffer) != header.length:
                    raise WireError(f"frame of {header.length} bytes, expected {len(buffer)}")
                # Nothing of the frame is acted on before its tag checks out.
                receive_payload(conn, keys.opener, header, buffer, deadline)
                try:
                    reply, payload = self._backend.handle(rank, header)
                except (ParameterServerError, MemoryError) as exc:
                    # Out of memory (a sparse shard that may not grow under Spark's Python limit):
                    # the worker asking is told why, instead of finding its connection closed.
                    peer = self.rank if isinstance(exc, MemoryError) else exc.peer_rank
                    message = f"{OUT_OF_MEMORY} {rank}: {exc}" if isinstance(exc, MemoryError) else str(exc)
                    text = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
                    reply, payload = (
                        Header(Kind.ERROR, 0, header.table, self.rank, 0, -1 if peer is None else peer, len(text)),
                        memoryview(text),
                    )
                conn.settimeout(self._timeout_s)
                self.sent.add(send_frame(conn, keys.sealer, reply, payload))
        except (WireError, TimeoutError, OSError) as exc:
            if not self._closed.is_set():
                who = f"rank {rank}" if rank is not None else "unauthenticated peer"
                reason = f"dropped: {exc}"
                self._log_drop(
                    peer,
                    exc,
                    "parameter server on rank %d: dropping %s (%s): %s",
                    self.rank,
                    who,
                    peer,
                    exc,
                    authenticated=rank is not None,
                )
        finally:
            self._forget_connection(conn)
            if rank is not None and not self._closed.is_set():
                try:
                    self._backend.disconnected(rank, clean, reason)
                except Exception:  # noqa: BLE001 - a server thread must not die silently
                    logger.exception("parameter server on rank %d: disconnect handling failed", self.rank)
            self._release()


#: What a server's out-of-memory reply says (the worker's error reads "parameter server on rank
#: S: ran out of memory serving rank K: ..."; sparkdl._task.out_of_memory recognizes it).
OUT_OF_MEMORY = "ran out of memory serving rank"


def listen(host: str) -> socket.socket:
    """A listening socket on an ephemeral port of ``host`` only (no pick-then-bind race)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, 0), family=family, backlog=128)


class ShardClient:
    """A worker's authenticated connection to one other rank's :class:`ShardServer`."""

    def __init__(
        self,
        address: Tuple[str, int],
        secret: bytes,
        rank: int,
        server_rank: int,
        timeout_s: float,
        sent: Optional[ByteCounter] = None,
        encrypt: bool = False,
    ) -> None:
        """Connects and authenticates.

        Args:
            address: the server's ``(host, port)``.
            secret: the per-job secret.
            rank: this worker's rank.
            server_rank: the rank the server must prove to be.
            timeout_s: bound on connecting and the handshake (retried while the server sheds
                connections, e.g. under a flood of idle ones) and on every send; replies get
                ``timeout_s`` plus a margin, so that a server's own (clearer) timeout error
                arrives first.
            sent: counts the bytes this worker sends.
            encrypt: encrypt every frame (they are integrity-protected either way); must match
                the server's setting.

        Raises:
            ParameterServerError: unreachable, wrong secret, an encryption mismatch, or the
                wrong rank answered.
        """
        self.server_rank = server_rank
        self.rank = rank
        self._timeout_s = timeout_s
        self.reply_timeout_s = timeout_s + max(10.0, 0.1 * timeout_s)
        self.sent = sent if sent is not None else ByteCounter()
        self._closed = False

        def attempt(sock: socket.socket, deadline: float) -> Tuple[int, FrameProtection]:
            _configure(sock)
            return client_handshake(sock, secret, rank, deadline, bool(encrypt))

        try:
            sock, (answered, self._keys) = connect_retrying(
                address, timeout_s, attempt, f"the parameter server on rank {server_rank}"
            )
        except (WireError, HandshakeFailed) as exc:
            raise ParameterServerError(
                f"rank {rank}: handshake with the parameter server on rank {server_rank} failed: {exc}", server_rank
            ) from exc
        except OSError as exc:
            raise ParameterServerError(
                f"rank {rank} cannot connect to the parameter server on rank {server_rank} at {address}: {exc}",
                server_rank,
            ) from exc
        if answered != server_rank:
            _close_quietly(sock)
            raise ParameterServerError(
                f"rank {rank}: expected the parameter server of rank {server_rank}, rank {answered} answered",
                server_rank,
            )
        sock.settimeout(timeout_s)
        self._sock = sock

    def _lost(self, what: str, exc: BaseException) -> ParameterServerError:
        self._closed = True
        _close_quietly(self._sock)
        return ParameterServerError(
            f"rank {self.rank} lost the parameter server on rank {self.server_rank} while {what} ({exc}); "
            f"rank {self.server_rank}'s task has probably failed: see its error",
            self.server_rank,
        )

    def send(self, header: Header, *payload: Union[bytes, memoryview]) -> int:
        """Sends one request; returns the bytes it put on the wire.

        Raises:
            ParameterServerError: the connection broke (names the server's rank).
        """
        if self._closed:
            raise ParameterServerError(
                f"rank {self.rank}: the connection to the parameter server on rank {self.server_rank} is closed",
                self.server_rank,
            )
        try:
            self._sock.settimeout(self._timeout_s)
            count = send_frame(self._sock, self._keys.sealer, header, *payload)
        except OSError as exc:
            raise self._lost("sending", exc) from exc
        self.sent.add(count)
        return count

    def receive(self, into: memoryview, table: int, kind: Kind = Kind.PARAMS) -> Header:
        """Reads the reply (of ``kind``: PARAMS, or ROWS for a sparse request) to the last
        request into ``into`` (exactly its size).

        Raises:
            ParameterServerError: the server reported an error, broke the protocol, or went away.
        """
        deadline = time.monotonic() + self.reply_timeout_s
        try:
            header = read_header(self._sock, deadline)
            if header is None:
                raise ConnectionAbortedError("the server closed the connection")
            if header.kind == Kind.ERROR:
                if header.length > MAX_ERROR_BYTES:
                    raise WireError(f"error text of {header.length} bytes")
                buffer = bytearray(header.length)
                receive_payload(self._sock, self._keys.opener, header, memoryview(buffer), deadline, "error frame")
                text = buffer.decode("utf-8", "replace")
                raise ParameterServerError(
                    f"parameter server on rank {self.server_rank}: {text}", header.aux if header.aux >= 0 else None
                )
            if (
                header.kind != kind
                or header.table != table
                or header.length != len(into)
                or header.rank != self.server_rank
            ):
                raise WireError(f"unexpected reply {header}")
            # Decrypted (or authenticated) in place: ``into`` is only valid once this returns.
            receive_payload(self._sock, self._keys.opener, header, into, deadline, "reply")
            return header
        except IntegrityError as exc:
            self._closed = True
            _close_quietly(self._sock)
            raise ParameterServerError(
                f"rank {self.rank}: a reply from the parameter server on rank {self.server_rank} failed its integrity "
                f"check ({exc}); the connection was altered or corrupted in transit",
                self.server_rank,
            ) from exc
        except TimeoutError as exc:
            raise self._lost(f"waiting {self.reply_timeout_s:g}s for a reply", exc) from exc
        except (WireError, OSError) as exc:
            raise self._lost("receiving", exc) from exc

    def close(self) -> None:
        """Says BYE (so the server stops waiting for this worker) and closes. Never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.settimeout(min(self._timeout_s, 5.0))
            send_frame(self._sock, self._keys.sealer, Header(Kind.BYE, 0, 0, self.rank, 0, 0, 0))
        except OSError:
            pass
        _close_quietly(self._sock)


def connect_all(
    addresses: Sequence[Optional[Tuple[str, int]]],
    secret: bytes,
    rank: int,
    timeout_s: float,
    sent: ByteCounter,
    factory: Callable[..., ShardClient] = ShardClient,
    encrypt: bool = False,
) -> Dict[int, ShardClient]:
    """One client per other rank (``encrypt`` as in :class:`ShardClient`); closes those already
    opened if one fails."""
    clients: Dict[int, ShardClient] = {}
    try:
        for server_rank, address in enumerate(addresses):
            if server_rank == rank or address is None:
                continue
            clients[server_rank] = factory(address, secret, rank, server_rank, timeout_s, sent, encrypt=encrypt)
    except BaseException:
        for client in clients.values():
            client.close()
        raise
    return clients
