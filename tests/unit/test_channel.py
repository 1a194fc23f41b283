"""Tests of the task -> driver message channel over loopback (no Spark)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import socket
import struct
import threading
import time

import pytest

from sparkdl._channel import (
    MAX_MESSAGE_BYTES,
    ChannelClient,
    ChannelError,
    ChannelServer,
    new_secret,
)

HOST = "127.0.0.1"
WAIT = 5.0  # upper bound for any callback to arrive; tests normally finish far sooner


class Recorder:
    """Collects server callbacks into queues so tests can wait on them with timeouts."""

    def __init__(self) -> None:
        self.messages: queue.Queue = queue.Queue()
        self.disconnects: queue.Queue = queue.Queue()

    def on_message(self, rank: int, message: dict) -> None:
        self.messages.put((rank, message))

    def on_disconnect(self, rank: int, clean: bool) -> None:
        self.disconnects.put((rank, clean))


class LogCapture(logging.Handler):
    """Queues the channel logger's warnings; caplog offers no way to wait for a record."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: queue.Queue = queue.Queue()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.put(record)

    def wait_for(self, text: str, timeout: float = WAIT) -> logging.LogRecord:
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            try:
                record = self.records.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no warning containing {text!r}; saw {seen}") from None
            seen.append(record.getMessage())
            if text in record.getMessage():
                return record


@pytest.fixture
def secret() -> bytes:
    return new_secret()


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def logs():
    handler = LogCapture()
    logger = logging.getLogger("sparkdl.channel")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture
def make_server(secret, rec):
    servers = []

    def make(**kwargs) -> ChannelServer:
        server = ChannelServer(HOST, secret, rec.on_message, rec.on_disconnect, **kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def server(make_server) -> ChannelServer:
    return make_server()


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def raw_authenticated(address, secret: bytes, rank: int) -> socket.socket:
    """Performs the handshake by hand, so tests can then misbehave on the wire."""
    sock = socket.create_connection(address, timeout=WAIT)
    greeting = recv_exact(sock, 40)
    assert greeting[:8] == b"SPKDLv1\0"
    digest = hmac.new(secret, greeting[8:], hashlib.sha256).digest()
    sock.sendall(digest + frame(b'{"kind":"hello","rank":%d}' % rank))
    (length,) = struct.unpack(">I", recv_exact(sock, 4))
    assert b'"ready"' in recv_exact(sock, length)
    return sock


def assert_closed_by_server(sock: socket.socket) -> None:
    # Unread bytes on the server side turn its close into a reset instead of a FIN.
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def get(q: queue.Queue):
    return q.get(timeout=WAIT)


def assert_good_client_works(
    server: ChannelServer, secret: bytes, rec: Recorder, rank: int = 0
) -> None:
    with ChannelClient(server.address, secret, rank=rank) as client:
        client.send({"kind": "progress", "epoch": 1})
        assert get(rec.messages) == (rank, {"kind": "progress", "epoch": 1})
    assert get(rec.disconnects) == (rank, True)


def test_round_trip_in_order_per_rank_and_clean_close(server, secret, rec):
    c0 = ChannelClient(server.address, secret, rank=0)
    c1 = ChannelClient(server.address, secret, rank=1)
    for i in range(20):
        c0.send({"kind": "progress", "epoch": i, "loss": 0.5 / (i + 1)})
        c1.send({"kind": "log", "line": f"línea {i} ✓", "n": {"a": [1, None, True]}})
    received = {0: [], 1: []}
    for _ in range(40):
        rank, message = get(rec.messages)
        received[rank].append(message)
    sent0 = [{"kind": "progress", "epoch": i, "loss": 0.5 / (i + 1)} for i in range(20)]
    sent1 = [{"kind": "log", "line": f"línea {i} ✓", "n": {"a": [1, None, True]}} for i in range(20)]
    assert received[0] == sent0
    assert received[1] == sent1
    c0.close()
    c1.close()
    c1.close()  # idempotent
    assert {get(rec.disconnects), get(rec.disconnects)} == {(0, True), (1, True)}
    assert rec.messages.empty()  # hello and bye are not delivered


def test_concurrent_sends_from_threads_arrive_intact(server, secret, rec):
    with ChannelClient(server.address, secret, rank=2) as client:
        def worker(t: int) -> None:
            for i in range(50):
                client.send({"kind": "log", "thread": t, "i": i, "pad": "x" * 1000})

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        got = [get(rec.messages) for _ in range(200)]
    assert all(rank == 2 for rank, _ in got)
    for t in range(4):
        assert [m["i"] for _, m in got if m["thread"] == t] == list(range(50))


def test_abrupt_drop_reports_unclean_disconnect(server, secret, rec, logs):
    client = ChannelClient(server.address, secret, rank=3)
    client.send({"kind": "progress", "epoch": 0})
    assert get(rec.messages) == (3, {"kind": "progress", "epoch": 0})
    client._sock.close()  # the task process dies: no bye
    assert get(rec.disconnects) == (3, False)
    logs.wait_for("without saying bye")
    client.close()  # must not raise on an already-dead socket


def test_wrong_secret_is_rejected_and_server_keeps_serving(server, secret, rec, logs):
    with pytest.raises(ChannelError):
        ChannelClient(server.address, b"not-the-secret", rank=5)
    record = logs.wait_for("authentication failed")
    assert secret.hex() not in record.getMessage()
    assert_good_client_works(server, secret, rec)
    # The rejected peer was already dropped (logged) before the good client connected.
    assert rec.messages.empty()
    assert rec.disconnects.empty()


def test_client_rejects_server_with_bad_magic(secret):
    with socket.create_server((HOST, 0)) as fake:
        def serve() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 64)
                try:
                    conn.recv(1024)
                except OSError:
                    pass  # the client hangs up, possibly with a reset

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        with pytest.raises(ChannelError, match="bad greeting"):
            ChannelClient(fake.getsockname(), secret, rank=0, timeout=WAIT)
        t.join(WAIT)


