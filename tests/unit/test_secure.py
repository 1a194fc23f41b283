"""Frame protection (sparkdl._net.frames) on its own, and on real loopback connections of both of
sparkdl's servers (progress channel, parameter server) seen through a tapping proxy.

The proxy sits between a real client and a real server, forwards every byte and records it:
what an eavesdropper on the cluster network would see. It can also flip a byte, hold a
direction back, and inject bytes, which is how replayed, reordered and spliced frames are made.
Each attack must make the receiver reject the frame (server: drop and log; client: raise), and
the encrypt=False runs show the plaintext checks can fail (the marker is visible there).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

from sparkdl._net.channel import GREETING_BYTES, ChannelClient, ChannelError, ChannelServer, new_secret
from sparkdl._net.frames import (
    TAG_BYTES,
    FrameAuthError,
    FrameOpener,
    FrameSealer,
    derive_keys,
    protection,
)
from sparkdl.strategies.parameter_server.layout import Layout, TableSpec
from sparkdl.strategies.parameter_server.shard import ServerState, Shard
from sparkdl.strategies.parameter_server.transport import ShardClient, ShardServer, listen
from sparkdl.strategies.parameter_server.wire import DTYPE_CODES, HEADER, Header, Kind, ParameterServerError, byte_view
from tests.unit.test_channel import Recorder

HOST = "127.0.0.1"
WAIT = 10.0
C2S, S2C = "client->server", "server->client"
MARKER = "sparkdl-plaintext-marker-7f3a"
BOTH_MODES = pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encrypt"])


# ---- the tapping proxy ----------------------------------------------------------------------


class Link:
    """One proxied connection: the bytes each direction carried, and ways to interfere."""

    def __init__(self, proxy: "TappingProxy", index: int, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.index = index
        self.sockets = {C2S: server, S2C: client}  # where each direction's bytes go
        self.data: Dict[str, bytearray] = {C2S: bytearray(), S2C: bytearray()}
        self.hold: Dict[str, bool] = {C2S: False, S2C: False}
        self.held: Dict[str, bytearray] = {C2S: bytearray(), S2C: bytearray()}
        self.seen: Dict[str, int] = {C2S: 0, S2C: 0}
        self.ended: Dict[str, bool] = {C2S: False, S2C: False}
        self.send_locks = {C2S: threading.Lock(), S2C: threading.Lock()}
        self.threads = [
            threading.Thread(target=self._pump, args=(C2S, client), daemon=True),
            threading.Thread(target=self._pump, args=(S2C, server), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _pump(self, direction: str, source: socket.socket) -> None:
        destination = self.sockets[direction]
        try:
            while True:
                try:
                    chunk = source.recv(1 << 16)
                except OSError:
                    chunk = b""
                with self.send_locks[direction]:
                    with self.proxy.cond:
                        if chunk:
                            tamper = self.proxy.tamper
                            offset = self.seen[direction]
                            self.seen[direction] += len(chunk)
                            if tamper is not None:
                                chunk = tamper(self.index, direction, offset, chunk)
                            self.data[direction] += chunk
                            holding = self.hold[direction]
                            if holding:
                                self.held[direction] += chunk
                        else:
                            self.ended[direction] = True
                        self.proxy.cond.notify_all()
                    if not chunk:
                        break
                    if not holding:
                        destination.sendall(chunk)
        except OSError:
            pass
        finally:
            # Pass an EOF or a failure on, so each end sees what the other did.
            try:
                destination.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def wait_for(self, direction: str, count: int) -> bytes:
        """The direction's bytes once at least ``count`` have passed."""
        with self.proxy.cond:
            assert self.proxy.cond.wait_for(lambda: len(self.data[direction]) >= count, timeout=WAIT), (
                f"only {len(self.data[direction])} of {count} bytes {direction}"
            )
            return bytes(self.data[direction])

    def wait_ended(self, direction: str) -> bytes:
        """The direction's bytes once its sender has closed: everything it will ever carry."""
        with self.proxy.cond:
            assert self.proxy.cond.wait_for(lambda: self.ended[direction], timeout=WAIT), f"{direction} still open"
            return bytes(self.data[direction])

    def inject(self, direction: str, data: bytes) -> None:
        """Sends ``data`` on; the receiver may drop the connection part way (what a bad frame
        should make it do), which is not an error of the injection."""
        with self.send_locks[direction]:
            try:
                self.sockets[direction].sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

    def take_held(self, direction: str) -> bytes:
        """Stops holding ``direction`` back and returns (without forwarding) what it held."""
        with self.send_locks[direction]:
            with self.proxy.cond:
                self.hold[direction] = False
                held = bytes(self.held[direction])
                self.held[direction].clear()
        return held

    def close(self) -> None:
        for sock in self.sockets.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self.threads:
            thread.join(WAIT)
        for sock in self.sockets.values():
            sock.close()


