"""Per-connection frame protection for sparkdl's own servers (progress channel, parameter server).

Both protocols authenticate a connection with an HMAC handshake over the per-job secret, in
which each side contributes a fresh 32-byte nonce. This module turns that handshake into
per-frame protection for everything that follows, with AES-256-GCM:

* **Keys.** Two 32-byte keys per connection, one per direction, from HKDF-SHA256 with the
  per-job secret as input keying material, ``server_nonce || client_nonce`` as salt and
  ``label || b" " || mode || b" " || direction`` as info, where ``label`` names the protocol
  (``b"sparkdl-channel v2"``, ``b"sparkdl-ps v2"``), ``mode`` is ``b"encrypt"`` or
  ``b"integrity"`` and ``direction`` is ``b"client->server"`` or ``b"server->client"``. Fresh
  nonces make the keys of every connection new, so a frame recorded on one connection (or in one
  direction, protocol or mode) fails the tag check anywhere else.
* **Nonces.** The 96-bit GCM nonce of a frame is its index in its direction (big-endian, the
  first frame is 0). It is never sent: both sides count, so a replayed, dropped, reordered or
  injected frame is verified under the wrong nonce and fails. A counter is never reused (a
  direction refuses to go past ``2**96 - 1`` frames).
* **Frames.** A frame is ``header || body || tag`` (16-byte tag). The header is whatever the
  protocol sends in clear to delimit the frame (the channel's 4-byte length, the parameter
  server's 36-byte header); the body has exactly the payload's length. One code path, two modes:

  - ``encrypt=True``: the body is the payload, AES-256-GCM encrypted; the header is the
    associated data.
  - ``encrypt=False`` (integrity only): the body is the payload in clear; header and payload
    are both associated data (GCM with nothing to encrypt, i.e. GMAC).

  Every frame is integrity-checked in both modes: a flipped bit anywhere in header, body or tag
  makes the receiver raise :class:`FrameAuthError`.

A receiver necessarily reads a header before it can check it (the header says how long the
frame is), so protocols only sanity-check a header against fixed expectations and choose a
buffer with it; nothing in a frame is *acted on* before :meth:`OpeningFrame.finalize` passes.
When a frame fails, the buffer it was received into holds unverified bytes: the server drops
the connection, the client raises, and neither uses them.

A server sheds unauthenticated connections under a flood (:mod:`sparkdl._net.server`: the oldest
pending go first), so every client connects through :func:`connect_retrying`: a server that hangs
up before its greeting (:func:`read_greeting` raises :class:`Shed`) is tried again with backoff
within the client's timeout, and giving up names what happened (no answer, or closed each time),
never "bad greeting", which stays for a peer that answers in another protocol.

The streaming ``Cipher(AES(key), GCM(nonce))`` API is used so large payloads are processed in
place: sending in integrity mode reads the caller's buffer twice (GMAC, send) and copies
nothing; sending encrypted writes ciphertext through a reusable scratch buffer; receiving
decrypts (or authenticates) the bytes in the very buffer they were received into.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import struct
import time
from typing import Callable, Optional, Tuple, TypeVar, Union

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from sparkdl._net.server import close_quietly, format_peer, recv_exact

__all__ = [
    "KEY_BYTES",
    "MODE_ENCRYPT",
    "MODE_INTEGRITY",
    "TAG_BYTES",
    "FrameAuthError",
    "FrameOpener",
    "FrameProtection",
    "FrameSealer",
    "HandshakeFailed",
    "OpeningFrame",
    "SealingFrame",
    "Shed",
    "connect_retrying",
    "derive_keys",
    "mismatch_message",
    "mode_byte",
    "mode_from_byte",
    "protection",
    "read_greeting",
]

Buffer = Union[bytes, bytearray, memoryview]

TAG_BYTES = 16
KEY_BYTES = 32
_GCM_NONCE_BYTES = 12
_MAX_COUNTER = (1 << (8 * _GCM_NONCE_BYTES)) - 1
#: Handshake byte announcing a side's mode.
MODE_INTEGRITY = 0
MODE_ENCRYPT = 1
_MODE_NAMES = {False: b"integrity", True: b"encrypt"}
_CLIENT_TO_SERVER = b"client->server"
_SERVER_TO_CLIENT = b"server->client"
#: Encrypted sends go through a scratch buffer of at most this size (cache-sized chunks).
SEAL_CHUNK_BYTES = 256 << 10
#: A client's connect-and-handshake retries (:func:`connect_retrying`): first pause, longest
#: pause, and retries of a server that hung up after this side proved the secret.
RETRY_FIRST_S, RETRY_MAX_S, RETRIES_AFTER_PROOF = 0.02, 0.5, 2
T = TypeVar("T")


class FrameAuthError(Exception):
    """A frame failed its integrity check: it was altered, replayed, reordered, dropped, or sealed
    for another connection, direction or key. The connection cannot be trusted any more."""


def mode_byte(encrypt: bool) -> bytes:
    """The one handshake byte announcing ``encrypt``."""
    return bytes([MODE_ENCRYPT if encrypt else MODE_INTEGRITY])


def mode_from_byte(value: int) -> Optional[bool]:
    """``encrypt`` from a handshake mode byte; None for an unknown value."""
    if value == MODE_ENCRYPT:
        return True
    if value == MODE_INTEGRITY:
        return False
    return None


def mismatch_message(ours: bool, theirs: bool, us: str, them: str) -> str:
    """The error for two sides that disagree about encryption."""
    return (
        f"encryption mismatch: this {us} has encrypt={ours} but the {them} has encrypt={theirs}; "
        "both sides of a connection must use the same setting (sparkdl turns encryption on when "
        "Spark's own traffic is encrypted: spark.network.crypto.enabled or spark.ssl.enabled)"
    )


def derive_keys(
    secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes, encrypt: bool
) -> Tuple[bytes, bytes]:
    """The connection's ``(client_to_server_key, server_to_client_key)`` (see the module docs)."""
    salt = bytes(server_nonce) + bytes(client_nonce)
    keys = []
    for direction in (_CLIENT_TO_SERVER, _SERVER_TO_CLIENT):
        info = b" ".join((label, _MODE_NAMES[bool(encrypt)], direction))
        keys.append(HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(bytes(secret)))
    return keys[0], keys[1]


