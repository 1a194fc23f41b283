"""Wire protocol of the parameter server (:mod:`sparkdl.strategies.parameter_server`).

Every barrier task runs one :class:`ShardServer`; every task's worker holds one
:class:`ShardClient` per *other* task (a worker reaches its own shard in-process). The servers
can be reached by anything on the cluster network, so the protocol is built like
:mod:`sparkdl._channel`: authenticate before parsing anything, fixed-size headers, exact sizes
known in advance, deadlines on every read, and never unpickle.

Handshake (integers big-endian; ``H`` = HMAC-SHA256 with the per-job secret):

1. server -> client: ``GREETING`` (8 bytes) + ``server_nonce`` (32 bytes).
2. client -> server: ``client_rank`` (u32) + ``client_nonce`` (32) +
   ``H(b"sparkdl-ps client" + server_nonce + client_nonce + client_rank)`` (32).
3. server -> client: ``server_rank`` (u32) +
   ``H(b"sparkdl-ps server" + client_nonce + server_nonce + server_rank)`` (32).

Both sides prove the secret (mutual authentication; the labels keep one side's proof from being
replayed as the other's), and each learns the other's rank, bound into the MAC.

Frames: a :data:`HEADER` (36 bytes, big-endian ``>4sBBHIqqQ``: magic ``SDPS``, kind, dtype code,
table id, sender rank, clock, aux, payload length) followed by exactly ``length`` payload bytes:

========  =======================  ==============================================================
kind      direction                payload
========  =======================  ==============================================================
PUSH      worker -> server         ``aux`` little-endian float64 learning rates (one per
                                   parameter group; NaN = unchanged), then the shard's gradient
                                   (raw tensor bytes, little-endian). ``clock`` = pushes this
                                   worker made to this table before this one.
PULL      worker -> server         none. ``clock`` = -1: the current values, no staleness wait.
PARAMS    server -> worker         the shard's values (raw tensor bytes). ``clock`` = the slowest
                                   worker's clock, ``aux`` = the staleness of this read.
ERROR     server -> worker         UTF-8 text (at most :data:`MAX_ERROR_BYTES`): why the request
                                   failed (a lost peer, a staleness wait that timed out).
BYE       worker -> server         none: this worker is finished; it no longer holds others back.
========  =======================  ==============================================================

The server knows each table's shard size, so a PUSH whose length is not exactly right is a
protocol error; nothing bigger than that is ever buffered.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional, Protocol, Sequence, Set, Tuple, Union

import torch

from sparkdl._channel import _recv_exact
from sparkdl._tcpserver import ThreadedServer
from sparkdl._tcpserver import close_quietly as _close_quietly
from sparkdl.errors import PeerLostError

logger = logging.getLogger("sparkdl.parameter_server")

GREETING = b"SPKDLPS\x01"
FRAME_MAGIC = b"SDPS"
HEADER = struct.Struct(">4sBBHIqqQ")
NONCE_BYTES = 32
DIGEST_BYTES = 32
_RANK = struct.Struct(">I")
CLIENT_PROOF_BYTES = _RANK.size + NONCE_BYTES + DIGEST_BYTES
SERVER_PROOF_BYTES = _RANK.size + DIGEST_BYTES
MAX_ERROR_BYTES = 4096
#: Largest table id, rank and learning-rate count the header can carry.
MAX_TABLE = (1 << 16) - 1
_CLIENT_LABEL = b"sparkdl-ps client"
_SERVER_LABEL = b"sparkdl-ps server"
# Unauthenticated peers get at most this many concurrent handshakes and this long each: a flood
# of idle connections must not hold threads (or the slots of real workers) for the full timeout.
MAX_PENDING_HANDSHAKES = 64
MAX_HANDSHAKE_S = 30.0


class Kind(enum.IntEnum):
    """Frame kinds."""

    PUSH = 1
    PULL = 2
    PARAMS = 3
    ERROR = 4
    BYE = 5


#: Tensor dtypes the wire carries, by code.
_KIND_VALUES = frozenset(int(kind) for kind in Kind)
DTYPES: Dict[int, torch.dtype] = {1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16}
DTYPE_CODES: Dict[torch.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}


class WireError(Exception):
    """A peer broke the protocol; the server drops its connection and logs why."""


class ParameterServerError(PeerLostError, RuntimeError):
    """Training cannot go on: a peer rank was lost, or a wait for it timed out.

    A :class:`~sparkdl.errors.PeerLostError` (the launcher then looks for the lost rank as the
    root cause) and, as before, a ``RuntimeError``.

    Attributes:
        peer_rank: the rank that was lost or waited for (None when not one rank's fault).
    """

    def __init__(self, message: str, peer_rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.peer_rank = peer_rank


@dataclasses.dataclass(frozen=True)
class Header:
    """One frame header (see the module docstring for what each field means per kind)."""

    kind: int
    dtype: int
    table: int
    rank: int
    clock: int
    aux: int
    length: int

    def encode(self) -> bytes:
        """The 36 header bytes. Raises ``struct.error`` for out-of-range fields."""
        return HEADER.pack(FRAME_MAGIC, self.kind, self.dtype, self.table, self.rank, self.clock, self.aux, self.length)

    @classmethod
    def decode(cls, data: bytes) -> "Header":
        """Parses and sanity-checks header bytes.

        Raises:
            WireError: wrong size, wrong magic, unknown kind or dtype code.
        """
        if len(data) != HEADER.size:
            raise WireError(f"truncated header ({len(data)} of {HEADER.size} bytes)")
        magic, kind, dtype, table, rank, clock, aux, length = HEADER.unpack(data)
        if magic != FRAME_MAGIC:
            raise WireError(f"bad frame magic {magic!r}")
        if kind not in _KIND_VALUES:
            raise WireError(f"unknown frame kind {kind}")
        if dtype != 0 and dtype not in DTYPES:
            raise WireError(f"unknown dtype code {dtype}")
        return cls(kind=kind, dtype=dtype, table=table, rank=rank, clock=clock, aux=aux, length=length)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 too)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def recv_into(sock: socket.socket, view: memoryview, deadline: Optional[float]) -> int:
    """Fills ``view``; returns the bytes read (fewer when the peer closes first).

    Raises:
        TimeoutError: ``deadline`` (``time.monotonic``) passed first. A deadline for the whole
            read, not per ``recv``: a peer trickling one byte at a time cannot stretch it.
    """
    got = 0
    total = len(view)
    while got < total:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        count = sock.recv_into(view[got:], total - got)
        if count == 0:
            break
        got += count
    return got


def read_header(sock: socket.socket, deadline: Optional[float]) -> Optional[Header]:
    """Reads one header before ``deadline``; None on EOF at a frame boundary.

    Raises:
        WireError: a partial or malformed header.
        TimeoutError: the deadline passed.
    """
    data = _recv_exact(sock, HEADER.size, deadline)
    if not data:
        return None
    return Header.decode(data)


def read_request_header(sock: socket.socket, timeout_s: float) -> Optional[Header]:
    """A server's wait for a worker's next request: the first byte may take any time (a worker
    may evaluate, checkpoint or wait for a slow peer between steps; ``close()`` interrupts the
    wait, and a dead worker's socket reads EOF), the rest of the header must follow within
    ``timeout_s``. None on EOF at a frame boundary.

    Raises:
        WireError: a partial or malformed header.
        TimeoutError: the rest of the header did not arrive in time.
    """
    sock.settimeout(None)
    first = sock.recv(HEADER.size)
    if not first:
        return None
    data = first
    if len(first) < HEADER.size:
        data += _recv_exact(sock, HEADER.size - len(first), time.monotonic() + timeout_s)
    return Header.decode(data)


def send_frame(sock: socket.socket, header: Header, *payload: Union[bytes, memoryview]) -> int:
    """Sends a header and its payload pieces (which must add up to ``header.length``); returns
    the bytes sent. The socket's timeout bounds each ``sendall`` as a whole."""
    sizes = sum(len(piece) for piece in payload)
    if sizes != header.length:
        raise ValueError(f"payload of {sizes} bytes does not match the header's {header.length}")
    pieces = list(payload)
    # Small leading pieces (the learning rates) travel with the header in one segment.
    lead = header.encode()
    while pieces and len(pieces[0]) <= 4096:
        lead += bytes(pieces.pop(0))
    sock.sendall(lead)
    for piece in pieces:
        sock.sendall(piece)
    return HEADER.size + header.length


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def client_handshake(sock: socket.socket, secret: bytes, rank: int, deadline: float) -> int:
    """Authenticates a fresh connection from the client side; returns the server's rank.

    Raises:
        WireError: the peer is not a parameter server of this job (bad greeting or proof).
        TimeoutError, OSError: the handshake did not complete.
    """
    greeting = _recv_exact(sock, len(GREETING) + NONCE_BYTES, deadline)
    if len(greeting) < len(GREETING) + NONCE_BYTES or not greeting.startswith(GREETING):
        raise WireError("the peer is not a sparkdl parameter server (bad greeting)")
    server_nonce = greeting[len(GREETING):]
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    rank_bytes = _RANK.pack(rank)
    sock.sendall(rank_bytes + client_nonce + _mac(secret, _CLIENT_LABEL, server_nonce, client_nonce, rank_bytes))
    proof = _recv_exact(sock, SERVER_PROOF_BYTES, deadline)
    if len(proof) < SERVER_PROOF_BYTES:
        raise WireError("the server hung up during the handshake (wrong secret?)")
    server_rank_bytes, digest = proof[: _RANK.size], proof[_RANK.size:]
    if not hmac.compare_digest(digest, _mac(secret, _SERVER_LABEL, client_nonce, server_nonce, server_rank_bytes)):
        raise WireError("the server failed to prove the job's secret")
    return _RANK.unpack(server_rank_bytes)[0]


def server_handshake(conn: socket.socket, secret: bytes, rank: int, deadline: float) -> int:
    """Authenticates a fresh connection from the server side; returns the client's rank.

    Raises:
        WireError: wrong secret, or the peer hung up.
        TimeoutError, OSError: the handshake did not complete.
    """
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    conn.sendall(GREETING + server_nonce)
    proof = _recv_exact(conn, CLIENT_PROOF_BYTES, deadline)
    if len(proof) < CLIENT_PROOF_BYTES:
        raise WireError("peer closed the connection during the handshake")
    rank_bytes = proof[: _RANK.size]
    client_nonce = proof[_RANK.size: _RANK.size + NONCE_BYTES]
    digest = proof[_RANK.size + NONCE_BYTES:]
    if not hmac.compare_digest(digest, _mac(secret, _CLIENT_LABEL, server_nonce, client_nonce, rank_bytes)):
        raise WireError("authentication failed (wrong secret or not a sparkdl worker)")
    own = _RANK.pack(rank)
    conn.sendall(own + _mac(secret, _SERVER_LABEL, client_nonce, server_nonce, own))
    return _RANK.unpack(rank_bytes)[0]


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
        """
        if not secret:
            raise ValueError("secret must be non-empty")
        self._secret = bytes(secret)
        self.rank = rank
        self.world_size = world_size
        self._backend = backend
        self._timeout_s = timeout_s
        self._handshake_s = min(timeout_s, MAX_HANDSHAKE_S)
        self.sent = sent if sent is not None else ByteCounter()
        self._pending = 0
        self._ranks_seen: Set[int] = set()
        self.address: Tuple[str, int] = listener.getsockname()[:2]
        super().__init__(listener, f"sparkdl-ps{rank}", logger)

    def _admit(self, peer: object) -> bool:
        # Bounds the threads an unauthenticated flood can make us hold.
        if self._pending >= MAX_PENDING_HANDSHAKES:
            logger.warning("parameter server on rank %d: too many pending handshakes; dropping %s", self.rank, peer)
            return False
        self._pending += 1
        return True

    def _authenticate(self, conn: socket.socket) -> int:
        _configure(conn)
        deadline = time.monotonic() + self._handshake_s
        try:
            conn.settimeout(self._handshake_s)
            rank = server_handshake(conn, self._secret, self.rank, deadline)
        except TimeoutError:
            raise WireError(f"handshake not completed within {self._handshake_s:g}s") from None
        if not 0 <= rank < self.world_size or rank == self.rank:
            raise WireError(f"authenticated peer claims an invalid rank {rank}")
        with self._lock:
            if rank in self._ranks_seen:
                # A worker connects exactly once; a second connection is a bug or a replay.
                raise WireError(f"rank {rank} is already connected (or was, and left)")
            self._ranks_seen.add(rank)
        return rank

    def _serve(self, conn: socket.socket, peer: object) -> None:
        rank: Optional[int] = None
        clean = False
        reason = "connection closed"
        try:
            try:
                rank = self._authenticate(conn)
            finally:
                with self._lock:
                    self._pending -= 1
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
                    clean = True
                    break
                if header.kind not in (Kind.PUSH, Kind.PULL):
                    raise WireError(f"unexpected {Kind(header.kind).name} frame from a worker")
                deadline = time.monotonic() + self._timeout_s
                buffer = self._backend.buffer_for(rank, header, deadline)
                if len(buffer) != header.length:
                    raise WireError(f"frame of {header.length} bytes, expected {len(buffer)}")
                got = recv_into(conn, buffer, deadline)
                if got < header.length:
                    raise WireError(f"truncated frame ({got} of {header.length} bytes)")
                try:
                    reply, payload = self._backend.handle(rank, header)
                except ParameterServerError as exc:
                    text = str(exc).encode("utf-8", "replace")[:MAX_ERROR_BYTES]
                    reply, payload = Header(Kind.ERROR, 0, header.table, self.rank, 0, -1 if exc.peer_rank is None else exc.peer_rank, len(text)), memoryview(text)
                conn.settimeout(self._timeout_s)
                self.sent.add(send_frame(conn, reply, payload))
        except (WireError, TimeoutError, OSError) as exc:
            if not self._closed.is_set():
                who = f"rank {rank}" if rank is not None else "unauthenticated peer"
                reason = f"dropped: {exc}"
                logger.warning("parameter server on rank %d: dropping %s (%s): %s", self.rank, who, peer, exc)
        finally:
            self._forget_connection(conn)
            if rank is not None and not self._closed.is_set():
                try:
                    self._backend.disconnected(rank, clean, reason)
                except Exception:  # noqa: BLE001 - a server thread must not die silently
                    logger.exception("parameter server on rank %d: disconnect handling failed", self.rank)
            self._release()


def listen(host: str) -> socket.socket:
    """A listening socket on an ephemeral port of ``host`` only (no pick-then-bind race)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, 0), family=family, backlog=128)