class TappingProxy:
    """A TCP proxy on loopback in front of one server; records everything it forwards.

    ``tamper(link_index, direction, stream_offset, chunk) -> chunk`` (set at any time) may
    rewrite bytes in flight; ``stream_offset`` is the position of ``chunk`` in its direction.
    """

    def __init__(self, target: Tuple[str, int]) -> None:
        self.target = target
        self.cond = threading.Condition()
        self.links: List[Link] = []
        self.tamper: Optional[Callable[[int, str, int, bytes], bytes]] = None
        self._listener = socket.create_server((HOST, 0))
        self.address = self._listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=WAIT)
            server.settimeout(None)
            with self.cond:
                self.links.append(Link(self, len(self.links), client, server))
                self.cond.notify_all()

    def link(self, index: int) -> Link:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.links) > index, timeout=WAIT)
            return self.links[index]

    def recorded(self) -> bytes:
        """Every byte that crossed the proxy, both directions, all connections."""
        with self.cond:
            return b"".join(bytes(link.data[d]) for link in self.links for d in (C2S, S2C))

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(WAIT)
        for link in list(self.links):
            link.close()


def flip_at(link_index: int, direction: str, position: int) -> Callable[[int, str, int, bytes], bytes]:
    """A tamper that flips the lowest bit of one byte of one direction of one connection."""

    def tamper(index: int, where: str, offset: int, chunk: bytes) -> bytes:
        if index != link_index or where != direction or not offset <= position < offset + len(chunk):
            return chunk
        out = bytearray(chunk)
        out[position - offset] ^= 0x01
        return bytes(out)

    return tamper


@pytest.fixture
def proxies() -> Iterator[Callable[[Tuple[str, int]], TappingProxy]]:
    made: List[TappingProxy] = []

    def make(target: Tuple[str, int]) -> TappingProxy:
        proxy = TappingProxy(target)
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()


def _expect_dropped(rec, caplog, rank: int, act) -> None:
    """``act()`` makes the channel server drop ``rank``'s connection for a frame that failed its
    integrity check, having delivered nothing of it."""
    with caplog.at_level(logging.WARNING, logger="sparkdl.channel"):
        act()
        assert rec.disconnects.get(timeout=WAIT) == (rank, False)
    assert rec.messages.empty()
    assert "failed its integrity check" in _warnings(caplog, "sparkdl.channel")


def _warnings(caplog, logger: str) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING)


# ---- the primitives ---------------------------------------------------------------------------


SECRET = bytes(range(32))
NONCE_A, NONCE_B, NONCE_C = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def test_keys_are_fresh_per_connection_direction_mode_protocol_and_secret():
    keys = {
        "base": derive_keys(SECRET, b"proto", NONCE_A, NONCE_B, True),
        "other server nonce": derive_keys(SECRET, b"proto", NONCE_C, NONCE_B, True),
        "other client nonce": derive_keys(SECRET, b"proto", NONCE_A, NONCE_C, True),
        "nonces swapped": derive_keys(SECRET, b"proto", NONCE_B, NONCE_A, True),
        "other mode": derive_keys(SECRET, b"proto", NONCE_A, NONCE_B, False),
        "other protocol": derive_keys(SECRET, b"other", NONCE_A, NONCE_B, True),
        "other secret": derive_keys(b"another secret", b"proto", NONCE_A, NONCE_B, True),
    }
    every_key = [key for pair in keys.values() for key in pair]
    assert all(len(key) == 32 for key in every_key)
    assert len(set(every_key)) == len(every_key), "two keys coincide"
    assert derive_keys(SECRET, b"proto", NONCE_A, NONCE_B, True) == keys["base"]  # deterministic
    server, client = (protection(SECRET, b"proto", NONCE_A, NONCE_B, True, server=s) for s in (True, False))
    # What one side seals, the other opens: the client's sending key is the server's receiving key.
    assert client.opener.open(b"h", *_split(server.sealer.seal(b"h", b"payload"), 1, 7)) == b"payload"
    assert server.opener.open(b"h", *_split(client.sealer.seal(b"h", b"payload"), 1, 7)) == b"payload"


