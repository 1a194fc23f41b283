"""Wire protocol of the parameter server (:mod:`sparkdl.strategies.parameter_server`).

Every barrier task runs one server and its worker holds one client per *other* task (a worker
reaches its own shard in-process); those live in
:mod:`~sparkdl.strategies.parameter_server.transport`, the frames and the handshake they speak
here. The servers can be reached by anything on the cluster network, so the protocol is built
like :mod:`sparkdl._net.channel`: authenticate before parsing anything, fixed-size headers, exact
sizes known in advance, deadlines on every read, never unpickle, and every frame after the
handshake integrity-protected (and, with ``encrypt=True``, encrypted).

Handshake, version 2 (integers big-endian; ``H`` = HMAC-SHA256 with the per-job secret;
``mode`` = one byte, 1 when that side encrypts, 0 when it only integrity-protects):

1. server -> client: ``GREETING`` (8 bytes, ``b"SPKDLPS\\x02"``) + the server's ``mode`` (1) +
   ``server_nonce`` (32).
2. client -> server: ``client_rank`` (u32) + ``client_nonce`` (32) + the client's ``mode`` (1) +
   ``H(b"sparkdl-ps client" + server_nonce + client_nonce + client_rank + client_mode)`` (32).
   A client whose mode differs from the server's sends this and then fails with an "encryption
   mismatch" error; the server, after checking the MAC, drops it with the same message.
3. server -> client: ``server_rank`` (u32) +
   ``H(b"sparkdl-ps server" + client_nonce + server_nonce + server_rank + server_mode)`` (32).

Both sides prove the secret (mutual authentication; the labels keep one side's proof from being
replayed as the other's), each learns the other's rank, bound into the MAC, and the modes are
bound into the MACs too. Both then derive the connection's two keys, one per direction
(:mod:`sparkdl._net.frames`: HKDF-SHA256 over the secret, salt ``server_nonce + client_nonce``,
label ``b"sparkdl-ps v2"`` and the mode), fresh for every connection.

Frames: a :data:`HEADER` (36 bytes, big-endian ``>4sBBHIqqQ``: magic ``SDPS``, kind, dtype code,
table id, sender rank, clock, aux, payload length), then a body of exactly ``length`` bytes, then
a :data:`TAG_BYTES` (16) AES-256-GCM tag. The GCM nonce is the frame's index in its direction
(96 bits, 0 for the first frame, never sent), so a replayed, reordered, dropped or spliced frame
fails. With ``encrypt=True`` the body is the encrypted payload and the header is associated
data; with ``encrypt=False`` the body is the payload in clear and header and payload are both
associated data (GMAC). ``length`` counts the payload, not the tag. Payloads:

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
ROW_PULL  worker -> server         ``aux`` little-endian int64 row ids of a sparse table (unique,
                                   all owned by this server). ``clock`` = the pushes this worker
                                   made to the table: the read waits as a PULL's would (SSP).
ROW_PUSH  worker -> server         ``aux`` int64 row ids, then ``aux`` gradient rows (raw tensor
                                   bytes). ``clock`` as for PUSH; sent to every server each step,
                                   with no rows where the batch touched none, so that the clocks
                                   advance everywhere.
ROWS      server -> worker         the pulled rows in the request's order (none for a push).
                                   ``clock`` = the slowest worker's clock, ``aux`` = staleness.
========  =======================  ==============================================================

For ROW_PULL and ROW_PUSH the ``table`` field counts the sparse tables (their own numbering);
the server checks the length against ``aux`` and the table's row size before it buffers
anything, and at most :data:`MAX_ROWS_PER_FRAME` rows travel in one frame.

The header can only be checked with the tag that ends the frame, so a receiver uses it before
that for nothing but sanity checks and choosing the buffer: the server knows each table's shard
size, so a PUSH whose length is not exactly right is a protocol error and nothing bigger than
that is ever buffered. The body is received straight into that buffer and decrypted or
authenticated there; a frame is acted on (a push applied, a reply returned, a BYE honoured)
only after its tag checks out. A frame that fails drops the connection (server) or raises
(client), and what its buffer holds is never used.
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
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from sparkdl._net.frames import (
    TAG_BYTES,
    FrameAuthError,
    FrameOpener,
    FrameProtection,
    FrameSealer,
    Shed,
    mismatch_message,
    mode_byte,
    mode_from_byte,
    protection,
    read_greeting,
    split_greeting,
)
from sparkdl._net.server import recv_exact
from sparkdl.errors import PeerLostError

GREETING = b"SPKDLPS\x02"
FRAME_MAGIC = b"SDPS"
HEADER = struct.Struct(">4sBBHIqqQ")
NONCE_BYTES = 32
DIGEST_BYTES = 32
_RANK = struct.Struct(">I")
#: Step 1: GREETING + the server's mode byte + server nonce.
GREETING_BYTES = len(GREETING) + 1 + NONCE_BYTES
CLIENT_PROOF_BYTES = _RANK.size + NONCE_BYTES + 1 + DIGEST_BYTES
SERVER_PROOF_BYTES = _RANK.size + DIGEST_BYTES
#: Protocol label of the frame keys (sparkdl._net.frames).
KEY_LABEL = b"sparkdl-ps v2"
#: Payload pieces larger than this are sealed and sent in chunks of sparkdl._net.frames's size.
_SMALL_PIECE = 4096
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
    ROW_PULL = 6
    ROW_PUSH = 7
    ROWS = 8


#: Kinds a worker sends to a server.
REQUEST_KINDS = frozenset({Kind.PUSH, Kind.PULL, Kind.ROW_PULL, Kind.ROW_PUSH})
#: Sparse-table requests (the ``table`` field counts the sparse tables).
ROW_KINDS = frozenset({Kind.ROW_PULL, Kind.ROW_PUSH})
#: Most rows one ROW_PULL or ROW_PUSH frame carries (bounds the server's receive buffer).
MAX_ROWS_PER_FRAME = 1 << 22


_KIND_VALUES = frozenset(int(kind) for kind in Kind)
#: Tensor dtypes the wire carries, by code.
DTYPES: Dict[int, torch.dtype] = {1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16}
DTYPE_CODES: Dict[torch.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}


class WireError(Exception):
    """A peer broke the protocol; the server drops its connection and logs why."""


class IntegrityError(WireError):
    """A frame failed its integrity check (see :class:`sparkdl._net.frames.FrameAuthError`)."""


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


def read_header(sock: socket.socket, deadline: Optional[float]) -> Optional[Header]:
    """Reads one header before ``deadline``; None on EOF at a frame boundary.

    Raises:
        WireError: a partial or malformed header.
        TimeoutError: the deadline passed.
    """
    data = recv_exact(sock, HEADER.size, deadline)
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
        data += recv_exact(sock, HEADER.size - len(first), time.monotonic() + timeout_s)
    return Header.decode(data)


def send_frame(sock: socket.socket, sealer: FrameSealer, header: Header, *payload: Union[bytes, memoryview]) -> int:
    """Seals and sends a header and its payload pieces (which must add up to ``header.length``),
    then the tag; returns the bytes sent. The socket's timeout bounds each ``sendall``.

    Small leading pieces (the learning rates) travel with the header in one segment; large ones
    are sealed in chunks (integrity mode: authenticated and sent from the caller's buffer;
    encrypt mode: encrypted into the sealer's scratch buffer), so no payload is ever copied whole.
    Callers serialize the frames of one connection."""
    sizes = sum(len(piece) for piece in payload)
    if sizes != header.length:
        raise ValueError(f"payload of {sizes} bytes does not match the header's {header.length}")
    head = header.encode()
    frame = sealer.begin(head)
    pieces = [
        memoryview(piece).cast("B") if memoryview(piece).format != "B" else memoryview(piece) for piece in payload
    ]
    lead = [head]
    while pieces and len(pieces[0]) <= _SMALL_PIECE:
        lead.append(bytes(frame.update(pieces.pop(0))))
    if not pieces:
        lead.append(frame.finalize())
        sock.sendall(b"".join(lead))
        return HEADER.size + header.length + TAG_BYTES
    sock.sendall(b"".join(lead))
    scratch = sealer.scratch()
    chunk = len(scratch)
    for piece in pieces:
        for start in range(0, len(piece), chunk):
            sock.sendall(frame.update(piece[start : start + chunk], scratch))
    sock.sendall(frame.finalize())
    return HEADER.size + header.length + TAG_BYTES


def receive_payload(
    sock: socket.socket,
    opener: FrameOpener,
    header: Header,
    into: memoryview,
    deadline: Optional[float],
    what: str = "frame",
) -> None:
    """Reads the body of the frame whose ``header`` was just read straight into ``into`` (exactly
    ``header.length`` bytes), decrypting or authenticating it there as it arrives, then its tag.

    Raises:
        WireError: the peer closed first ("truncated <what>").
        IntegrityError: the frame failed its integrity check; ``into`` holds unverified bytes.
        TimeoutError: ``deadline`` (``time.monotonic``, for the whole read) passed first.
    """
    total = len(into)
    if total != header.length:
        raise ValueError(f"buffer of {total} bytes for a payload of {header.length}")
    frame = opener.begin(header.encode())
    got = 0
    while got < total:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        count = sock.recv_into(into[got:], total - got)
        if count == 0:
            raise WireError(f"truncated {what} ({got} of {total} bytes)")
        frame.update_into(into[got : got + count])
        got += count
    tag = recv_exact(sock, TAG_BYTES, deadline)
    if len(tag) < TAG_BYTES:
        raise WireError(f"truncated {what} (its tag: {len(tag)} of {TAG_BYTES} bytes)")
    try:
        frame.finalize(tag)
    except FrameAuthError as exc:
        raise IntegrityError(str(exc)) from None


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def client_handshake(
    sock: socket.socket, secret: bytes, rank: int, deadline: float, encrypt: bool = False
) -> Tuple[int, FrameProtection]:
    """Authenticates a fresh connection from the client side.

    Returns:
        ``(server_rank, protection)``: the rank that answered and this side's frame protection.

    Raises:
        WireError: the peer is not a parameter server of this job (bad greeting or proof), or it
            disagrees about ``encrypt`` ("encryption mismatch").
        Shed: the server hung up (before its greeting, or after our proof): retry.
        TimeoutError, OSError: the handshake did not complete.
    """
    greeting = split_greeting(read_greeting(sock, GREETING_BYTES, GREETING, deadline), GREETING, NONCE_BYTES)
    if greeting is None:
        raise WireError("the peer is not a sparkdl parameter server (bad greeting)")
    server_mode, server_nonce = greeting
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    rank_bytes = _RANK.pack(rank)
    mode = mode_byte(encrypt)
    # Sent even on a mismatch, so that the server can log why this worker is refused.
    sock.sendall(
        rank_bytes + client_nonce + mode + _mac(secret, _CLIENT_LABEL, server_nonce, client_nonce, rank_bytes, mode)
    )
    theirs = mode_from_byte(server_mode[0])
    if theirs is None:
        raise WireError(f"the parameter server uses an unknown protection mode {server_mode[0]}")
    if theirs != encrypt:
        raise WireError(mismatch_message(encrypt, theirs, "worker", "parameter server"))
    proof = recv_exact(sock, SERVER_PROOF_BYTES, deadline)
    if len(proof) < SERVER_PROOF_BYTES:
        raise Shed("the server hung up during the handshake", proved=True)  # a wrong secret, or dropped late
    server_rank_bytes, digest = proof[: _RANK.size], proof[_RANK.size :]
    if not hmac.compare_digest(
        digest, _mac(secret, _SERVER_LABEL, client_nonce, server_nonce, server_rank_bytes, server_mode)
    ):
        raise WireError("the server failed to prove the job's secret")
    keys = protection(secret, KEY_LABEL, server_nonce, client_nonce, encrypt, server=False)
    return _RANK.unpack(server_rank_bytes)[0], keys


def server_handshake(
    conn: socket.socket,
    secret: bytes,
    rank: int,
    deadline: float,
    encrypt: bool = False,
    verified: Callable[[], None] = lambda: None,
) -> Tuple[int, FrameProtection]:
    """Authenticates a fresh connection from the server side; calls ``verified()`` once the
    worker proved the secret, before proving it back.

    Returns:
        ``(client_rank, protection)``: the worker's rank and this side's frame protection.

    Raises:
        WireError: wrong secret, a worker that disagrees about ``encrypt`` ("encryption
            mismatch"), or the peer hung up.
        TimeoutError, OSError: the handshake did not complete.
    """
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    mode = mode_byte(encrypt)
    conn.sendall(GREETING + mode + server_nonce)
    proof = recv_exact(conn, CLIENT_PROOF_BYTES, deadline)
    if len(proof) < CLIENT_PROOF_BYTES:
        raise WireError("peer closed the connection during the handshake")
    rank_bytes = proof[: _RANK.size]
    client_nonce = proof[_RANK.size : _RANK.size + NONCE_BYTES]
    client_mode = proof[_RANK.size + NONCE_BYTES : _RANK.size + NONCE_BYTES + 1]
    digest = proof[_RANK.size + NONCE_BYTES + 1 :]
    if not hmac.compare_digest(
        digest, _mac(secret, _CLIENT_LABEL, server_nonce, client_nonce, rank_bytes, client_mode)
    ):
        raise WireError("authentication failed (wrong secret or not a sparkdl worker)")
    client_rank = _RANK.unpack(rank_bytes)[0]
    theirs = mode_from_byte(client_mode[0])
    if theirs is None:
        raise WireError(f"rank {client_rank}'s worker uses an unknown protection mode {client_mode[0]}")
    if theirs != encrypt:
        raise WireError(mismatch_message(encrypt, theirs, "parameter server", f"worker of rank {client_rank}"))
    own = _RANK.pack(rank)
    verified()
    conn.sendall(own + _mac(secret, _SERVER_LABEL, client_nonce, server_nonce, own, mode))
    keys = protection(secret, KEY_LABEL, server_nonce, client_nonce, encrypt, server=True)
    return client_rank, keys