def test_client_connect_failure_raises_channel_error(secret):
    with socket.create_server((HOST, 0)) as unused:
        address = unused.getsockname()
    with pytest.raises(ChannelError, match="cannot connect"):
        ChannelClient(address, secret, rank=0, timeout=1.0)


def test_garbage_instead_of_handshake_is_dropped(server, secret, rec, logs):
    with socket.create_connection(server.address, timeout=WAIT) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: driver\r\n\r\n" + b"\x00" * 64)
        recv_exact(sock, 40)
        assert_closed_by_server(sock)
    logs.wait_for("authentication failed")
    assert_good_client_works(server, secret, rec)
    assert rec.disconnects.empty()


def test_truncated_frame_is_dropped(server, secret, rec, logs):
    sock = raw_authenticated(server.address, secret, rank=4)
    sock.sendall(struct.pack(">I", 100) + b'{"kind":"x')
    sock.close()
    assert get(rec.disconnects) == (4, False)
    logs.wait_for("truncated frame")
    assert rec.messages.empty()
    assert_good_client_works(server, secret, rec)


def test_oversize_header_is_dropped(make_server, secret, rec, logs):
    server = make_server(max_message_bytes=1024)
    with raw_authenticated(server.address, secret, rank=6) as sock:
        sock.sendall(struct.pack(">I", 0xFFFFFFFF) + b"{}")
        assert get(rec.disconnects) == (6, False)
    logs.wait_for("exceeds the limit")
    assert rec.messages.empty()
    assert_good_client_works(server, secret, rec)


def test_client_refuses_oversized_message_and_stays_usable(make_server, secret, rec):
    server = make_server(max_message_bytes=1024)
    with ChannelClient(server.address, secret, rank=0) as client:
        with pytest.raises(ChannelError, match="exceeds"):
            client.send({"kind": "log", "line": "x" * 2000})  # limit learned from the server
        client.send({"kind": "log", "line": "small"})
        assert get(rec.messages) == (0, {"kind": "log", "line": "small"})
    assert get(rec.disconnects) == (0, True)
    assert MAX_MESSAGE_BYTES == 1 << 20


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"[1,2]", id="array"),
        pytest.param(b'"text"', id="string"),
        pytest.param(b"42", id="number"),
        pytest.param(b"null", id="null"),
        pytest.param(b"not json", id="not-json"),
        pytest.param(b'{"a": "\xff\xfe"}', id="bad-utf8-in-string"),
        pytest.param(b"\xff\xfe{}", id="bad-utf8"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[" * 50000, id="deep-nesting"),
    ],
)
def test_malformed_payload_is_dropped(make_server, secret, rec, logs, payload):
    server = make_server(max_message_bytes=100_000)
    with raw_authenticated(server.address, secret, rank=7) as sock:
        sock.sendall(frame(payload))
        assert get(rec.disconnects) == (7, False)
    logs.wait_for("dropping rank 7")
    assert rec.messages.empty()
    assert_good_client_works(server, secret, rec)