def _split(frame: bytes, header_bytes: int, body_bytes: int) -> Tuple[bytes, bytes]:
    body = frame[header_bytes : header_bytes + body_bytes]
    return body, frame[header_bytes + body_bytes :]


def _pair(encrypt: bool, key: bytes = b"k" * 32) -> Tuple[FrameSealer, FrameOpener]:
    return FrameSealer(key, encrypt), FrameOpener(key, encrypt)


@BOTH_MODES
def test_round_trip_and_what_the_body_shows(encrypt):
    sealer, opener = _pair(encrypt)
    payload = (MARKER * 5).encode()
    frame = sealer.seal(b"HDR!", payload)
    assert len(frame) == 4 + len(payload) + TAG_BYTES
    assert frame[:4] == b"HDR!"  # the header is always in clear (it delimits the frame)
    assert (payload in frame) is not encrypt
    assert opener.open(b"HDR!", *_split(frame, 4, len(payload))) == payload


@BOTH_MODES
def test_streaming_in_pieces_and_in_place_equals_one_shot(encrypt):
    payload = torch.arange(100_003, dtype=torch.float32)
    one_shot = FrameSealer(b"k" * 32, encrypt).seal(b"hdr", bytes(byte_view(payload)))
    sealer = FrameSealer(b"k" * 32, encrypt)
    frame = sealer.begin(b"hdr")
    view, scratch, body = byte_view(payload), sealer.scratch(), bytearray()
    for start in range(0, len(view), 99_991):  # uneven pieces, none block-aligned
        body += frame.update(view[start : start + 99_991], scratch)
    assert b"hdr" + bytes(body) + frame.finalize() == one_shot
    # The receiver works in the tensor it receives into, in uneven pieces too.
    into = torch.empty_like(payload)
    target = byte_view(into)
    target[:] = one_shot[3 : 3 + len(target)]
    opening = FrameOpener(b"k" * 32, encrypt).begin(b"hdr")
    for start in range(0, len(target), 65_537):
        opening.update_into(target[start : start + 65_537])
    opening.finalize(one_shot[3 + len(target) :])
    assert torch.equal(into, payload)


@BOTH_MODES
@pytest.mark.parametrize("where", ["header", "body", "tag"])
def test_any_flipped_bit_fails_and_the_direction_stays_failed(encrypt, where):
    sealer, opener = _pair(encrypt)
    frame = bytearray(sealer.seal(b"HDR!", b"some payload"))
    frame[{"header": 2, "body": 9, "tag": len(frame) - 1}[where]] ^= 0x01
    with pytest.raises(FrameAuthError, match="integrity check"):
        opener.open(bytes(frame[:4]), *_split(bytes(frame), 4, 12))
    good = sealer.seal(b"HDR!", b"some payload")
    with pytest.raises(FrameAuthError, match="earlier frame"):
        opener.open(b"HDR!", *_split(good, 4, 12))


@BOTH_MODES
@pytest.mark.parametrize("attack", ["replay", "reorder", "drop", "other key", "other mode"])
def test_replayed_reordered_dropped_and_foreign_frames_fail(encrypt, attack):
    sealer, opener = _pair(encrypt)
    frames = [sealer.seal(b"H", b"same") for _ in range(3)]  # identical content, three counters
    assert len(set(frames)) == 3
    if attack == "replay":
        assert opener.open(b"H", *_split(frames[0], 1, 4)) == b"same"
        victim = frames[0]
    elif attack == "reorder":
        victim = frames[1]
    elif attack == "drop":
        assert opener.open(b"H", *_split(frames[0], 1, 4)) == b"same"
        victim = frames[2]
    elif attack == "other key":
        victim = FrameSealer(b"x" * 32, encrypt).seal(b"H", b"same")
    else:
        victim = FrameSealer(b"k" * 32, not encrypt).seal(b"H", b"same")
        if not encrypt:  # same key and counter: GCM with and without encryption tag differently
            assert victim != frames[0]
    with pytest.raises(FrameAuthError):
        opener.open(b"H", *_split(victim, 1, 4))


