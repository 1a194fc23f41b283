"""Wire protocol of the rendezvous store (:mod:`sparkdl._net.rendezvous_store`): handshake, frames, messages.

The store's port can be reached by anything on the cluster network, so the protocol is built
like :mod:`sparkdl._net.channel` and the parameter server's wire: authenticate before parsing
anything, fixed-size headers, exact sizes known before they are read, a cap on every size,
deadlines on every read, and never unpickle (keys and values are bytes).

Handshake (integers big-endian; ``H`` = HMAC-SHA256 keyed with :func:`store_key`, i.e.
``HMAC(secret, b"sparkdl-rendezvous")``, so that a proof made for another sparkdl service keyed
by the same per-job secret is worthless here, and the other way round):

1. server -> client: ``GREETING`` (8 bytes) + ``mode`` (1: 1 encrypt, 0 integrity only) +
   ``server_nonce`` (32).
2. client -> server: ``rank`` (u32) + ``client_nonce`` (32) + ``mode`` (1) +
   ``H(b"sparkdl-rendezvous client" + server_nonce + client_nonce + rank + mode)`` (32).
3. server -> client: ``H(b"sparkdl-rendezvous server" + client_nonce + server_nonce + mode)`` (32).

Both sides prove the secret; fresh nonces on both sides keep a recorded exchange from being
replayed, and both modes are bound into the proofs: a mismatch (one side encrypts, the other
does not) fails the handshake with a message saying so. A peer that fails, or is not done
within the server's handshake timeout, is dropped before anything else it sent is parsed. A
server that hangs up before its greeting (shedding a flood), or after the client's proof, is
:class:`~sparkdl._net.frames.Shed`: the client retries (:func:`sparkdl._net.frames.connect_retrying`).

Frames, both ways, after the handshake: ``length`` (u32, at most :data:`MAX_FRAME_BYTES`) + a
body of exactly ``length`` bytes + a 16-byte AES-256-GCM tag (:mod:`sparkdl._net.frames`: keys from
HKDF over the store key, both nonces, the mode and the direction; the frame's index is its
nonce). The length is authenticated in clear; the body is encrypted when the mode says so,
else only authenticated; a frame that fails its tag drops the connection. A body is a :data:`HEADER` (12 bytes, ``>4sBBHI``: magic
``SDRZ``, op, status, item count, timeout in milliseconds) then ``count`` items, each
``length`` (u32) + that many bytes, which must fill the body exactly. :class:`Framing` is the
only code that moves frames (one ``send``/``recv`` pair, built per connection from the
handshake's :class:`Handshake`).

Every request gets one reply with its op; a connection carries one request at a time:

===========  ==============================  ====================================================
op           request items                   OK reply items
===========  ==============================  ====================================================
SET          key, value                      none
GET          key (blocks until it exists)    value
ADD          key, amount (i64)               new value (i64), stored as ASCII, like TCPStore's
CHECK        keys...                         ``\\x01`` if all exist, else ``\\x00``
WAIT         keys... (blocks)                none
COMPARE_SET  key, expected, desired          the value now stored (TCPStore's rule: an absent
                                             key is set only if ``expected`` is empty, else
                                             ``expected`` comes back)
DELETE       key                             ``\\x01`` if it existed, else ``\\x00``
NUM_KEYS     none                            count (i64)
MULTI_GET    keys... (blocks)                one value per key
MULTI_SET    key, value, key, value...       none
APPEND       key, value                      none
===========  ==============================  ====================================================

Blocking ops wait for the request's timeout (0: no limit). A reply's status is OK, TIMEOUT (a
blocking op ran out of time; the text names the keys still missing) or ERROR (a key over
:data:`MAX_KEY_BYTES`, a value over :data:`MAX_VALUE_BYTES`, a full store, ADD on a value that
is not an integer); the last two carry one UTF-8 text item of at most :data:`MAX_TEXT_BYTES`.
A malformed frame drops the connection.
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
from typing import Callable, Optional, Tuple

from sparkdl._net.frames import (
    FrameAuthError,
    FrameFormatError,
    Shed,
    mismatch_message,
    mode_byte,
    mode_from_byte,
    protection,
    read_greeting,
    read_length_prefixed,
    split_greeting,
)
from sparkdl._net.server import checked_secret, recv_exact

GREETING = b"SPKDLRZ\x02"
#: HKDF label of the frame keys (sparkdl._net.frames).
KEY_LABEL = b"sparkdl-rendezvous v2"
FRAME_MAGIC = b"SDRZ"
NONCE_BYTES = DIGEST_BYTES = 32
#: What the server sends first: greeting, mode, nonce.
GREETING_BYTES = len(GREETING) + 1 + NONCE_BYTES
HEADER = struct.Struct(">4sBBHI")
U32 = struct.Struct(">I")
I64 = struct.Struct(">q")
_LABELS = (b"sparkdl-rendezvous", b"sparkdl-rendezvous client", b"sparkdl-rendezvous server")
MAX_KEY_BYTES = 4096  # torch's keys are short paths (``default_pg/0//cpu//rank_1``)
MAX_VALUE_BYTES = 1 << 20  # gloo's and NCCL's values are addresses and ids
MAX_ITEMS = 4096
MAX_FRAME_BYTES = MAX_VALUE_BYTES + (1 << 16)
MAX_TEXT_BYTES = 4096  # a TIMEOUT or ERROR reply's text


class Op(enum.IntEnum):
    SET, GET, ADD, CHECK, WAIT, COMPARE_SET, DELETE, NUM_KEYS, MULTI_GET, MULTI_SET, APPEND = range(1, 12)


class Status(enum.IntEnum):
    OK, TIMEOUT, ERROR = range(3)


#: Ops that wait server-side for their keys, for the request's timeout.
BLOCKING = frozenset({Op.GET, Op.WAIT, Op.MULTI_GET})
#: Items of a request, by op (others: any number; MULTI_SET: pairs).
REQUEST_ITEMS = {Op.SET: 2, Op.GET: 1, Op.ADD: 2, Op.COMPARE_SET: 3, Op.DELETE: 1, Op.NUM_KEYS: 0, Op.APPEND: 2}
#: Items of an OK reply, by op (others: none; MULTI_GET: one per key).
REPLY_ITEMS = {Op.GET: 1, Op.ADD: 1, Op.CHECK: 1, Op.COMPARE_SET: 1, Op.DELETE: 1, Op.NUM_KEYS: 1}


class WireError(Exception):
    """A peer broke the protocol: its connection is dropped."""


def store_key(secret: bytes) -> bytes:
    """The store's HMAC key, derived from the per-job secret with its own label."""
    return hmac.new(checked_secret(secret), _LABELS[0], hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


@dataclasses.dataclass(frozen=True)
class Handshake:
    """A completed handshake: the store key, both fresh nonces, the client's rank, the agreed
    mode and which side this is (what the frame keys are derived from)."""

    key: bytes = dataclasses.field(repr=False)
    client_nonce: bytes
    server_nonce: bytes
    client_rank: int
    encrypt: bool = False
    server: bool = False


def client_handshake(sock: socket.socket, key: bytes, rank: int, deadline: float, encrypt: bool = False) -> Handshake:
    """Authenticates a new connection, client side. Raises WireError, Shed, TimeoutError, OSError."""
    greeting = split_greeting(read_greeting(sock, GREETING_BYTES, GREETING, deadline), GREETING, NONCE_BYTES)
    if greeting is None:
        raise WireError("the peer is not a sparkdl rendezvous store (bad greeting)")
    theirs, server_nonce = mode_from_byte(greeting[0][0]), greeting[1]
    client_nonce, rank_bytes = secrets.token_bytes(NONCE_BYTES), U32.pack(rank)
    mode = mode_byte(encrypt)
    sock.sendall(rank_bytes + client_nonce + mode + _mac(key, _LABELS[1], server_nonce, client_nonce, rank_bytes, mode))
    if theirs is not encrypt:
        raise WireError(mismatch_message(encrypt, bool(theirs), "rendezvous client", "rendezvous store"))
    proof = recv_exact(sock, DIGEST_BYTES, deadline)
    if len(proof) < DIGEST_BYTES:
        raise Shed("the store hung up during the handshake", proved=True)  # a wrong secret, or dropped late
    if not hmac.compare_digest(proof, _mac(key, _LABELS[2], client_nonce, server_nonce, mode)):
        raise WireError("the store failed to prove the job's secret")
    return Handshake(key, client_nonce, server_nonce, rank, encrypt, server=False)


def server_handshake(
    conn: socket.socket, key: bytes, deadline: float, encrypt: bool = False, verified: Callable[[], None] = lambda: None
) -> Handshake:
    """Authenticates a new connection, server side; calls ``verified()`` once the client proved
    the secret, before proving it back. Raises WireError, TimeoutError, OSError."""
    server_nonce, mode = secrets.token_bytes(NONCE_BYTES), mode_byte(encrypt)
    conn.sendall(GREETING + mode + server_nonce)
    size = U32.size + NONCE_BYTES + 1 + DIGEST_BYTES
    proof = recv_exact(conn, size, deadline)
    if len(proof) < size:
        raise WireError("peer closed the connection during the handshake")
    rank_bytes, client_nonce = proof[:4], proof[4 : 4 + NONCE_BYTES]
    their_mode, digest = proof[4 + NONCE_BYTES : 5 + NONCE_BYTES], proof[5 + NONCE_BYTES :]
    if not hmac.compare_digest(digest, _mac(key, _LABELS[1], server_nonce, client_nonce, rank_bytes, their_mode)):
        raise WireError("authentication failed (wrong secret or not a sparkdl rank)")
    if their_mode != mode:
        raise WireError(mismatch_message(encrypt, not encrypt, "rendezvous store", f"rank {U32.unpack(rank_bytes)[0]}"))
    verified()
    conn.sendall(_mac(key, _LABELS[2], client_nonce, server_nonce, mode))
    return Handshake(key, client_nonce, server_nonce, U32.unpack(rank_bytes)[0], encrypt, server=True)


class Framing:
    """Moves whole frame bodies over one authenticated connection, and nothing else does. Every
    frame is sealed (:mod:`sparkdl._net.frames`: AES-256-GCM, keys from the session's nonces): its
    length is the clear header, the body is encrypted or only authenticated as agreed."""

    def __init__(self, sock: socket.socket, session: Handshake) -> None:
        self.sock, self.session = sock, session
        self._keys = protection(
            session.key, KEY_LABEL, session.server_nonce, session.client_nonce, session.encrypt, server=session.server
        )

    def send(self, body: bytes, timeout_s: Optional[float]) -> None:
        if len(body) > MAX_FRAME_BYTES:
            raise WireError(f"frame of {len(body)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
        self.sock.settimeout(timeout_s)
        self.sock.sendall(self._keys.sealer.seal(U32.pack(len(body)), body))

    def recv(self, deadline: Optional[float], idle_s: Optional[float] = None) -> Optional[bytes]:
        """One verified body (None on EOF at a frame boundary) before ``deadline``; with
        ``idle_s``, the first byte may take any time (between requests) and the rest must follow
        within it. Raises WireError (truncated, oversized, not authentic), TimeoutError."""
        if idle_s is not None:
            self.sock.settimeout(None)
            head = self.sock.recv(U32.size)
            deadline = time.monotonic() + idle_s
            if head and len(head) < U32.size:
                head += recv_exact(self.sock, U32.size - len(head), deadline)
        else:
            if deadline is None:
                self.sock.settimeout(None)
            head = recv_exact(self.sock, U32.size, deadline)
        if not head:
            return None
        try:
            return read_length_prefixed(self.sock, self._keys.opener, head, MAX_FRAME_BYTES, deadline)
        except (FrameFormatError, FrameAuthError) as exc:
            raise WireError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class Message:
    op: int
    status: int = Status.OK
    items: Tuple[bytes, ...] = ()
    timeout_ms: int = 0


def encode(message: Message) -> bytes:
    """A frame body. Raises ValueError for fields out of range."""
    try:
        head = HEADER.pack(FRAME_MAGIC, message.op, message.status, len(message.items), message.timeout_ms)
    except struct.error as exc:
        raise ValueError(f"bad message: {exc}") from None
    return head + b"".join(U32.pack(len(item)) + item for item in message.items)


def decode(body: bytes) -> Message:
    """Parses a frame body. Raises WireError for anything malformed."""
    if len(body) < HEADER.size:
        raise WireError(f"truncated header ({len(body)} of {HEADER.size} bytes)")
    magic, op, status, count, timeout_ms = HEADER.unpack_from(body)
    if (
        magic != FRAME_MAGIC
        or op not in Op._value2member_map_
        or status not in Status._value2member_map_
        or count > MAX_ITEMS
    ):
        raise WireError(f"bad header (magic {magic!r}, op {op}, status {status}, {count} items)")
    items, offset = [], HEADER.size
    for _ in range(count):
        if len(body) - offset < U32.size or U32.unpack_from(body, offset)[0] > len(body) - offset - U32.size:
            raise WireError("an item overruns the frame")
        length = U32.unpack_from(body, offset)[0]
        items.append(body[offset + U32.size : offset + U32.size + length])
        offset += U32.size + length
    if offset != len(body):
        raise WireError(f"{len(body) - offset} bytes after the last item")
    return Message(op, status, tuple(items), timeout_ms)