@pytest.mark.parametrize(
    "hello",
    [
        b'{"kind":"hello","rank":"0"}',
        b'{"kind":"hello","rank":-1}',
        b'{"kind":"hello","rank":true}',
        b'{"kind":"x"}',
    ],
)
def test_invalid_hello_is_dropped(server, secret, rec, logs, hello):
    with socket.create_connection(server.address, timeout=WAIT) as sock:
        greeting = recv_exact(sock, 40)
        sock.sendall(hmac.new(secret, greeting[8:], hashlib.sha256).digest() + frame(hello))
        assert_closed_by_server(sock)
    logs.wait_for("invalid hello")
    assert rec.disconnects.empty()


def test_reserved_kind_after_handshake_is_dropped_and_client_refuses_it(server, secret, rec, logs):
    with raw_authenticated(server.address, secret, rank=1) as sock:
        sock.sendall(frame(b'{"kind":"hello","rank":0}'))
        assert get(rec.disconnects) == (1, False)
    logs.wait_for("unexpected 'hello' frame")
    with ChannelClient(server.address, secret, rank=0) as client:
        with pytest.raises(ValueError):
            client.send({"kind": "bye"})
        with pytest.raises(TypeError):
            client.send([1, 2])  # type: ignore[arg-type]


def test_silent_peer_is_dropped_after_handshake_timeout(make_server, secret, rec, logs):
    server = make_server(handshake_timeout=0.5)
    start = time.monotonic()
    with socket.create_connection(server.address, timeout=WAIT) as silent:
        assert len(recv_exact(silent, 40)) == 40
        # Another client is served while the silent peer is still pending.
        with ChannelClient(server.address, secret, rank=0) as client:
            client.send({"kind": "progress"})
            assert get(rec.messages) == (0, {"kind": "progress"})
        assert logs.records.empty(), "silent peer dropped before the good client finished"
        assert silent.recv(1) == b""  # blocks until the server gives up on it
        elapsed = time.monotonic() - start
    assert 0.4 <= elapsed < 3.0
    logs.wait_for("handshake not completed within 0.5s")
    assert get(rec.disconnects) == (0, True)
    assert rec.disconnects.empty()


def test_callback_exception_is_logged_not_fatal(secret, caplog):
    delivered: queue.Queue = queue.Queue()

    def on_message(rank: int, message: dict) -> None:
        if message.get("boom"):
            raise RuntimeError("callback bug")
        delivered.put(message)

    with ChannelServer(HOST, secret, on_message) as server:
        with ChannelClient(server.address, secret, rank=0) as client:
            client.send({"kind": "x", "boom": True})
            client.send({"kind": "x", "n": 2})
            assert delivered.get(timeout=WAIT) == {"kind": "x", "n": 2}
    assert "callback bug" in caplog.text


def test_binds_only_given_host(server):
    host, port = server.address
    assert host == "127.0.0.1"
    assert 0 < port < 65536


def test_close_is_idempotent_unblocks_and_breaks_clients(server, secret, rec):
    client = ChannelClient(server.address, secret, rank=0, timeout=2.0)
    client.send({"kind": "progress"})
    assert get(rec.messages) == (0, {"kind": "progress"})
    start = time.monotonic()
    server.close()  # the rank-0 reader is blocked in recv without a timeout
    assert time.monotonic() - start < 2.0
    server.close()
    with server:
        pass  # __exit__ after close is a no-op
    assert rec.disconnects.empty()  # connections ended by close() are not reported
    deadline = time.monotonic() + WAIT
    with pytest.raises(ChannelError):
        while time.monotonic() < deadline:
            client.send({"kind": "progress"})
            time.sleep(0.01)  # polling for the error, not synchronizing
    with pytest.raises(ChannelError, match="closed"):
        client.send({"kind": "progress"})
    client.close()
    with pytest.raises(ChannelError):
        ChannelClient(server.address, secret, rank=0, timeout=1.0)


def test_new_secret_is_random_32_bytes():
    a, b = new_secret(), new_secret()
    assert len(a) == 32 and isinstance(a, bytes) and a != b