def test_a_truncated_tag_fails():
    sealer, opener = _pair(True)
    frame = sealer.seal(b"H", b"abc")
    with pytest.raises(FrameAuthError, match="truncated frame tag"):
        opener.open(b"H", frame[1:4], frame[4:-1])


# ---- the progress channel through the proxy ---------------------------------------------------


@pytest.fixture
def channel():
    """``make(encrypt)`` -> (server, recorder, secret); servers closed at the end."""
    servers: List[ChannelServer] = []

    def make(encrypt: bool):
        secret, rec = new_secret(), Recorder()
        server = ChannelServer(HOST, secret, rec.on_message, rec.on_disconnect, encrypt=encrypt)
        servers.append(server)
        return server, rec, secret

    yield make
    for server in servers:
        server.close()


def _channel_frame_bytes(message: dict) -> int:
    return 4 + len(json.dumps(message, separators=(",", ":")).encode()) + TAG_BYTES


@BOTH_MODES
def test_channel_plaintext_is_visible_on_the_wire_only_without_encryption(channel, proxies, encrypt):
    server, rec, secret = channel(encrypt)
    proxy = proxies(server.address)
    with ChannelClient(proxy.address, secret, rank=3, encrypt=encrypt) as client:
        assert client.encrypt is encrypt
        client.send({"kind": "log", "line": MARKER})
        assert rec.messages.get(timeout=WAIT) == (3, {"kind": "log", "line": MARKER})
    assert rec.disconnects.get(timeout=WAIT) == (3, True)
    wire = proxy.recorded()
    assert (MARKER.encode() in wire) is not encrypt
    assert (b'"kind"' in wire) is not encrypt  # hello, ready and bye are covered too
    assert (b'"ready"' in wire) is not encrypt


@BOTH_MODES
@pytest.mark.parametrize("where", ["length", "body", "tag"])
def test_channel_server_drops_a_frame_with_one_flipped_byte(channel, proxies, caplog, encrypt, where):
    server, rec, secret = channel(encrypt)
    proxy = proxies(server.address)
    client = ChannelClient(proxy.address, secret, rank=1, encrypt=encrypt)
    base = len(proxy.link(0).wait_for(C2S, 1))  # the handshake and hello have passed
    message = {"kind": "log", "line": MARKER}
    if _channel_frame_bytes(message) % 2 == 0:
        message["line"] += "!"
    size = _channel_frame_bytes(message)
    assert (size - 4 - TAG_BYTES) % 2 == 1  # odd, so that flipping the length's low bit shortens it
    # The length's low bit makes it one shorter: the server then reads a shifted tag.
    position = {"length": base + 3, "body": base + 10, "tag": base + size - 3}[where]
    proxy.tamper = flip_at(0, C2S, position)
    _expect_dropped(rec, caplog, 1, lambda: client.send(message))
    client.close()


@BOTH_MODES
def test_channel_client_rejects_a_tampered_ready_frame(channel, proxies, encrypt):
    server, rec, secret = channel(encrypt)
    proxy = proxies(server.address)
    proxy.tamper = flip_at(0, S2C, GREETING_BYTES + 4 + 2)  # inside the ready frame's body
    with pytest.raises(ChannelError, match="integrity check"):
        ChannelClient(proxy.address, secret, rank=0, encrypt=encrypt)


@BOTH_MODES
def test_channel_server_drops_a_replayed_frame(channel, proxies, caplog, encrypt):
    server, rec, secret = channel(encrypt)
    proxy = proxies(server.address)
    client = ChannelClient(proxy.address, secret, rank=2, encrypt=encrypt)
    link = proxy.link(0)
    base = len(link.wait_for(C2S, 1))
    message = {"kind": "progress", "epoch": 1}
    client.send(message)
    assert rec.messages.get(timeout=WAIT) == (2, message)
    frame = link.wait_for(C2S, base + _channel_frame_bytes(message))[base:]
    _expect_dropped(rec, caplog, 2, lambda: link.inject(C2S, frame))  # the same bytes again: a second "epoch 1"
    client.close()


