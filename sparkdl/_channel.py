"""Authenticated one-way message channel from Spark tasks to the driver.

Each task (rank) opens a :class:`ChannelClient` to the :class:`ChannelServer` that runs in the
driver and streams small JSON objects (progress, log lines, failures, "done") while the job runs.

Wire protocol (all integers big-endian):

1. server -> client: ``MAGIC`` (8 bytes) + a fresh 32-byte nonce.
2. client -> server: HMAC-SHA256(secret, nonce) (32 bytes), then the frame
   ``{"kind": "hello", "rank": <int>}``.
3. server -> client: the frame ``{"kind": "ready", "max_message_bytes": <int>}``. It is the only
   thing the server ever sends; it lets the client constructor fail on a wrong secret instead of
   the loss surfacing one message later.
4. client -> server: frames until ``{"kind": "bye"}`` (clean end) or EOF (the task died).

A frame is a 4-byte unsigned length followed by that many bytes of UTF-8 JSON holding an object.
Nothing is ever unpickled: peers can reach the port, so the payload format must not be code.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable

from sparkdl._tcpserver import ThreadedServer, checked_secret
from sparkdl._tcpserver import close_quietly as _close_quietly
from sparkdl._tcpserver import shutdown_quietly as _shutdown_quietly

__all__ = ["MAX_MESSAGE_BYTES", "ChannelClient", "ChannelError", "ChannelServer", "new_secret"]

logger = logging.getLogger("sparkdl.channel")

MAX_MESSAGE_BYTES: int = 1 << 20
MAGIC = b"SPKDLv1\0"
_NONCE_BYTES = 32
_DIGEST_BYTES = 32
_HEADER = struct.Struct(">I")
# Handshake frames are tiny; a low cap keeps a peer from making us buffer much before it is known.
_MAX_CONTROL_BYTES = 4096
_HELLO, _READY, _BYE = "hello", "ready", "bye"
_RESERVED_KINDS = frozenset({_HELLO, _READY, _BYE})

Message = dict[str, Any]


class ChannelError(Exception):
    """The channel could not be established, or is no longer usable, from the client's side."""


class _ProtocolError(Exception):
    """A peer broke the wire protocol; the server drops the connection."""


