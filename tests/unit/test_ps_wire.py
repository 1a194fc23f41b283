"""The parameter server's wire: a real ShardServer on loopback, attacked with bad peers.

No Spark and no process group: one server (rank 0 of a pretend world of 8) holds a whole
10-element table updated by plain SGD (lr 0.5), so a good push of ones must come back as
``initial - 0.5``. Every attack must be dropped *and logged*, and a good client must be served
afterwards. Synchronization is on events (the server closing the attacker's socket, the shard's
condition variable), never on sleeps: the server logs before it closes a connection, so once
the attacker reads EOF the log record exists.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
import threading
import time
from typing import Iterator, Tuple

import pytest
import torch

from sparkdl._net.frames import FrameProtection
from sparkdl._net.server import MAX_PENDING_HANDSHAKES, recv_exact
from sparkdl.strategies.parameter_server.layout import Layout, TableSpec
from sparkdl.strategies.parameter_server.shard import ServerState, Shard
from sparkdl.strategies.parameter_server.transport import ShardClient, ShardServer, listen
from sparkdl.strategies.parameter_server.wire import (
    DTYPE_CODES,
    GREETING,
    HEADER,
    NONCE_BYTES,
    TAG_BYTES,
    Header,
    Kind,
    ParameterServerError,
    WireError,
    byte_view,
    client_handshake,
    server_handshake,
)
from tests.sockets import closed_by_server

WORLD = 8
SECRET = bytes(range(32))
LOGGER = "sparkdl.parameter_server"
F32 = DTYPE_CODES[torch.float32]
N = 10
PUSH_BYTES = 8 + 4 * N  # one learning rate + the gradient


def _spec() -> TableSpec:
    # Rank 0 holds the whole table: bounds (0, 10, 10, ..., 10).
    layout = Layout(order=(0, 1), bounds=(0,) + (N,) * WORLD)
    return TableSpec(table=0, dtype=torch.float32, shapes=((2, 3), (4,)), groups=(0, 0), num_groups=1, layout=layout)


class _Server:
    def __init__(self, timeout_s: float = 5.0, max_staleness=None, encrypt: bool = False) -> None:
        self.state = ServerState(0, WORLD, timeout_s)
        template = torch.optim.SGD([torch.zeros(1)], lr=0.5)
        self.shard = Shard(_spec(), 0, WORLD, max_staleness, timeout_s, torch.arange(N, dtype=torch.float32), template)
        self.shard.depart(0, clean=True, reason="rank 0's own worker takes no part in these tests")
        self.state.register(0, self.shard)
        self.server = ShardServer(listen("127.0.0.1"), SECRET, 0, WORLD, self.state, timeout_s, encrypt=encrypt)
        self.address = self.server.address

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        with self.shard.cond:
            return self.shard.cond.wait_for(lambda: predicate(self.shard.clock), timeout=timeout)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.server.close()


@pytest.fixture
def quick_server() -> Iterator[_Server]:
    """Times out stalled frames and handshakes after one second."""
    srv = _Server(timeout_s=1.0)
    yield srv
    srv.server.close()


def _push(client: ShardClient, clock: int = 0, lr: float = math.nan) -> torch.Tensor:
    lrs = torch.tensor([lr], dtype=torch.float64)
    client.send(Header(Kind.PUSH, F32, 0, client.rank, clock, 1, PUSH_BYTES), byte_view(lrs), byte_view(torch.ones(N)))
    out = torch.empty(N)
    reply = client.receive(byte_view(out), 0)
    assert reply.kind == Kind.PARAMS and reply.rank == 0
    return out


def _good_client_is_served(srv: _Server, rank: int, updates_before: int = 0) -> None:
    client = ShardClient(srv.address, SECRET, rank, 0, timeout_s=10)
    try:
        values = _push(client)
    finally:
        client.close()
    expected = torch.arange(N, dtype=torch.float32) - 0.5 * (updates_before + 1)
    assert torch.equal(values, expected), values


def _authenticated_with_keys(
    address: Tuple[str, int], rank: int, encrypt: bool = False
) -> Tuple[socket.socket, FrameProtection]:
    """A hand-made worker connection and its frame protection: ``_sealed`` frames are authentic
    to the server whatever they contain."""
    sock = socket.create_connection(address, timeout=10)
    server_rank, keys = client_handshake(sock, SECRET, rank, time.monotonic() + 10, encrypt)
    assert server_rank == 0
    return sock, keys


def _authenticated(address: Tuple[str, int], rank: int) -> socket.socket:
    return _authenticated_with_keys(address, rank)[0]


def _sealed(keys: FrameProtection, header: Header, payload: bytes = b"") -> bytes:
    return keys.sealer.seal(header.encode(), payload)


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING)


# ---- headers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        Header(Kind.PUSH, F32, 0, 1, 0, 1, PUSH_BYTES),
        Header(Kind.PULL, DTYPE_CODES[torch.bfloat16], 65535, 2**32 - 1, -1, 0, 0),
        Header(Kind.PARAMS, DTYPE_CODES[torch.float64], 7, 3, 2**62, -(2**62), 2**64 - 1),
        Header(Kind.ERROR, 0, 0, 0, 0, -1, 4096),
        Header(Kind.BYE, 0, 0, 5, 0, 0, 0),
    ],
)
def test_header_round_trips(header):
    data = header.encode()
    assert len(data) == HEADER.size == 36
    assert data[:4] == b"SDPS"
    assert Header.decode(data) == header


@pytest.mark.parametrize(
    "data, message",
    [
        (b"XXXX" + Header(Kind.PUSH, F32, 0, 1, 0, 1, 8).encode()[4:], "bad frame magic"),
        (Header(99, F32, 0, 1, 0, 1, 8).encode(), "unknown frame kind 99"),
        (Header(Kind.PUSH, 42, 0, 1, 0, 1, 8).encode(), "unknown dtype code 42"),
        (Header(Kind.PUSH, F32, 0, 1, 0, 1, 8).encode()[:20], "truncated header"),
    ],
)
def test_header_decode_rejects_malformed_bytes(data, message):
    with pytest.raises(WireError, match=message):
        Header.decode(data)


def test_header_fields_out_of_range_cannot_be_encoded():
    with pytest.raises(struct.error):
        Header(Kind.PUSH, F32, 70000, 1, 0, 1, 8).encode()  # table id is 16 bits


# ---- the server under attack -----------------------------------------------------------------


def test_a_good_client_pushes_and_pulls(server):
    client = ShardClient(server.address, SECRET, 3, 0, timeout_s=10)
    try:
        assert torch.equal(_push(client, clock=0), torch.arange(N, dtype=torch.float32) - 0.5)
        # A learning rate sent with the push replaces the server's (LR schedulers).
        assert torch.equal(_push(client, clock=1, lr=0.25), torch.arange(N, dtype=torch.float32) - 0.75)
        client.send(Header(Kind.PULL, F32, 0, 3, -1, 0, 0))
        out = torch.empty(N)
        client.receive(byte_view(out), 0)
        assert torch.equal(out, torch.arange(N, dtype=torch.float32) - 0.75)
    finally:
        client.close()
    assert server.wait_for(lambda clock: 3 in clock.finished), "BYE did not mark the worker finished"
    assert server.shard.updates == 2


def test_wrong_secret_is_rejected_logged_and_the_server_keeps_serving(server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(ParameterServerError, match="handshake with the parameter server on rank 0 failed"):
            ShardClient(server.address, b"not the secret" * 3, 1, 0, timeout_s=10)
        _good_client_is_served(server, 2)
    assert "authentication failed" in _warnings(caplog)
    assert 1 not in server.shard.clock.lost  # an unauthenticated peer never becomes a worker


def test_garbage_bytes_are_dropped_and_logged(server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock = socket.create_connection(server.address, timeout=10)
        sock.sendall(os.urandom(4096))
        assert closed_by_server(sock)
        _good_client_is_served(server, 1)
    assert "dropping unauthenticated peer" in _warnings(caplog)
    assert "authentication failed" in _warnings(caplog)


def test_garbage_after_authenticating_is_dropped_and_the_worker_counts_as_lost(server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock = _authenticated(server.address, 4)
        sock.sendall(os.urandom(HEADER.size))
        assert closed_by_server(sock)
        _good_client_is_served(server, 1)
    assert "dropping rank 4" in _warnings(caplog) and "bad frame magic" in _warnings(caplog)
    assert server.wait_for(lambda clock: 4 in clock.lost)


def test_a_truncated_message_times_out_and_is_dropped(quick_server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock = _authenticated(quick_server.address, 5)
        sock.sendall(Header(Kind.PUSH, F32, 0, 5, 0, 1, PUSH_BYTES).encode() + b"\0" * (PUSH_BYTES // 2))
        started = time.monotonic()
        assert closed_by_server(sock), "a stalled frame must not hold the connection forever"
        assert time.monotonic() - started < 20
        _good_client_is_served(quick_server, 1)
    assert "dropping rank 5" in _warnings(caplog) and "timed out" in _warnings(caplog)
    assert quick_server.shard.updates == 1  # the partial push was never applied


def test_a_stalled_handshake_times_out(quick_server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock = socket.create_connection(quick_server.address, timeout=10)
        assert closed_by_server(sock)
    assert "handshake not completed within 1s" in _warnings(caplog)


@pytest.mark.parametrize("sent", ["half a header", "header and half a payload"])
def test_a_peer_that_disconnects_mid_message_is_dropped(server, caplog, sent):
    frame = Header(Kind.PUSH, F32, 0, 6, 0, 1, PUSH_BYTES).encode()
    partial = frame[: HEADER.size // 2] if sent == "half a header" else frame + b"\0" * (PUSH_BYTES // 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock = _authenticated(server.address, 6)
        sock.sendall(partial)
        sock.close()
        assert server.wait_for(lambda clock: 6 in clock.lost)
        _good_client_is_served(server, 1)
    assert "truncated" in _warnings(caplog)
    assert server.shard.updates == 1


@pytest.mark.parametrize(
    "header, message",
    [
        (Header(Kind.PUSH, F32, 0, 6, 0, 1, 2**62), "whose shard takes exactly 48"),
        (Header(Kind.PUSH, F32, 0, 6, 0, 1, PUSH_BYTES + 1), "whose shard takes exactly 48"),
        (Header(Kind.PUSH, F32, 0, 6, 0, 1000, 8000 + 4 * N), "carries 1000 learning rates"),
        (Header(Kind.PULL, F32, 0, 6, -1, 0, 2**40), "PULL frames have clock -1 and no payload"),
        (Header(Kind.PUSH, DTYPE_CODES[torch.float64], 0, 6, 0, 1, 8 + 8 * N), "dtype code"),
        (Header(Kind.PARAMS, F32, 0, 6, 0, 0, 4 * N), "unexpected PARAMS frame from a worker"),
        (Header(Kind.PUSH, F32, 0, 7, 0, 1, PUSH_BYTES), "frame claims rank 7 on rank 6's connection"),
        (Header(Kind.PUSH, F32, 0, 6, 5, 1, PUSH_BYTES), "pushed clock 5, expected 0"),
    ],
    ids=[
        "huge-length",
        "length-off-by-one",
        "too-many-lrs",
        "pull-with-payload",
        "wrong-dtype",
        "server-kind",
        "other-rank",
        "clock-skip",
    ],
)
def test_oversized_or_inconsistent_headers_are_dropped_before_any_payload(server, caplog, header, message):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock, keys = _authenticated_with_keys(server.address, 6)
        payload = b"\0" * 8 + bytes(byte_view(torch.ones(N))) if header.length == PUSH_BYTES else b""
        sock.sendall(_sealed(keys, header, payload))  # authentic frames: the checks still apply
        assert closed_by_server(sock)
        _good_client_is_served(server, 1)
    assert message in _warnings(caplog)
    assert server.shard.updates == 1


def test_a_negative_learning_rate_is_rejected(server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock, keys = _authenticated_with_keys(server.address, 6)
        lrs = torch.tensor([-1.0], dtype=torch.float64)
        sock.sendall(
            _sealed(
                keys,
                Header(Kind.PUSH, F32, 0, 6, 0, 1, PUSH_BYTES),
                bytes(byte_view(lrs)) + bytes(byte_view(torch.ones(N))),
            )
        )
        assert closed_by_server(sock)
        _good_client_is_served(server, 1)
    assert "negative or infinite learning rate" in _warnings(caplog)


def test_a_rank_cannot_connect_twice_or_as_the_server_itself(server, caplog):
    first = _authenticated(server.address, 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        second = _authenticated(server.address, 2)
        assert closed_by_server(second)
        itself = _authenticated(server.address, 0)
        assert closed_by_server(itself)
    first.close()
    assert "rank 2 is already connected" in _warnings(caplog)
    assert "invalid rank 0" in _warnings(caplog)


def test_pending_handshakes_are_capped_while_an_established_worker_keeps_being_served(caplog):
    # Pending handshakes are capped (at most half of MAX_PENDING_HANDSHAKES from one address);
    # over it the oldest idle peer is dropped, so new workers still get in (issue #29).
    srv = _Server(timeout_s=60.0)
    established = ShardClient(srv.address, SECRET, 3, 0, timeout_s=10)  # a worker, before the flood
    per_peer = MAX_PENDING_HANDSHAKES // 2
    idle = []
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for _ in range(MAX_PENDING_HANDSHAKES + 16):
                idle.append(socket.create_connection(srv.address, timeout=10))
                # Each one is greeted from its own thread: none is refused.
                assert recv_exact(idle[-1], len(GREETING), time.monotonic() + 10) == GREETING
            # The oldest were dropped to make room; the newest `per_peer` are held mid-handshake.
            dropped = idle[: len(idle) - per_peer]
            assert all(closed_by_server(sock) for sock in dropped)
            idle = idle[len(idle) - per_peer :]
            assert srv.server.pending_handshakes == per_peer
            # The established worker is not counted against the cap: it pushes and pulls as before.
            assert torch.equal(_push(established, clock=0), torch.arange(N, dtype=torch.float32) - 0.5)
            # A new worker gets in while the cap is full (the oldest idle peer goes for it).
            _good_client_is_served(srv, 4, updates_before=1)
            assert closed_by_server(idle.pop(0))
            assert srv.server.pending_handshakes == per_peer - 1
            assert torch.equal(_push(established, clock=1), torch.arange(N, dtype=torch.float32) - 1.5)
        assert "to make room: the oldest of 64 pending handshakes (32 from one address) go first" in _warnings(caplog)
        assert srv.shard.updates == 3
    finally:
        established.close()
        for sock in idle:
            sock.close()
        srv.server.close()


# ---- staleness waits over the wire -----------------------------------------------------------


def _ssp_server(timeout_s: float) -> _Server:
    srv = _Server(timeout_s=timeout_s, max_staleness=0)
    for rank in range(3, WORLD):  # a world where only ranks 1 and 2 train
        srv.shard.depart(rank, clean=True, reason="not in this test")
    return srv


def test_a_lost_worker_fails_the_others_wait_with_an_error_naming_it():
    srv = _ssp_server(timeout_s=60.0)
    try:
        doomed = _authenticated(srv.address, 2)
        doomed.close()
        client = ShardClient(srv.address, SECRET, 1, 0, timeout_s=60)
        started = time.monotonic()
        with pytest.raises(ParameterServerError) as info:
            _push(client)
        assert time.monotonic() - started < 30  # failed on the loss, not on the 60 s timeout
        assert info.value.peer_rank == 2
        assert "rank 2's worker left the parameter server on rank 0" in str(info.value)
        assert "max_staleness=0" in str(info.value)
        client.close()
    finally:
        srv.server.close()


def test_a_staleness_wait_times_out_naming_the_slow_worker():
    srv = _ssp_server(timeout_s=1.0)
    try:
        slow = _authenticated(srv.address, 2)  # connected, healthy, but never pushes
        client = ShardClient(srv.address, SECRET, 1, 0, timeout_s=1.0)
        with pytest.raises(ParameterServerError) as info:
            _push(client)
        assert info.value.peer_rank == 2
        assert "waited 1s on the parameter server of rank 0 for rank 2, which is stuck at clock 0" in str(info.value)
        client.close()
        slow.close()
    finally:
        srv.server.close()


# ---- the client side ---------------------------------------------------------------------------


@contextlib.contextmanager
def _fake_server(behaviour) -> Iterator[Tuple[str, int]]:
    listener = listen("127.0.0.1")
    listener.settimeout(30)

    def run() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                behaviour(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        thread.join(30)
        listener.close()


def test_the_client_rejects_a_server_that_does_not_know_the_secret():
    def impostor(conn: socket.socket) -> None:
        conn.sendall(GREETING + b"\0" + os.urandom(NONCE_BYTES))
        conn.recv(1024)
        conn.sendall(os.urandom(36))

    with _fake_server(impostor) as address:
        with pytest.raises(ParameterServerError, match="failed to prove the job's secret"):
            ShardClient(address, SECRET, 1, 0, timeout_s=10)


def test_the_client_names_the_server_rank_when_it_dies_mid_reply():
    def dies_mid_reply(conn: socket.socket) -> None:
        server_handshake(conn, SECRET, 3, time.monotonic() + 10)
        conn.recv(HEADER.size + PUSH_BYTES + TAG_BYTES, socket.MSG_WAITALL)
        conn.sendall(Header(Kind.PARAMS, F32, 0, 3, 0, 0, 4 * N).encode() + b"\0" * 8)

    with _fake_server(dies_mid_reply) as address:
        client = ShardClient(address, SECRET, 1, 3, timeout_s=10)
        with pytest.raises(ParameterServerError) as info:
            _push(client)
    assert info.value.peer_rank == 3
    assert "rank 1 lost the parameter server on rank 3" in str(info.value)
    assert "truncated reply" in str(info.value)


def test_the_client_checks_which_rank_answered():
    def wrong_rank(conn: socket.socket) -> None:
        server_handshake(conn, SECRET, 5, time.monotonic() + 10)
        conn.recv(1024)

    with _fake_server(wrong_rank) as address:
        with pytest.raises(ParameterServerError, match="expected the parameter server of rank 2, rank 5 answered"):
            ShardClient(address, SECRET, 1, 2, timeout_s=10)


def test_close_stops_the_server_and_its_threads():
    srv = _Server()
    idle = _authenticated(srv.address, 1)
    srv.server.close()
    assert closed_by_server(idle)
    assert not srv.server._accept_thread.is_alive()
    assert not srv.server._threads
    with pytest.raises(OSError):
        socket.create_connection(srv.address, timeout=5).close()


# ---- frame protection (sparkdl._net.frames; attacks through a tapping proxy: test_secure.py) ----------


def test_an_encrypted_client_pushes_pulls_and_says_bye():
    srv = _Server(encrypt=True)
    try:
        client = ShardClient(srv.address, SECRET, 3, 0, timeout_s=10, encrypt=True)
        assert torch.equal(_push(client, clock=0), torch.arange(N, dtype=torch.float32) - 0.5)
        client.send(Header(Kind.PULL, F32, 0, 3, -1, 0, 0))
        out = torch.empty(N)
        client.receive(byte_view(out), 0)
        assert torch.equal(out, torch.arange(N, dtype=torch.float32) - 0.5)
        client.close()
        assert srv.wait_for(lambda clock: 3 in clock.finished), "the sealed BYE was not honoured"
    finally:
        srv.server.close()


@pytest.mark.parametrize("server_encrypts", [True, False], ids=["server-encrypts", "worker-encrypts"])
def test_an_encryption_mismatch_fails_the_handshake_on_both_sides(caplog, server_encrypts):
    srv = _Server(encrypt=server_encrypts)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            with pytest.raises(ParameterServerError, match="encryption mismatch") as info:
                ShardClient(srv.address, SECRET, 2, 0, timeout_s=10, encrypt=not server_encrypts)
            assert "handshake with the parameter server on rank 0 failed" in str(info.value)
            assert f"this worker has encrypt={not server_encrypts}" in str(info.value)
            sock = socket.create_connection(srv.address, timeout=10)
            with pytest.raises(WireError, match="encryption mismatch"):
                client_handshake(sock, SECRET, 2, time.monotonic() + 10, not server_encrypts)
            assert closed_by_server(sock)  # so the server has logged why
            # The refused rank never became a worker: it may still connect, with the right setting.
            client = ShardClient(srv.address, SECRET, 2, 0, timeout_s=10, encrypt=server_encrypts)
            assert torch.equal(_push(client), torch.arange(N, dtype=torch.float32) - 0.5)
            client.close()
        assert (
            f"encryption mismatch: this parameter server has encrypt={server_encrypts} but the worker of rank 2"
            in _warnings(caplog)
        )
        assert 2 not in srv.shard.clock.lost
    finally:
        srv.server.close()


def test_a_frame_with_a_forged_tag_is_dropped_before_it_is_applied(server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock = _authenticated(server.address, 4)
        lrs = torch.tensor([math.nan], dtype=torch.float64)
        header = Header(Kind.PUSH, F32, 0, 4, 0, 1, PUSH_BYTES)
        # A well-formed push as it was sent before frame protection, and 16 bytes for the tag.
        sock.sendall(header.encode() + bytes(byte_view(lrs)) + bytes(byte_view(torch.ones(N))) + os.urandom(TAG_BYTES))
        assert closed_by_server(sock)
        _good_client_is_served(server, 1)
    assert "dropping rank 4" in _warnings(caplog) and "failed its integrity check" in _warnings(caplog)
    assert server.shard.updates == 1  # only the good client's push
    assert server.wait_for(lambda clock: 4 in clock.lost)


def test_a_forged_bye_does_not_count_as_a_clean_goodbye(server, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sock = _authenticated(server.address, 5)
        sock.sendall(Header(Kind.BYE, 0, 0, 5, 0, 0, 0).encode() + b"\0" * TAG_BYTES)
        assert closed_by_server(sock)
    assert server.wait_for(lambda clock: 5 in clock.lost)
    assert 5 not in server.shard.clock.finished
    assert "failed its integrity check" in _warnings(caplog)


def test_the_client_rejects_a_reply_that_fails_its_integrity_check():
    def forges_reply(conn: socket.socket) -> None:
        server_handshake(conn, SECRET, 3, time.monotonic() + 10)
        conn.recv(HEADER.size + PUSH_BYTES + TAG_BYTES, socket.MSG_WAITALL)
        values = bytes(byte_view(torch.zeros(N)))
        conn.sendall(Header(Kind.PARAMS, F32, 0, 3, 0, 0, 4 * N).encode() + values + os.urandom(TAG_BYTES))
        conn.recv(1024)

    with _fake_server(forges_reply) as address:
        client = ShardClient(address, SECRET, 1, 3, timeout_s=10)
        with pytest.raises(ParameterServerError) as info:
            _push(client)
        client.close()
    assert info.value.peer_rank == 3
    assert "a reply from the parameter server on rank 3 failed its integrity check" in str(info.value)


def test_a_server_out_of_memory_tells_the_worker_asking_and_keeps_serving(server, monkeypatch):
    from sparkdl.strategies.parameter_server.transport import OUT_OF_MEMORY

    def cannot_grow(*args, **kwargs):
        # What a sparse shard raises when its rows may not grow under Spark's Python memory limit.
        raise MemoryError("cannot map 512 MiB for 2,000,000 rows of a sparse table's shard")

    client = ShardClient(server.address, SECRET, 1, 0, timeout_s=10)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(server.shard, "push", cannot_grow)
            with pytest.raises(ParameterServerError) as info:
                _push(client)
        assert str(info.value).startswith(f"parameter server on rank 0: {OUT_OF_MEMORY} 1: cannot map 512 MiB")
        assert info.value.peer_rank == 0
        assert torch.equal(_push(client), torch.arange(N, dtype=torch.float32) - 0.5)  # the connection lives on
    finally:
        client.close()