@BOTH_MODES
def test_channel_server_drops_reordered_frames(channel, proxies, caplog, encrypt):
    server, rec, secret = channel(encrypt)
    proxy = proxies(server.address)
    client = ChannelClient(proxy.address, secret, rank=4, encrypt=encrypt)
    link = proxy.link(0)
    base = len(link.wait_for(C2S, 1))
    link.hold[C2S] = True
    first, second = {"kind": "progress", "epoch": 1}, {"kind": "progress", "epoch": 2}
    client.send(first)
    client.send(second)
    size = _channel_frame_bytes(first)
    link.wait_for(C2S, base + 2 * size)
    held = link.take_held(C2S)
    _expect_dropped(rec, caplog, 4, lambda: link.inject(C2S, held[size:] + held[:size]))
    client.close()


@BOTH_MODES
def test_channel_server_drops_a_frame_spliced_from_another_connection(channel, proxies, caplog, encrypt):
    server, rec, secret = channel(encrypt)
    proxy = proxies(server.address)
    message = {"kind": "progress", "epoch": 7}
    size = _channel_frame_bytes(message)
    donor = ChannelClient(proxy.address, secret, rank=0, encrypt=encrypt)
    victim = ChannelClient(proxy.address, secret, rank=1, encrypt=encrypt)
    donor_link, victim_link = proxy.link(0), proxy.link(1)
    donor_base, victim_base = len(donor_link.wait_for(C2S, 1)), len(victim_link.wait_for(C2S, 1))
    donor.send(message)
    assert rec.messages.get(timeout=WAIT) == (0, message)
    donor_frame = donor_link.wait_for(C2S, donor_base + size)[donor_base:]
    victim_link.hold[C2S] = True
    victim.send(message)  # the same message at the same position (frame 1) of its connection
    own_frame = victim_link.wait_for(C2S, victim_base + size)[victim_base:]
    assert own_frame != donor_frame  # keys differ per connection: so do tags (and ciphertexts)
    assert own_frame[:4] == donor_frame[:4] and (own_frame[4:-TAG_BYTES] == donor_frame[4:-TAG_BYTES]) is not encrypt
    victim_link.take_held(C2S)
    _expect_dropped(rec, caplog, 1, lambda: victim_link.inject(C2S, donor_frame))
    donor.close()
    victim.close()
    assert rec.disconnects.get(timeout=WAIT) == (0, True)


# ---- the parameter server through the proxy ---------------------------------------------------


WORLD = 4
PS_LOGGER = "sparkdl.parameter_server"
F32 = DTYPE_CODES[torch.float32]
#: Big enough for several scratch chunks and many recv() calls per frame.
N = 200_003
#: A gradient whose raw bytes are easy to look for: 1e6 + i (exact in float32).
PATTERN = torch.arange(N, dtype=torch.float32) + 1.0e6


class PsServer:
    """Rank 0 of a pretend world of four holding one whole table of N floats (plain SGD, lr 1)."""

    def __init__(self, encrypt: bool) -> None:
        layout = Layout(order=(0,), bounds=(0,) + (N,) * WORLD)
        spec = TableSpec(table=0, dtype=torch.float32, shapes=((N,),), groups=(0,), num_groups=1, layout=layout)
        self.state = ServerState(0, WORLD, 10.0)
        template = torch.optim.SGD([torch.zeros(1)], lr=1.0)
        self.shard = Shard(spec, 0, WORLD, None, 10.0, torch.zeros(N), template)
        self.shard.depart(0, clean=True, reason="rank 0's own worker takes no part in these tests")
        self.state.register(0, self.shard)
        self.server = ShardServer(listen(HOST), SECRET, 0, WORLD, self.state, 10.0, encrypt=encrypt)
        self.address = self.server.address

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def ps_servers():
    made: List[PsServer] = []

    def make(encrypt: bool) -> PsServer:
        server = PsServer(encrypt)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


PUSH_BYTES = 8 + 4 * N


def _push_header(rank: int, clock: int = 0) -> Header:
    return Header(Kind.PUSH, F32, 0, rank, clock, 1, PUSH_BYTES)


def _push(client: ShardClient, clock: int = 0, grad: torch.Tensor = PATTERN) -> torch.Tensor:
    client.send(
        _push_header(client.rank, clock), byte_view(torch.tensor([math.nan], dtype=torch.float64)), byte_view(grad)
    )
    out = torch.empty(N)
    client.receive(byte_view(out), 0)
    return out


def _pull_header(rank: int) -> Header:
    return Header(Kind.PULL, F32, 0, rank, -1, 0, 0)