def new_secret() -> bytes:
    """Returns a fresh random per-job secret (32 bytes) shared by the driver and its tasks."""
    return secrets.token_bytes(32)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Reads ``n`` bytes, fewer if the peer closes first; TimeoutError once past ``deadline``."""
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        if deadline is not None:
            # A per-recv timeout alone would let a peer trickle one byte at a time forever.
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        chunk = sock.recv(min(remaining, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _encode_frame(message: Message, max_bytes: int) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(payload) > max_bytes:
        raise ChannelError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
    return _HEADER.pack(len(payload)) + payload


def _read_frame(
    sock: socket.socket, max_bytes: int, deadline: float | None = None
) -> Message | None:
    """Reads one frame; returns None on EOF at a frame boundary, raises _ProtocolError otherwise."""
    header = _recv_exact(sock, _HEADER.size, deadline)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise _ProtocolError("truncated frame header")
    (length,) = _HEADER.unpack(header)
    if length > max_bytes:
        raise _ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes} bytes")
    payload = _recv_exact(sock, length, deadline)
    if len(payload) < length:
        raise _ProtocolError(f"truncated frame ({len(payload)} of {length} bytes)")
    try:
        # Explicit strict UTF-8: json.loads(bytes) would also guess UTF-16/32.
        message = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: deeply nested arrays
        raise _ProtocolError(f"payload is not valid UTF-8 JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise _ProtocolError(f"payload is a JSON {type(message).__name__}, not an object")
    return message


class ChannelServer(ThreadedServer):
    """Driver-side endpoint: accepts authenticated task connections and hands messages to callbacks.

    Callbacks run on per-connection threads; they must be thread-safe and should return quickly.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        on_message: Callable[[int, Message], None],
        on_disconnect: Callable[[int, bool], None] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        handshake_timeout: float = 10.0,
    ) -> None:
        """Binds to an ephemeral port on ``host`` and starts accepting in a daemon thread.

        Args:
            host: address to bind; only this interface is listened on.
            secret: per-job secret that every client must prove it knows.
            on_message: called as ``on_message(rank, message)`` for every application message.
            on_disconnect: called once as ``on_disconnect(rank, clean)`` when an authenticated
                connection ends; ``clean`` is False when the peer vanished without saying bye.
            max_message_bytes: largest accepted JSON payload; bigger frames drop the connection.
            handshake_timeout: seconds a new peer has to authenticate and say hello.

        Raises:
            ValueError: if ``secret`` is empty or a limit is not positive.
            OSError: if ``host`` cannot be bound.
        """
        self._secret = checked_secret(secret)
        if max_message_bytes <= 0 or handshake_timeout <= 0:
            raise ValueError("max_message_bytes and handshake_timeout must be positive")
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self._max_message_bytes = max_message_bytes
        self._handshake_timeout = handshake_timeout
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        listener = socket.create_server((host, 0), family=family)
        self._address: tuple[str, int] = listener.getsockname()[:2]
        super().__init__(listener, "sparkdl-channel", logger)

    @property
    def address(self) -> tuple[str, int]:
        """The ``(host, port)`` clients should connect to."""
        return self._address

    def close(self) -> None:
        """Stops accepting, drops every connection and waits (bounded) for server threads.

        Connections ended this way do not trigger ``on_disconnect``. Safe to call more than once,
        including from a callback.
        """
        super().close()

    def __enter__(self) -> ChannelServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _handshake(self, conn: socket.socket) -> int:
        deadline = time.monotonic() + self._handshake_timeout
        nonce = secrets.token_bytes(_NONCE_BYTES)
        try:
            conn.settimeout(self._handshake_timeout)
            conn.sendall(MAGIC + nonce)
            digest = _recv_exact(conn, _DIGEST_BYTES, deadline)
            if len(digest) < _DIGEST_BYTES:
                raise _ProtocolError("peer closed the connection during the handshake")
            expected = hmac.new(self._secret, nonce, hashlib.sha256).digest()
            if not hmac.compare_digest(digest, expected):
                raise _ProtocolError("authentication failed (wrong secret or not a sparkdl client)")
            # Parse nothing from a peer before it has authenticated.
            hello = _read_frame(conn, _MAX_CONTROL_BYTES, deadline)
        except TimeoutError:
            limit = self._handshake_timeout
            raise _ProtocolError(f"handshake not completed within {limit}s") from None
        rank = hello.get("rank") if hello is not None else None
        if hello is None or hello.get("kind") != _HELLO or type(rank) is not int or rank < 0:
            raise _ProtocolError("missing or invalid hello frame")
        ready = {"kind": _READY, "max_message_bytes": self._max_message_bytes}
        conn.sendall(_encode_frame(ready, _MAX_CONTROL_BYTES))
        conn.settimeout(None)  # tasks may stay quiet for a long time; close() unblocks via shutdown
        return rank

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        rank: int | None = None
        clean = False
        try:
            rank = self._handshake(conn)
            while True:
                message = _read_frame(conn, self._max_message_bytes)
                if message is None:
                    if not self._closed.is_set():
                        logger.warning(
                            "channel: rank %d (%s) disconnected without saying bye", rank, peer
                        )
                    break
                kind = message.get("kind")
                if kind == _BYE:
                    clean = True
                    break
                if isinstance(kind, str) and kind in _RESERVED_KINDS:
                    raise _ProtocolError(f"unexpected {kind!r} frame after the handshake")
                try:
                    self._on_message(rank, message)
                except Exception:
                    logger.exception("channel: on_message callback failed for rank %d", rank)
        except (_ProtocolError, OSError) as exc:
            if not self._closed.is_set():
                who = f"rank {rank}" if rank is not None else "unauthenticated peer"
                logger.warning("channel: dropping %s (%s): %s", who, peer, exc)
        finally:
            self._forget_connection(conn)
            if rank is not None and self._on_disconnect is not None and not self._closed.is_set():
                try:
                    self._on_disconnect(rank, clean)
                except Exception:
                    logger.exception("channel: on_disconnect callback failed for rank %d", rank)
            self._release()


