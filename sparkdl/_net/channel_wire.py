"""Wire format of the progress channel (:mod:`sparkdl._net.channel`, whose docstring specifies
it): the handshake's constants and proof, and sealed JSON frames."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
from typing import Any

from sparkdl._net.frames import (
    FrameAuthError,
    FrameFormatError,
    FrameOpener,
    FrameSealer,
    read_length_prefixed,
)
from sparkdl._net.server import recv_exact

MAGIC = b"SPKDLv2\0"
NONCE_BYTES = 32
DIGEST_BYTES = 32
#: Step 1: MAGIC + the server's mode byte + server nonce.
GREETING_BYTES = len(MAGIC) + 1 + NONCE_BYTES
#: Step 2: client nonce + the client's mode byte + proof.
CLIENT_PROOF_BYTES = NONCE_BYTES + 1 + DIGEST_BYTES
CLIENT_LABEL = b"sparkdl-channel client"
#: Protocol label of the frame keys (sparkdl._net.frames).
KEY_LABEL = b"sparkdl-channel v2"
HEADER = struct.Struct(">I")
# Handshake frames are tiny; a low cap keeps a peer from making us buffer much before it is known.
MAX_CONTROL_BYTES = 4096
HELLO, READY, BYE = "hello", "ready", "bye"
RESERVED_KINDS = frozenset({HELLO, READY, BYE})

Message = dict[str, Any]


class ChannelError(Exception):
    """The channel could not be established, or is no longer usable, from the client's side."""


class ProtocolError(Exception):
    """A peer broke the wire protocol; the server drops the connection."""


def encode_payload(message: Message, max_bytes: int) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(payload) > max_bytes:
        raise ChannelError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
    return payload


def seal(sealer: FrameSealer, payload: bytes) -> bytes:
    """One sealed frame: length, body, tag (see the module docstring)."""
    return sealer.seal(HEADER.pack(len(payload)), payload)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes, mode: bytes) -> bytes:
    return hmac.new(secret, CLIENT_LABEL + server_nonce + client_nonce + mode, hashlib.sha256).digest()


def read_frame(
    sock: socket.socket, opener: FrameOpener, max_bytes: int, deadline: float | None = None
) -> Message | None:
    """Reads and verifies one sealed frame; returns None on EOF at a frame boundary, raises
    ProtocolError otherwise (a frame that fails its tag included)."""
    header = recv_exact(sock, HEADER.size, deadline)
    if not header:
        return None
    try:
        payload = read_length_prefixed(sock, opener, header, max_bytes, deadline)
    except (FrameFormatError, FrameAuthError) as exc:
        raise ProtocolError(str(exc)) from None
    try:
        # Explicit strict UTF-8: json.loads(bytes) would also guess UTF-16/32.
        message = json.loads(payload.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: deeply nested arrays
        raise ProtocolError(f"payload is not valid UTF-8 JSON ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"payload is a JSON {type(message).__name__}, not an object")
    return message
