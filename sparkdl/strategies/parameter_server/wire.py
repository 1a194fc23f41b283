"""Wire protocol of the parameter server (:mod:`sparkdl.strategies.parameter_server`).

Every barrier task runs one server and its worker holds one client per *other* task (a worker
reaches its own shard in-process); those live in
:mod:`~sparkdl.strategies.parameter_server.transport`, the frames and the handshake they speak
here. The servers can be reached by anything on the cluster network, so the protocol is built
like :mod:`sparkdl._channel`: authenticate before parsing anything, fixed-size headers, exact
sizes known in advance, deadlines on every read, and never unpickle.

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
import secrets
import socket
import struct
import time
from typing import Dict, Optional, Union

import torch

from sparkdl._channel import _recv_exact
from sparkdl.errors import PeerLostError

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


class Kind(enum.IntEnum):
    """Frame kinds."""

    PUSH = 1
    PULL = 2
    PARAMS = 3
    ERROR = 4
    BYE = 5


_KIND_VALUES = frozenset(int(kind) for kind in Kind)
#: Tensor dtypes the wire carries, by code.
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