class ChannelClient:
    """Task-side endpoint: one authenticated connection that sends JSON objects to the driver."""

    def __init__(
        self, address: tuple[str, int], secret: bytes, rank: int, timeout: float = 10.0
    ) -> None:
        """Connects and completes the handshake.

        Args:
            address: the server's ``(host, port)``.
            secret: the per-job secret the server was created with.
            rank: this task's rank, attached by the server to every message.
            timeout: seconds allowed for connecting, for the handshake and for each send.

        Raises:
            ValueError: if ``rank`` is not a non-negative int.
            ChannelError: if the server is unreachable, is not a channel server, or rejects us.
        """
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self._timeout = timeout
        self._lock = threading.Lock()
        self._closed = False
        try:
            sock = socket.create_connection(tuple(address), timeout=timeout)
        except OSError as exc:
            raise ChannelError(f"cannot connect to the channel server at {address}: {exc}") from exc
        try:
            deadline = time.monotonic() + timeout
            self._max_message_bytes = self._handshake(sock, secret, rank, deadline)
        except BaseException:
            _close_quietly(sock)
            raise
        sock.settimeout(timeout)
        self._sock = sock

    @staticmethod
    def _handshake(sock: socket.socket, secret: bytes, rank: int, deadline: float) -> int:
        try:
            greeting = _recv_exact(sock, len(MAGIC) + _NONCE_BYTES, deadline)
            if len(greeting) < len(MAGIC) + _NONCE_BYTES or not greeting.startswith(MAGIC):
                raise ChannelError("the peer is not a sparkdl channel server (bad greeting)")
            digest = hmac.new(secret, greeting[len(MAGIC) :], hashlib.sha256).digest()
            sock.sendall(digest + _encode_frame({"kind": _HELLO, "rank": rank}, _MAX_CONTROL_BYTES))
            ready = _read_frame(sock, _MAX_CONTROL_BYTES, deadline)
        except _ProtocolError as exc:
            raise ChannelError(f"channel handshake failed: {exc}") from None
        except OSError as exc:  # includes the reset a server sends when it rejects our secret
            raise ChannelError(f"channel handshake failed (wrong secret?): {exc}") from exc
        if ready is None:
            raise ChannelError("the server hung up during the handshake (wrong secret?)")
        limit = ready.get("max_message_bytes")
        if ready.get("kind") != _READY or type(limit) is not int or limit <= 0:
            raise ChannelError("the server sent an invalid ready frame")
        return limit

    def send(self, message: Message) -> None:
        """Sends one JSON object to the driver. Thread-safe.

        Args:
            message: a JSON-serializable dict; its ``kind`` must not be hello, ready or bye.

        Raises:
            TypeError: if ``message`` is not a dict or not JSON-serializable.
            ValueError: if ``message`` uses a reserved kind or cannot be encoded as JSON.
            ChannelError: if the message is too large or the connection is closed or broken.
        """
        if not isinstance(message, dict):
            raise TypeError(f"message must be a dict, got {type(message).__name__}")
        kind = message.get("kind")
        if isinstance(kind, str) and kind in _RESERVED_KINDS:
            raise ValueError(f"message kind {kind!r} is reserved for the channel protocol")
        frame = _encode_frame(message, self._max_message_bytes)
        with self._lock:
            if self._closed:
                raise ChannelError("the channel is closed")
            try:
                self._check_server_alive()
                self._sock.sendall(frame)
            except OSError as exc:
                # A partial write leaves the stream mid-frame, so the connection cannot be reused.
                self._closed = True
                _close_quietly(self._sock)
                raise ChannelError(f"the channel to the driver is broken: {exc}") from exc

    def _check_server_alive(self) -> None:
        # The server never sends after the handshake, so anything readable means EOF or reset.
        # Without this check the first send after the server went away would succeed silently.
        self._sock.setblocking(False)
        try:
            self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        finally:
            self._sock.settimeout(self._timeout)
        raise ConnectionAbortedError("the server closed the connection")

    def close(self) -> None:
        """Says bye (a clean end for the driver) and closes. Idempotent; never raises."""
        # Bounded: a send stuck on a dead server must not make close() hang for longer.
        acquired = self._lock.acquire(timeout=self._timeout)
        try:
            if self._closed:
                return
            self._closed = True
            if acquired:  # otherwise another thread is mid-frame and a bye would corrupt the stream
                try:
                    self._sock.sendall(_encode_frame({"kind": _BYE}, _MAX_CONTROL_BYTES))
                except (OSError, ChannelError):
                    pass
            else:
                _shutdown_quietly(self._sock)
            _close_quietly(self._sock)
        finally:
            if acquired:
                self._lock.release()

    def __enter__(self) -> ChannelClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
