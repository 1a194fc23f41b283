"""Authenticated, integrity-protected (optionally encrypted) channel from Spark tasks to the driver.

Each task (rank) opens a :class:`ChannelClient` to the :class:`ChannelServer` that runs in the
driver and streams small JSON objects (progress, log lines, failures, "done") while the job runs.

Wire protocol, version 2 (all integers big-endian; ``H`` = HMAC-SHA256 keyed with the per-job
secret; ``mode`` = one byte, 1 when the side encrypts, 0 when it only integrity-protects):

1. server -> client: ``MAGIC`` (8 bytes, ``b"SPKDLv2\\0"``) + the server's ``mode`` (1) + a fresh
   ``server_nonce`` (32).
2. client -> server: a fresh ``client_nonce`` (32) + the client's ``mode`` (1) +
   ``H(b"sparkdl-channel client" + server_nonce + client_nonce + mode)`` (32). A client whose
   mode differs from the server's still sends this (so the server can log why) and then fails
   with an "encryption mismatch" :class:`ChannelError`; the server checks the proof first and
   then drops a mismatched client with the same message. Nothing is parsed before the proof
   checks out, and all of steps 2-3 must happen within the handshake timeout.
3. Both sides derive the connection's keys (:mod:`sparkdl._net.frames`: HKDF-SHA256 over the secret,
   salt ``server_nonce + client_nonce``, label ``b"sparkdl-channel v2"``, one key per direction)
   and from here on every frame, both ways, is a sealed frame. client -> server:
   ``{"kind": "hello", "rank": <int>}`` (at most 4096 bytes).
4. server -> client: ``{"kind": "ready", "max_message_bytes": <int>}``. It is the only frame the
   server ever sends; it lets the client constructor fail on a wrong secret instead of the loss
   surfacing one message later, and, since only a holder of the secret can seal it, it also
   authenticates the server to the client.
5. client -> server: frames until ``{"kind": "bye"}`` (clean end) or EOF (the task died).

A sealed frame is a 4-byte unsigned payload length ``L``, then ``L`` body bytes, then a 16-byte
AES-256-GCM tag. The nonce is the frame's index in its direction (0, 1, ...; never sent). With
``encrypt=True`` the body is the encrypted payload and the length is associated data; with
``encrypt=False`` the body is the payload in clear and length and payload are both associated
data. A frame that fails its tag (altered, replayed, reordered, dropped, from another
connection) makes the server drop the connection (an unclean disconnect) and the client raise.
The payload is UTF-8 JSON holding an object; the length is checked against the limit before the
body is read. Nothing is ever unpickled: peers can reach the port, so the payload format must not
be code.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from typing import Any, Callable

from sparkdl._net.channel_wire import (
    BYE,
    CLIENT_PROOF_BYTES,
    GREETING_BYTES,
    HELLO,
    KEY_LABEL,
    MAGIC,
    MAX_CONTROL_BYTES,
    NONCE_BYTES,
    READY,
    RESERVED_KINDS,
    ChannelError,
    Message,
    ProtocolError,
    client_proof,
    encode_payload,
    read_frame,
    seal,
)
from sparkdl._net.frames import (
    FrameProtection,
    HandshakeFailed,
    Shed,
    connect_retrying,
    mismatch_message,
    mode_byte,
    mode_from_byte,
    protection,
    read_greeting,
    split_greeting,
)
from sparkdl._net.server import HANDSHAKE_S, ThreadedServer, checked_secret, recv_exact
from sparkdl._net.server import close_quietly as _close_quietly
from sparkdl._net.server import shutdown_quietly as _shutdown_quietly

__all__ = ["MAX_MESSAGE_BYTES", "ChannelClient", "ChannelError", "ChannelServer", "new_secret"]

logger = logging.getLogger("sparkdl.channel")

MAX_MESSAGE_BYTES: int = 1 << 20


def new_secret() -> bytes:
    """Returns a fresh random per-job secret (32 bytes) shared by the driver and its tasks."""
    return secrets.token_bytes(32)


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
        handshake_timeout: float = HANDSHAKE_S,
        encrypt: bool = False,
        report_lost_ranks: bool = True,
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
            encrypt: encrypt every frame (otherwise frames are integrity-protected only);
                clients must use the same setting or they are refused at the handshake.
            report_lost_ranks: warn when a rank vanishes without saying bye; False logs it at
                debug level (the launcher's monitor judges those disconnects and its error
                names the one that matters).

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
        self._encrypt = bool(encrypt)
        self._report_lost_ranks = report_lost_ranks
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

    @property
    def encrypt(self) -> bool:
        """Whether this server's connections are encrypted (always integrity-protected)."""
        return self._encrypt

    def _handshake(self, conn: socket.socket) -> tuple[int, FrameProtection]:
        deadline = time.monotonic() + self._handshake_timeout
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        mode = mode_byte(self._encrypt)
        try:
            conn.settimeout(self._handshake_timeout)
            conn.sendall(MAGIC + mode + server_nonce)
            proof = recv_exact(conn, CLIENT_PROOF_BYTES, deadline)
            if len(proof) < CLIENT_PROOF_BYTES:
                raise ProtocolError("peer closed the connection during the handshake")
            client_nonce = proof[:NONCE_BYTES]
            client_mode = proof[NONCE_BYTES : NONCE_BYTES + 1]
            digest = proof[NONCE_BYTES + 1 :]
            expected = client_proof(self._secret, server_nonce, client_nonce, client_mode)
            if not hmac.compare_digest(digest, expected):
                raise ProtocolError("authentication failed (wrong secret or not a sparkdl client)")
            # Parse nothing from a peer before it has authenticated.
            theirs = mode_from_byte(client_mode[0])
            if theirs is None:
                raise ProtocolError(f"unknown frame protection mode {client_mode[0]}")
            if theirs != self._encrypt:
                raise ProtocolError(mismatch_message(self._encrypt, theirs, "channel server", "client"))
            keys = protection(self._secret, KEY_LABEL, server_nonce, client_nonce, self._encrypt, server=True)
            hello = read_frame(conn, keys.opener, MAX_CONTROL_BYTES, deadline)
        except TimeoutError:
            limit = self._handshake_timeout
            raise ProtocolError(f"handshake not completed within {limit}s") from None
        rank = hello.get("rank") if hello is not None else None
        if hello is None or hello.get("kind") != HELLO or type(rank) is not int or rank < 0:
            raise ProtocolError("missing or invalid hello frame")
        # Before "ready": a client told it is in is never then dropped to make room.
        self._authenticated()  # no longer counts against the pending-handshake cap
        ready = {"kind": READY, "max_message_bytes": self._max_message_bytes}
        conn.sendall(seal(keys.sealer, encode_payload(ready, MAX_CONTROL_BYTES)))
        conn.settimeout(None)  # tasks may stay quiet for a long time; close() unblocks via shutdown
        return rank, keys

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        rank: int | None = None
        clean = False
        try:
            rank, keys = self._handshake(conn)
            while True:
                message = read_frame(conn, keys.opener, self._max_message_bytes)
                if message is None:
                    if not self._closed.is_set() and not self._report_lost_ranks:
                        logger.debug("channel: rank %d (%s) disconnected without saying bye", rank, peer)
                    elif not self._closed.is_set():
                        self._log_drop(
                            peer,
                            "disconnected without saying bye",
                            "channel: rank %d (%s) disconnected without saying bye",
                            rank,
                            peer,
                            authenticated=True,
                        )
                    break
                kind = message.get("kind")
                if kind == BYE:
                    clean = True
                    break
                if isinstance(kind, str) and kind in RESERVED_KINDS:
                    raise ProtocolError(f"unexpected {kind!r} frame after the handshake")
                try:
                    self._on_message(rank, message)
                except Exception:
                    logger.exception("channel: on_message callback failed for rank %d", rank)
        except (ProtocolError, OSError) as exc:
            if not self._closed.is_set():
                who = f"rank {rank}" if rank is not None else "unauthenticated peer"
                self._log_drop(
                    peer,
                    exc,
                    "channel: dropping %s (%s): %s",
                    who,
                    peer,
                    exc,
                    authenticated=rank is not None,
                )
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
        self,
        address: tuple[str, int],
        secret: bytes,
        rank: int,
        timeout: float = 10.0,
        encrypt: bool = False,
    ) -> None:
        """Connects and completes the handshake.

        Args:
            address: the server's ``(host, port)``.
            secret: the per-job secret the server was created with.
            rank: this task's rank, attached by the server to every message.
            timeout: seconds allowed for connecting and the handshake (retried while the server
                sheds connections, e.g. under a flood of idle ones), and for each send.
            encrypt: encrypt every frame (otherwise frames are integrity-protected only); must
                match the server's setting.

        Raises:
            ValueError: if ``rank`` is not a non-negative int.
            ChannelError: if the server is unreachable, does not complete the handshake within
                ``timeout``, is not a channel server, rejects us, or disagrees about ``encrypt``
                (an "encryption mismatch").
        """
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self._timeout = timeout
        self._lock = threading.Lock()
        self._closed = False
        try:
            sock, (self._max_message_bytes, self._keys) = connect_retrying(
                address,
                timeout,
                lambda sock, deadline: self._handshake(sock, secret, rank, bool(encrypt), deadline),
                "the channel server",
            )
        except HandshakeFailed as exc:
            raise ChannelError(str(exc)) from None
        except OSError as exc:
            raise ChannelError(f"cannot connect to the channel server at {address}: {exc}") from exc
        sock.settimeout(timeout)
        self._sock = sock

    @staticmethod
    def _handshake(
        sock: socket.socket, secret: bytes, rank: int, encrypt: bool, deadline: float
    ) -> tuple[int, FrameProtection]:
        """One attempt; raises ChannelError (not retried), Shed or OSError (connect_retrying's)."""
        try:
            greeting = split_greeting(read_greeting(sock, GREETING_BYTES, MAGIC, deadline), MAGIC, NONCE_BYTES)
            if greeting is None:
                raise ChannelError("the peer is not a sparkdl channel server (bad greeting)")
            server_mode, server_nonce = greeting
            client_nonce = secrets.token_bytes(NONCE_BYTES)
            mode = mode_byte(encrypt)
            proof = client_nonce + mode + client_proof(secret, server_nonce, client_nonce, mode)
            theirs = mode_from_byte(server_mode[0])
            if theirs != encrypt:
                # Prove ourselves anyway, so that the server can log the mismatch too.
                sock.sendall(proof)
                if theirs is None:
                    raise ChannelError(f"the channel server uses an unknown protection mode {server_mode[0]}")
                raise ChannelError(mismatch_message(encrypt, theirs, "channel client", "channel server"))
            keys = protection(secret, KEY_LABEL, server_nonce, client_nonce, encrypt, server=False)
            hello = encode_payload({"kind": HELLO, "rank": rank}, MAX_CONTROL_BYTES)
            sock.sendall(proof + seal(keys.sealer, hello))
            ready = read_frame(sock, keys.opener, MAX_CONTROL_BYTES, deadline)
        except ProtocolError as exc:
            raise ChannelError(f"channel handshake failed: {exc}") from None
        if ready is None:  # as when it rejects our secret; or it dropped us late, to make room
            raise Shed("the server hung up during the handshake", proved=True)
        limit = ready.get("max_message_bytes")
        if ready.get("kind") != READY or type(limit) is not int or limit <= 0:
            raise ChannelError("the server sent an invalid ready frame")
        return limit, keys

    @property
    def encrypt(self) -> bool:
        """Whether this connection is encrypted (it is always integrity-protected)."""
        return self._keys.encrypt

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
        if isinstance(kind, str) and kind in RESERVED_KINDS:
            raise ValueError(f"message kind {kind!r} is reserved for the channel protocol")
        payload = encode_payload(message, self._max_message_bytes)
        with self._lock:
            if self._closed:
                raise ChannelError("the channel is closed")
            try:
                self._check_server_alive()
                # Sealed under the lock: frame counters must follow the order on the wire.
                self._sock.sendall(seal(self._keys.sealer, payload))
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
                    bye = encode_payload({"kind": BYE}, MAX_CONTROL_BYTES)
                    self._sock.sendall(seal(self._keys.sealer, bye))
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