def _client(address, rank: int, encrypt: bool) -> ShardClient:
    return ShardClient(address, SECRET, rank, 0, timeout_s=10, encrypt=encrypt)


def _frame_bytes(header: Header) -> int:
    return HEADER.size + header.length + TAG_BYTES


@BOTH_MODES
def test_ps_tensors_are_visible_on_the_wire_only_without_encryption(ps_servers, proxies, encrypt):
    srv = ps_servers(encrypt)
    proxy = proxies(srv.address)
    client = _client(proxy.address, 1, encrypt)
    try:
        values = _push(client)
        assert torch.equal(values, -PATTERN)  # zeros - lr 1 * gradient: the push arrived intact
        client.send(_pull_header(1))
        out = torch.empty(N)
        client.receive(byte_view(out), 0)
        assert torch.equal(out, -PATTERN)
    finally:
        client.close()
    link = proxy.link(0)
    sent = link.wait_ended(C2S)  # close() sends its BYE frame just before it closes
    wire = proxy.recorded()
    for tensor in (PATTERN, -PATTERN):  # the pushed gradient, the values sent back
        raw = bytes(byte_view(tensor))
        assert (raw[:64] in wire) is not encrypt
        assert (raw[-64:] in wire) is not encrypt
    # Headers travel in clear in both modes (they delimit frames); they are authenticated.
    assert sent.count(b"SDPS") == 3  # push, pull, bye
    assert srv.shard.updates == 1


@BOTH_MODES
@pytest.mark.parametrize("where", ["header", "payload", "tag"])
def test_ps_server_drops_a_push_with_one_flipped_byte(ps_servers, proxies, caplog, encrypt, where):
    srv = ps_servers(encrypt)
    proxy = proxies(srv.address)
    client = _client(proxy.address, 2, encrypt)
    base = len(proxy.link(0).wait_for(C2S, 1))
    size = _frame_bytes(_push_header(2))
    # The clock (header bytes 12-19) is only checked when the push is applied, so only the tag
    # can catch a change to it; 100 bytes into the payload is inside the gradient.
    position = {"header": base + 19, "payload": base + HEADER.size + 100, "tag": base + size - 1}[where]
    proxy.tamper = flip_at(0, C2S, position)
    with caplog.at_level(logging.WARNING, logger=PS_LOGGER):
        with pytest.raises(ParameterServerError, match="lost the parameter server on rank 0"):
            _push(client)
    assert "failed its integrity check" in _warnings(caplog, PS_LOGGER)
    assert srv.shard.updates == 0
    with srv.shard.cond:
        assert srv.shard.cond.wait_for(lambda: 2 in srv.shard.clock.lost, timeout=WAIT)


