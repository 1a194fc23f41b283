"""Tests of the task -> driver message channel over loopback (no Spark)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time

import pytest

from sparkdl._net.channel import (
    GREETING_BYTES,
    KEY_LABEL,
    MAX_MESSAGE_BYTES,
    ChannelClient,
    ChannelError,
    ChannelServer,
    new_secret,
)
from sparkdl._net.frames import TAG_BYTES, protection

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


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class RawPeer:
    """A client whose handshake is done by hand (wire format v2), so tests can then misbehave on
    the wire: ``seal`` makes frames the server accepts as authentic, whatever they contain."""

    def __init__(self, address, secret: bytes, encrypt: bool = False) -> None:
        self.sock = socket.create_connection(address, timeout=WAIT)
        greeting = recv_exact(self.sock, GREETING_BYTES)
        assert greeting[:8] == b"SPKDLv2\0" and greeting[8] == int(encrypt)
        server_nonce, client_nonce, mode = greeting[9:], os.urandom(32), bytes([int(encrypt)])
        proof = hmac.new(secret, b"sparkdl-channel client" + server_nonce + client_nonce + mode, hashlib.sha256)
        self.sock.sendall(client_nonce + mode + proof.digest())
        self.keys = protection(secret, KEY_LABEL, server_nonce, client_nonce, encrypt, server=False)

    def seal(self, payload: bytes) -> bytes:
        return self.keys.sealer.seal(struct.pack(">I", len(payload)), payload)

    def read_frame(self) -> bytes:
        header = recv_exact(self.sock, 4)
        (length,) = struct.unpack(">I", header)
        body = recv_exact(self.sock, length + TAG_BYTES)
        return self.keys.opener.open(header, body[:length], body[length:])

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawPeer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def raw_authenticated(address, secret: bytes, rank: int) -> RawPeer:
    """Performs the handshake by hand, so tests can then misbehave on the wire."""
    peer = RawPeer(address, secret)
    peer.sendall(peer.seal(b'{"kind":"hello","rank":%d}' % rank))
    assert b'"ready"' in peer.read_frame()
    return peer


def assert_closed_by_server(sock: socket.socket) -> None:
    # Unread bytes on the server side turn its close into a reset instead of a FIN.
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def get(q: queue.Queue):
    return q.get(timeout=WAIT)


def assert_good_client_works(server: ChannelServer, secret: bytes, rec: Recorder, rank: int = 0) -> None:
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


def _send_from_threads(client, rec, threads: int, per_thread: int, message):
    """``message(thread, i)`` sent by ``threads`` threads at once, ``per_thread`` each; returns
    the (rank, message) pairs the server received, in arrival order."""

    def worker(t: int) -> None:
        for i in range(per_thread):
            client.send(message(t, i))

    started = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(WAIT)
    return [get(rec.messages) for _ in range(threads * per_thread)]


def test_concurrent_sends_from_threads_arrive_intact(server, secret, rec):
    with ChannelClient(server.address, secret, rank=2) as client:
        got = _send_from_threads(
            client, rec, 4, 50, lambda t, i: {"kind": "log", "thread": t, "i": i, "pad": "x" * 1000}
        )
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


def _idle_flood(address, count: int) -> list:
    """``count`` idle connections (they never answer the greeting); the caller closes them."""
    socks = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection(address, timeout=WAIT))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def test_a_flood_of_idle_connections_before_a_rank_connects_does_not_keep_it_out(server, secret, rec):
    # Issue #29: 300 idle connections made the rank's one connection look like a "bad greeting".
    flood = _idle_flood(server.address, 300)
    try:
        start = time.monotonic()
        with ChannelClient(server.address, secret, rank=0, timeout=30.0) as client:
            client.send({"kind": "progress", "n": 1})
            assert get(rec.messages) == (0, {"kind": "progress", "n": 1})
        assert time.monotonic() - start < 5.0  # served at once, not after the flood times out
        assert get(rec.disconnects) == (0, True)
        assert server.pending_handshakes <= 32  # the flood holds at most half the slots
    finally:
        for sock in flood:
            sock.close()


def test_a_rank_gets_through_while_a_flooder_keeps_opening_connections(server, secret, rec):
    stop, held, errors = threading.Event(), [], []

    def flooder() -> None:
        try:
            while not stop.is_set() and len(held) < 3000:
                held.append(socket.create_connection(server.address, timeout=WAIT))
        except OSError as exc:  # noqa: PERF203 - reported below
            errors.append(exc)

    thread = threading.Thread(target=flooder, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT
        while len(held) < 200:  # the flood is under way before the rank connects
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)  # polling the flooder's progress
        for rank in range(4):
            with ChannelClient(server.address, secret, rank=rank, timeout=30.0) as client:
                client.send({"kind": "progress", "rank": rank})
                assert get(rec.messages) == (rank, {"kind": "progress", "rank": rank})
    finally:
        stop.set()
        thread.join(WAIT)
        for sock in held:
            sock.close()
    assert not errors, errors


def test_a_server_that_never_answers_is_named_as_such_not_as_a_foreign_server(secret):
    with socket.create_server((HOST, 0)) as mute:  # accepts (the kernel does) but never greets
        host, port = mute.getsockname()[:2]
        start = time.monotonic()
        with pytest.raises(ChannelError) as info:
            ChannelClient(mute.getsockname(), secret, rank=0, timeout=1.0)
        assert time.monotonic() - start < 3.0
    text = str(info.value)
    assert f"the channel server at {host}:{port} did not complete the handshake within 1 s" in text, text
    assert "flooded" in text and "bad greeting" not in text and "not a sparkdl" not in text, text


def test_a_server_that_hangs_up_on_every_connection_is_retried_then_named(secret):
    with socket.create_server((HOST, 0)) as listener:
        stop, accepted = threading.Event(), []

        def refuse() -> None:  # what a server does to a connection it will not serve
            listener.settimeout(0.1)
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                accepted.append(1)
                conn.close()

        thread = threading.Thread(target=refuse, daemon=True)
        thread.start()
        try:
            with pytest.raises(ChannelError) as info:
                ChannelClient(listener.getsockname(), secret, rank=0, timeout=1.5)
        finally:
            stop.set()
            thread.join(WAIT)
    text = str(info.value)
    assert (
        "did not complete the handshake within 1.5 s" in text and "closed the connection before its greeting" in text
    ), text
    assert "bad greeting" not in text and len(accepted) > 2, (text, len(accepted))


def test_a_wrong_secret_still_fails_soon_and_says_so(server, secret):
    start = time.monotonic()
    with pytest.raises(ChannelError, match=r"wrong secret\?"):
        ChannelClient(server.address, b"not the secret", rank=0, timeout=30.0)
    assert time.monotonic() - start < 5.0  # retried twice, not for the whole timeout


def test_garbage_instead_of_handshake_is_dropped(server, secret, rec, logs):
    with socket.create_connection(server.address, timeout=WAIT) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: driver\r\n\r\n" + b"\x00" * 64)
        recv_exact(sock, GREETING_BYTES)
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
        sock.sendall(sock.seal(payload))
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
    with RawPeer(server.address, secret) as peer:
        peer.sendall(peer.seal(hello))
        assert_closed_by_server(peer.sock)
    logs.wait_for("invalid hello")
    assert rec.disconnects.empty()


def test_reserved_kind_after_handshake_is_dropped_and_client_refuses_it(server, secret, rec, logs):
    with raw_authenticated(server.address, secret, rank=1) as sock:
        sock.sendall(sock.seal(b'{"kind":"hello","rank":0}'))
        assert get(rec.disconnects) == (1, False)
    logs.wait_for("unexpected 'hello' frame")
    with ChannelClient(server.address, secret, rank=0) as client:
        with pytest.raises(ValueError):
            client.send({"kind": "bye"})
        with pytest.raises(TypeError):
            client.send([1, 2])  # type: ignore[arg-type]


def test_a_silent_peer_does_not_hold_up_other_clients(make_server, secret, rec, logs):
    # A handshake timeout far longer than the test: the silent peer is certainly still pending
    # while the good client is served, however slow a loaded machine is.
    server = make_server(handshake_timeout=60.0)
    with socket.create_connection(server.address, timeout=WAIT) as silent:
        assert len(recv_exact(silent, GREETING_BYTES)) == GREETING_BYTES
        with ChannelClient(server.address, secret, rank=0) as client:
            client.send({"kind": "progress"})
            assert get(rec.messages) == (0, {"kind": "progress"})
        assert get(rec.disconnects) == (0, True)
        assert logs.records.empty(), "the silent peer was dropped before the good client finished"
    assert rec.disconnects.empty()


def test_silent_peer_is_dropped_after_handshake_timeout(make_server, secret, rec, logs):
    server = make_server(handshake_timeout=0.5)
    start = time.monotonic()
    # The server's drop is the event: the recv returns b"" once it gives up on the peer. Were the
    # timeout not enforced, the recv would time out instead (after 30 s, 60 times the handshake
    # timeout: generous for a loaded machine, and bounded).
    with socket.create_connection(server.address, timeout=30.0) as silent:
        assert len(recv_exact(silent, GREETING_BYTES)) == GREETING_BYTES
        assert silent.recv(1) == b""
        elapsed = time.monotonic() - start
    # Not before the timeout: its clock starts at the accept, after ``start`` (a hair under 0.5 s:
    # socket timeouts are kept in milliseconds).
    assert elapsed >= 0.49
    logs.wait_for("handshake not completed within 0.5s")
    assert rec.disconnects.empty()  # an unauthenticated peer is no rank


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
    before = set(threading.enumerate())
    client = ChannelClient(server.address, secret, rank=0, timeout=2.0)
    client.send({"kind": "progress"})
    assert get(rec.messages) == (0, {"kind": "progress"})
    (reader,) = [t for t in threading.enumerate() if t not in before and t.name.startswith("sparkdl-channel-(")]
    server.close()  # the rank-0 reader is blocked in recv without a timeout
    # close() shut the connection down, so the reader returned: it does not wait for a timeout
    # (close() would give up on it after 5 s and leave it blocked).
    assert not reader.is_alive()
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


# ---- a flood of unauthenticated connections (issue #15) --------------------------------------

# Runs in its own process, so that the test process's fd count is the server's: opens as many
# connections as each line read asks for, keeps them all open, reports the totals per line, and
# closes everything on "0".
_FLOODER = r"""
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
if soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
host, port = sys.argv[1], int(sys.argv[2])
held, failed = [], 0
for line in sys.stdin:
    count = int(line)
    if count == 0:
        break
    for _ in range(count):
        try:
            held.append(socket.create_connection((host, port), timeout=10))
        except OSError:
            failed += 1
    print(len(held), failed, flush=True)