class _Direction:
    """The key and frame counter of one direction of one connection."""

    def __init__(self, key: bytes, encrypt: bool) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes")
        self._algorithm = algorithms.AES(key)
        self.encrypt = bool(encrypt)
        self._counter = 0
        self._failed = False

    @property
    def frames(self) -> int:
        """Frames begun in this direction so far (the next frame's counter)."""
        return self._counter

    def _next_nonce(self) -> bytes:
        if self._failed:
            raise FrameAuthError("an earlier frame on this connection failed its integrity check")
        if self._counter > _MAX_COUNTER:  # pragma: no cover - 2**96 frames
            raise FrameAuthError("frame counter exhausted; the connection must be re-established")
        nonce = self._counter.to_bytes(_GCM_NONCE_BYTES, "big")
        self._counter += 1
        return nonce


class SealingFrame:
    """One outgoing frame: feed the payload with :meth:`update` and send what it returns, piece
    by piece, then send :meth:`finalize`'s tag."""

    __slots__ = ("_ctx", "_encrypt")

    def __init__(self, ctx, encrypt: bool, header: Buffer) -> None:  # type: ignore[no-untyped-def]
        self._ctx = ctx
        self._encrypt = encrypt
        ctx.authenticate_additional_data(header)

    def update(self, data: Buffer, out: Optional[memoryview] = None) -> Buffer:
        """Processes the next payload piece; returns the bytes to send for it: the ciphertext
        (written into ``out`` when given) in encrypt mode, ``data`` itself (now authenticated)
        in integrity mode."""
        if not self._encrypt:
            self._ctx.authenticate_additional_data(data)
            return data
        if out is None:
            return self._ctx.update(data)
        count = self._ctx.update_into(data, out)
        return out[:count]

    def finalize(self) -> bytes:
        """The frame's tag (TAG_BYTES), sent right after the body."""
        self._ctx.finalize()
        return self._ctx.tag