@BOTH_MODES
@pytest.mark.parametrize("where", ["header", "payload", "tag"])
def test_ps_client_rejects_a_reply_with_one_flipped_byte(ps_servers, proxies, encrypt, where):
    srv = ps_servers(encrypt)
    proxy = proxies(srv.address)
    client = _client(proxy.address, 1, encrypt)
    base = len(proxy.link(0).wait_for(S2C, 1))  # greeting and server proof
    size = _frame_bytes(Header(Kind.PARAMS, F32, 0, 0, 0, 0, 4 * N))
    # The reply's aux (staleness) is not checked by the client: only the tag catches it.
    position = {"header": base + 27, "payload": base + HEADER.size + 4 * N // 2, "tag": base + size - 8}[where]
    proxy.tamper = flip_at(0, S2C, position)
    with pytest.raises(ParameterServerError, match="failed its integrity check") as info:
        _push(client)
    assert info.value.peer_rank == 0
    client.close()


@BOTH_MODES
def test_ps_server_drops_a_replayed_request(ps_servers, proxies, caplog, encrypt):
    srv = ps_servers(encrypt)
    proxy = proxies(srv.address)
    client = _client(proxy.address, 1, encrypt)
    link = proxy.link(0)
    base = len(link.wait_for(C2S, 1))
    client.send(_pull_header(1))  # a PULL has no clock: without a MAC its replay would be served
    client.receive(byte_view(torch.empty(N)), 0)
    frame = link.wait_for(C2S, base + _frame_bytes(_pull_header(1)))[base:]
    replies = len(link.wait_for(S2C, 1))
    with caplog.at_level(logging.WARNING, logger=PS_LOGGER):
        link.inject(C2S, frame)
        with srv.shard.cond:
            assert srv.shard.cond.wait_for(lambda: 1 in srv.shard.clock.lost, timeout=WAIT)
    assert "failed its integrity check" in _warnings(caplog, PS_LOGGER)
    assert len(link.data[S2C]) == replies  # nothing was served for the replay
    client.close()


@BOTH_MODES
def test_ps_server_drops_reordered_requests(ps_servers, proxies, caplog, encrypt):
    srv = ps_servers(encrypt)
    proxy = proxies(srv.address)
    client = _client(proxy.address, 1, encrypt)
    link = proxy.link(0)
    base = len(link.wait_for(C2S, 1))
    link.hold[C2S] = True
    client.send(_push_header(1), byte_view(torch.tensor([math.nan], dtype=torch.float64)), byte_view(PATTERN))
    client.send(_pull_header(1))
    push_size = _frame_bytes(_push_header(1))
    link.wait_for(C2S, base + push_size + _frame_bytes(_pull_header(1)))
    held = link.take_held(C2S)
    with caplog.at_level(logging.WARNING, logger=PS_LOGGER):
        link.inject(C2S, held[push_size:] + held[:push_size])  # the PULL first
        with pytest.raises(ParameterServerError):
            client.receive(byte_view(torch.empty(N)), 0)
    assert "failed its integrity check" in _warnings(caplog, PS_LOGGER)
    assert srv.shard.updates == 0


@BOTH_MODES
def test_ps_server_drops_a_request_spliced_from_another_connection(ps_servers, proxies, caplog, encrypt):
    # Two servers of the same job (same secret, both rank 0 of their table) and the same rank's
    # client to each: their PULL frames have identical headers, only the keys differ.
    first, second = ps_servers(encrypt), ps_servers(encrypt)
    proxy_a, proxy_b = proxies(first.address), proxies(second.address)
    donor, victim = _client(proxy_a.address, 1, encrypt), _client(proxy_b.address, 1, encrypt)
    link_a, link_b = proxy_a.link(0), proxy_b.link(0)
    base_a, base_b = len(link_a.wait_for(C2S, 1)), len(link_b.wait_for(C2S, 1))
    size = _frame_bytes(_pull_header(1))
    donor.send(_pull_header(1))
    donor.receive(byte_view(torch.empty(N)), 0)
    donor_frame = link_a.wait_for(C2S, base_a + size)[base_a:]
    link_b.hold[C2S] = True
    victim.send(_pull_header(1))
    own_frame = link_b.wait_for(C2S, base_b + size)[base_b:]
    assert own_frame[: HEADER.size] == donor_frame[: HEADER.size] and own_frame != donor_frame
    link_b.take_held(C2S)
    with caplog.at_level(logging.WARNING, logger=PS_LOGGER):
        link_b.inject(C2S, donor_frame)
        with pytest.raises(ParameterServerError):
            victim.receive(byte_view(torch.empty(N)), 0)
    assert "failed its integrity check" in _warnings(caplog, PS_LOGGER)
    donor.close()


def test_ps_encrypted_pushes_apply_in_order_and_bye_is_honoured():
    srv = PsServer(encrypt=True)
    try:
        client = _client(srv.address, 3, True)
        for clock in range(3):
            values = _push(client, clock, torch.ones(N))
            assert torch.equal(values, torch.full((N,), -(clock + 1.0)))
        client.close()
        with srv.shard.cond:
            assert srv.shard.cond.wait_for(lambda: 3 in srv.shard.clock.finished, timeout=WAIT)
    finally:
        srv.close()


def test_frame_counters_advance_per_direction():
    sealer, opener = FrameSealer(b"k" * 32, True), FrameOpener(b"k" * 32, True)
    assert sealer.frames == opener.frames == 0
    for payload in (b"", b"x"):
        frame = sealer.seal(b"h", payload)
        assert opener.open(b"h", *_split(frame, 1, len(payload))) == payload
    assert sealer.frames == opener.frames == 2


# ---- a client's handshake while the server sheds connections (connect_retrying) -------------


class _Scripted:
    """A listener whose n-th accepted connection gets ``script[n]`` (the last one repeats):
    ``"close"`` (hung up unserved), ``"silent"`` (held open, never answered), or bytes to send
    before holding the connection open. Holds what it accepted until :meth:`close`."""

    def __init__(self, script: List[object]) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.address = self.listener.getsockname()[:2]
        self.script, self.accepted = script, 0
        self.held: List[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            action = self.script[min(self.accepted, len(self.script) - 1)]
            self.accepted += 1
            if action == "close":
                conn.close()
                continue
            if isinstance(action, bytes):
                conn.sendall(action)
            self.held.append(conn)

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone does not
        except OSError:
            pass
        self.listener.close()
        self.thread.join(WAIT)
        for conn in self.held:
            conn.close()


def _greeting_attempt(sock: socket.socket, deadline: float) -> bytes:
    from sparkdl._net.frames import read_greeting

    return read_greeting(sock, len(b"MAGIC123") + 4, b"MAGIC123", deadline)


@pytest.mark.parametrize(
    "sent, shed", [(None, True), (b"MAG", True), (b"MAGIC123\x01", True), (b"HTTP/1.1 400", False)]
)
def test_read_greeting_tells_a_shed_connection_from_a_foreign_server(sent, shed):
    from sparkdl._net.frames import Shed

    fake = _Scripted(["close" if sent is None else sent])
    try:
        with socket.create_connection(fake.address, timeout=WAIT) as sock:
            if sent is not None:  # a truncated or foreign greeting, then the server hangs up
                assert sock.recv(len(sent), socket.MSG_PEEK | socket.MSG_WAITALL) == sent
                deadline = time.monotonic() + WAIT
                while len(fake.held) < 1:  # appended right after the send
                    assert time.monotonic() < deadline
                    time.sleep(0.01)  # polling the fake server's thread
                fake.held[0].shutdown(socket.SHUT_WR)
            if shed:
                with pytest.raises(Shed, match="before its greeting"):
                    _greeting_attempt(sock, time.monotonic() + WAIT)
            else:  # returned as it came, for the caller to call it a bad greeting
                assert _greeting_attempt(sock, time.monotonic() + WAIT) == b"HTTP/1.1 400"
    finally:
        fake.close()


def test_connect_retrying_gets_through_a_server_that_sheds_the_first_connections():
    from sparkdl._net.frames import connect_retrying

    fake = _Scripted(["close", "close", "close", b"MAGIC1230000"])
    try:
        sock, greeting = connect_retrying(fake.address, WAIT, _greeting_attempt, "the test server")
        sock.close()
        assert greeting == b"MAGIC1230000" and fake.accepted == 4
    finally:
        fake.close()


@pytest.mark.parametrize(
    "action, last", [("silent", "no answer"), ("close", "closed the connection before its greeting")]
)
def test_connect_retrying_names_the_real_cause_when_it_gives_up(action, last):
    from sparkdl._net.frames import HandshakeFailed, connect_retrying

    fake = _Scripted([action])
    try:
        start = time.monotonic()
        with pytest.raises(HandshakeFailed) as info:
            connect_retrying(fake.address, 1.0, _greeting_attempt, "the test server")
        assert time.monotonic() - start < 1.0 + 2.0
        text = str(info.value)
        host, port = fake.address
        assert f"the test server at {host}:{port} did not complete the handshake within 1 s" in text, text
        assert last in text and "flooded" in text and "bad greeting" not in text, text
        assert (fake.accepted > 1) == (action == "close")  # a silent server is not hammered
    finally:
        fake.close()


def test_connect_retrying_gives_up_soon_on_a_server_that_hangs_up_after_the_proof():
    from sparkdl._net.frames import HandshakeFailed, Shed, connect_retrying

    def attempt(sock: socket.socket, deadline: float) -> None:
        raise Shed("the server hung up during the handshake", proved=True)  # as with a wrong secret

    fake = _Scripted([b"x"])
    try:
        start = time.monotonic()
        with pytest.raises(
            HandshakeFailed, match=r"hung up after this side proved the job's secret, 3 times \(wrong secret\?\)"
        ):
            connect_retrying(fake.address, 30.0, attempt, "the test server")
        assert time.monotonic() - start < 5.0
        deadline = time.monotonic() + WAIT
        while fake.accepted < 3:  # the fake accepts after the kernel did: poll, bounded
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert fake.accepted == 3  # the first try and two retries, no more
    finally:
        fake.close()