for sock in held:
    sock.close()
"""


class _FloodWatch(ChannelServer):
    """The real server, counting each flood connection's one outcome (dropped: to make room for
    newer ones, or when the flooder hung up)."""

    def __init__(self, *args, **kwargs) -> None:
        self.outcomes = threading.Semaphore(0)
        super().__init__(*args, **kwargs)

    def _log_drop(self, *args, authenticated: bool = False) -> None:
        super()._log_drop(*args, authenticated=authenticated)
        if not authenticated:
            self.outcomes.release()


def test_flood_of_unauthenticated_connections_is_bounded_and_summarized(secret, rec, logs):
    import os
    import re
    import subprocess
    import sys

    total, batch = 2000, 100
    server = _FloodWatch(HOST, secret, rec.on_message, rec.on_disconnect)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def server_threads() -> int:
        with server._lock:
            return len(server._threads)

    flooder = subprocess.Popen(
        [sys.executable, "-c", _FLOODER, *map(str, server.address)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with ChannelClient(server.address, secret, rank=0) as client:
            client.send({"kind": "progress", "n": -1})
            assert get(rec.messages) == (0, {"kind": "progress", "n": -1})
            base_fds, base_threads = fds(), threading.active_count()
            peak_fds = peak_threads = peak_server_threads = 0
            for n in range(total // batch):
                flooder.stdin.write(f"{batch}\n")
                flooder.stdin.flush()
                held, failed = map(int, flooder.stdout.readline().split())  # bounded: connect timeout
                assert (held, failed) == ((n + 1) * batch, 0)
                client.send({"kind": "progress", "n": n})  # the real rank is served throughout
                assert get(rec.messages) == (0, {"kind": "progress", "n": n})
                peak_fds = max(peak_fds, fds() - base_fds)
                peak_threads = max(peak_threads, threading.active_count() - base_threads)
                peak_server_threads = max(peak_server_threads, server_threads())
            flooder.stdin.write("0\n")
            flooder.stdin.flush()
            assert flooder.wait(timeout=WAIT) == 0
            # Every flood connection was dropped to make room, or when the flooder hung up.
            deadline = time.monotonic() + WAIT
            for _ in range(total):
                assert server.outcomes.acquire(timeout=max(0.0, deadline - time.monotonic()))
        assert get(rec.disconnects) == (0, True)
        # A dropped connection is logged (its outcome above) before its thread stops counting as
        # pending; once every connection is closed none can be pending.
        assert server.wait_idle(WAIT) and server.pending_handshakes == 0
        assert_good_client_works(server, secret, rec, rank=1)  # admitted again after the flood
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait(timeout=WAIT)
        flooder.stdin.close()
        flooder.stdout.close()
        server.close()
    print(f"flood of {total}: peak +{peak_threads} threads (server {peak_server_threads}), +{peak_fds} fds")
    assert peak_server_threads <= 64 + 1  # the pending cap + the real rank
    assert peak_threads < 64 + 20
    assert peak_fds < 64 + 20
    lines = []
    while not logs.records.empty():
        lines.append(logs.records.get_nowait().getMessage())
    print(f"{len(lines)} warning lines:", *lines, sep="\n  ")
    assert len(lines) < 20
    counts = [re.search(r"dropped ([\d,]+) more unauthenticated connections", line) for line in lines]
    summarized = sum(int(m.group(1).replace(",", "")) for m in counts if m)
    assert any(counts), "no summary line"
    assert summarized + sum(1 for m in counts if not m) == total  # no connection unaccounted for


# ---- frame protection (sparkdl._net.frames; attacks through a tapping proxy: test_secure.py) ----------


@pytest.mark.parametrize("encrypt", [False, True], ids=["integrity", "encrypt"])
def test_both_modes_round_trip_with_concurrent_senders(make_server, secret, rec, encrypt):
    server = make_server(encrypt=encrypt)
    assert server.encrypt is encrypt
    with ChannelClient(server.address, secret, rank=5, encrypt=encrypt) as client:
        assert client.encrypt is encrypt
        got = _send_from_threads(
            client, rec, 4, 25, lambda t, i: {"kind": "log", "thread": t, "i": i, "line": "ünïcode ✓" * (i + 1)}
        )
    for t in range(4):  # frame counters follow the wire order even with threads racing
        assert [m["i"] for _, m in got if m["thread"] == t] == list(range(25))
    assert get(rec.disconnects) == (5, True)


@pytest.mark.parametrize("server_encrypts", [True, False], ids=["server-encrypts", "client-encrypts"])
def test_an_encryption_mismatch_fails_at_the_handshake_on_both_sides(make_server, secret, rec, logs, server_encrypts):
    server = make_server(encrypt=server_encrypts)
    with pytest.raises(ChannelError, match="encryption mismatch") as info:
        ChannelClient(server.address, secret, rank=0, encrypt=not server_encrypts)
    assert f"this channel client has encrypt={not server_encrypts}" in str(info.value)
    logs.wait_for(f"encryption mismatch: this channel server has encrypt={server_encrypts}")
    assert rec.disconnects.empty()  # never admitted
    with ChannelClient(server.address, secret, rank=0, encrypt=server_encrypts) as client:
        client.send({"kind": "progress"})
        assert get(rec.messages) == (0, {"kind": "progress"})


def test_an_unsealed_or_forged_frame_after_the_handshake_is_dropped(server, secret, rec, logs):
    with raw_authenticated(server.address, secret, rank=3) as peer:
        payload = b'{"kind":"progress","forged":true}'
        # What the frame looked like before frame protection, plus 16 bytes where the tag goes.
        peer.sendall(struct.pack(">I", len(payload)) + payload + b"\0" * TAG_BYTES)
        assert get(rec.disconnects) == (3, False)
    logs.wait_for("failed its integrity check")
    assert rec.messages.empty()


def test_an_unknown_protection_mode_is_refused_after_authentication(server, secret, rec, logs):
    with socket.create_connection(server.address, timeout=WAIT) as sock:
        greeting = recv_exact(sock, GREETING_BYTES)
        client_nonce, mode = os.urandom(32), b"\x07"
        proof = hmac.new(secret, b"sparkdl-channel client" + greeting[9:] + client_nonce + mode, hashlib.sha256)
        sock.sendall(client_nonce + mode + proof.digest())
        assert_closed_by_server(sock)
    logs.wait_for("unknown frame protection mode 7")
    assert_good_client_works(server, secret, rec)