class ShardClient:
    """A worker's authenticated connection to one other rank's :class:`ShardServer`."""

    def __init__(self, address: Tuple[str, int], secret: bytes, rank: int, server_rank: int, timeout_s: float, sent: Optional[ByteCounter] = None) -> None:
        """Connects and authenticates.

        Args:
            address: the server's ``(host, port)``.
            secret: the per-job secret.
            rank: this worker's rank.
            server_rank: the rank the server must prove to be.
            timeout_s: bound on connecting, the handshake and every send; replies get
                ``timeout_s`` plus a margin, so that a server's own (clearer) timeout error
                arrives first.
            sent: counts the bytes this worker sends.

        Raises:
            ParameterServerError: unreachable, wrong secret, or the wrong rank answered.
        """
        self.server_rank = server_rank
        self.rank = rank
        self._timeout_s = timeout_s
        self.reply_timeout_s = timeout_s + max(10.0, 0.1 * timeout_s)
        self.sent = sent if sent is not None else ByteCounter()
        self._closed = False
        try:
            sock = socket.create_connection(tuple(address), timeout=timeout_s)
        except OSError as exc:
            raise ParameterServerError(f"rank {rank} cannot connect to the parameter server on rank {server_rank} at {address}: {exc}", server_rank) from exc
        try:
            _configure(sock)
            answered = client_handshake(sock, secret, rank, time.monotonic() + timeout_s)
        except (WireError, TimeoutError, OSError) as exc:
            _close_quietly(sock)
            raise ParameterServerError(f"rank {rank}: handshake with the parameter server on rank {server_rank} failed: {exc}", server_rank) from exc
        if answered != server_rank:
            _close_quietly(sock)
            raise ParameterServerError(f"rank {rank}: expected the parameter server of rank {server_rank}, rank {answered} answered", server_rank)
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

    def send(self, header: Header, *payload: Union[bytes, memoryview]) -> None:
        """Sends one request.

        Raises:
            ParameterServerError: the connection broke (names the server's rank).
        """
        if self._closed:
            raise ParameterServerError(f"rank {self.rank}: the connection to the parameter server on rank {self.server_rank} is closed", self.server_rank)
        try:
            self._sock.settimeout(self._timeout_s)
            self.sent.add(send_frame(self._sock, header, *payload))
        except OSError as exc:
            raise self._lost("sending", exc) from exc

    def receive(self, into: memoryview, table: int) -> Header:
        """Reads the PARAMS reply to the last request into ``into`` (exactly its size).

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
                text = _recv_exact(self._sock, header.length, deadline).decode("utf-8", "replace")
                raise ParameterServerError(f"parameter server on rank {self.server_rank}: {text}", header.aux if header.aux >= 0 else None)
            if header.kind != Kind.PARAMS or header.table != table or header.length != len(into) or header.rank != self.server_rank:
                raise WireError(f"unexpected reply {header}")
            got = recv_into(self._sock, into, deadline)
            if got < header.length:
                raise ConnectionAbortedError(f"truncated reply ({got} of {header.length} bytes)")
            return header
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
            send_frame(self._sock, Header(Kind.BYE, 0, 0, self.rank, 0, 0, 0))
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
) -> Dict[int, ShardClient]:
    """One client per other rank; closes those already opened if one fails."""
    clients: Dict[int, ShardClient] = {}
    try:
        for server_rank, address in enumerate(addresses):
            if server_rank == rank or address is None:
                continue
            clients[server_rank] = factory(address, secret, rank, server_rank, timeout_s, sent)
    except BaseException:
        for client in clients.values():
            client.close()
        raise
    return clients