class OpeningFrame:
    """One incoming frame: pass each received piece of the body to :meth:`update_into`, then the
    tag to :meth:`finalize`. Until finalize passes, what the buffer holds is unverified."""

    __slots__ = ("_ctx", "_encrypt", "_direction")

    def __init__(self, ctx, encrypt: bool, header: Buffer, direction: _Direction) -> None:  # type: ignore[no-untyped-def]
        self._ctx = ctx
        self._encrypt = encrypt
        self._direction = direction
        ctx.authenticate_additional_data(header)

    def update_into(self, view: memoryview) -> None:
        """Processes received body bytes in place: decrypts them (encrypt mode) or authenticates
        them (integrity mode, where they stay as they are)."""
        if not len(view):
            return
        if self._encrypt:
            self._ctx.update_into(view, view)
        else:
            self._ctx.authenticate_additional_data(view)

    def finalize(self, tag: Buffer) -> None:
        """Checks the tag.

        Raises:
            FrameAuthError: the frame is not authentic; the direction refuses further frames.
        """
        if len(tag) != TAG_BYTES:
            self._direction._failed = True
            raise FrameAuthError(f"truncated frame tag ({len(tag)} of {TAG_BYTES} bytes)")
        try:
            self._ctx.finalize_with_tag(bytes(tag))
        except InvalidTag:
            self._direction._failed = True
            raise FrameAuthError(
                "frame failed its integrity check (altered, replayed, reordered, or sealed for "
                "another connection or with another secret)"
            ) from None


class FrameSealer(_Direction):
    """The sending direction of a connection. Not thread-safe: callers serialize frames (the
    counter order must be the order on the wire)."""

    def __init__(self, key: bytes, encrypt: bool) -> None:
        super().__init__(key, encrypt)
        self._scratch: Optional[memoryview] = None

    def begin(self, header: Buffer) -> SealingFrame:
        ctx = Cipher(self._algorithm, modes.GCM(self._next_nonce())).encryptor()
        return SealingFrame(ctx, self.encrypt, header)

    def scratch(self) -> memoryview:
        """A reusable buffer of SEAL_CHUNK_BYTES for ciphertext chunks (allocated on first use)."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(SEAL_CHUNK_BYTES))
        return self._scratch

    def seal(self, header: Buffer, payload: Buffer = b"") -> bytes:
        """A small frame in one piece: ``header || body || tag``."""
        frame = self.begin(header)
        body = frame.update(payload)
        return b"".join((bytes(header), bytes(body), frame.finalize()))


class FrameOpener(_Direction):
    """The receiving direction of a connection. Not thread-safe (one reader per connection)."""

    def begin(self, header: Buffer) -> OpeningFrame:
        ctx = Cipher(self._algorithm, modes.GCM(self._next_nonce())).decryptor()
        return OpeningFrame(ctx, self.encrypt, header, self)

    def open(self, header: Buffer, body: Buffer, tag: Buffer) -> bytes:
        """Verifies a small frame received in one piece; returns its payload.

        Raises:
            FrameAuthError: the frame is not authentic.
        """
        buffer = bytearray(body)
        frame = self.begin(header)
        frame.update_into(memoryview(buffer))
        frame.finalize(tag)
        return bytes(buffer)


@dataclasses.dataclass
class FrameProtection:
    """Both directions of one connection, from one side's point of view."""

    sealer: FrameSealer
    opener: FrameOpener

    @property
    def encrypt(self) -> bool:
        return self.sealer.encrypt


def split_greeting(greeting: bytes, magic: bytes, nonce_bytes: int = 32) -> Optional[Tuple[bytes, bytes]]:
    """(mode byte, server nonce) of a server's first words, ``magic + mode + nonce``; None when
    they are not that (another protocol, a truncated greeting)."""
    if len(greeting) != len(magic) + 1 + nonce_bytes or not greeting.startswith(magic):
        return None
    return greeting[len(magic) : len(magic) + 1], greeting[len(magic) + 1 :]


#: The clear header of a length-prefixed frame (the channel's and the rendezvous store's).
LENGTH = struct.Struct(">I")


class FrameFormatError(Exception):
    """A length-prefixed frame is truncated or over its cap."""


def read_length_prefixed(
    sock: socket.socket, opener: FrameOpener, head: bytes, max_bytes: int, deadline: Optional[float]
) -> bytes:
    """The verified payload of a length-prefixed sealed frame whose 4-byte ``head`` was read.

    Raises:
        FrameFormatError: truncated, or longer than ``max_bytes``.
        FrameAuthError: the frame is not authentic.
    """
    if len(head) < LENGTH.size:
        raise FrameFormatError("truncated frame header")
    (length,) = LENGTH.unpack(head)
    if length > max_bytes:
        raise FrameFormatError(f"frame of {length} bytes exceeds the limit of {max_bytes} bytes")
    sealed = recv_exact(sock, length + TAG_BYTES, deadline)
    if len(sealed) < length + TAG_BYTES:
        raise FrameFormatError(f"truncated frame ({len(sealed)} of {length + TAG_BYTES} bytes)")
    return opener.open(head, memoryview(sealed)[:length], memoryview(sealed)[length:])


def protection(
    secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes, encrypt: bool, *, server: bool
) -> FrameProtection:
    """The frame protection of one side (``server`` or client) of a freshly authenticated connection."""
    to_server, to_client = derive_keys(secret, label, server_nonce, client_nonce, encrypt)
    if server:
        return FrameProtection(FrameSealer(to_client, encrypt), FrameOpener(to_server, encrypt))
    return FrameProtection(FrameSealer(to_server, encrypt), FrameOpener(to_client, encrypt))


# ---- a client's handshake under a flood: the servers shed idle peers, clients retry -------


class Shed(ConnectionError):
    """The server hung up on a new connection during the handshake: before its greeting (it
    dropped us unserved, e.g. while shedding a flood: retry) or, ``proved``, after this side
    proved the secret (a wrong secret, or dropped late: retried a few times)."""

    def __init__(self, message: str, proved: bool = False) -> None:
        super().__init__(message)
        self.proved = proved


class HandshakeFailed(Exception):
    """:func:`connect_retrying` gave up; the message says why, for the caller's own error."""


def read_greeting(sock: socket.socket, size: int, magic: bytes, deadline: float) -> bytes:
    """A server's first ``size`` bytes. Raises :class:`Shed` when it hangs up before they stop
    looking like ``magic`` (a sparkdl server dropping us); a foreign greeting is returned as it
    came, for the caller to refuse."""
    try:
        data = recv_exact(sock, size, deadline)
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
        raise Shed(f"the server reset the connection before its greeting ({exc})") from None
    if len(data) < size and (magic.startswith(data) or data.startswith(magic)):
        raise Shed("the server closed the connection before its greeting")
    return data


def connect_retrying(
    address: Tuple[str, int], timeout_s: float, attempt: Callable[[socket.socket, float], T], what: str
) -> Tuple[socket.socket, T]:
    """Connects and runs ``attempt(sock, deadline)`` (a client handshake) until it succeeds,
    retrying with backoff while the server sheds the connection (:class:`Shed`), all within
    ``timeout_s``. Returns the socket (timeout still set) and what ``attempt`` returned.

    Raises:
        OSError: cannot connect at all (refused, unreachable).
        HandshakeFailed: out of time, or hung up on again after proving the secret; names
            ``what`` (e.g. "the driver's channel server") and the address.
        Whatever else ``attempt`` raises (a protocol error: not retried).
    """
    where, start = format_peer(tuple(address)), time.monotonic()
    deadline, pause = start + timeout_s, RETRY_FIRST_S
    tries = late = 0
    last = "no answer"
    while True:
        tries += 1
        try:
            sock = socket.create_connection(tuple(address), timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            if tries == 1:
                raise
            raise HandshakeFailed(
                f"{what} at {where}: no connection within {timeout_s:g} s ({tries} attempts; last: {last})"
            ) from None
        try:
            return sock, attempt(sock, deadline)
        except Shed as exc:
            close_quietly(sock)
            shed = exc
        except ConnectionError as exc:  # reset or broken pipe past the greeting
            close_quietly(sock)
            shed = Shed(str(exc), proved=True)
        except TimeoutError:
            close_quietly(sock)
            raise HandshakeFailed(
                f"{what} at {where} did not complete the handshake within {timeout_s:g} s ({tries} attempt{'s' * (tries > 1)}; "
                f"last: {last}); it may be flooded by other connections"
            ) from None
        except OSError as exc:
            close_quietly(sock)
            raise HandshakeFailed(f"the handshake with {what} at {where} failed: {exc}") from exc
        except BaseException:
            close_quietly(sock)
            raise
        last = str(shed)
        late += shed.proved
        if late > RETRIES_AFTER_PROOF:
            raise HandshakeFailed(
                f"{what} at {where} hung up after this side proved the job's secret, {late} times (wrong secret?): {shed}"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeFailed(
                f"{what} at {where} did not complete the handshake within {timeout_s:g} s ({tries} attempts, each closed by "
                f"the server; last: {last}); it may be flooded by other connections"
            )
        time.sleep(min(left, pause * random.uniform(0.5, 1.0)))  # a pause, not synchronization
        pause = min(pause * 2, RETRY_MAX_S)
