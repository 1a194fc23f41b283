"""Tests of the servers' shared connection lifecycle: the pending-handshake cap and the
rate-limited log of dropped peers (loopback only, no Spark)."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from typing import List

import pytest

from sparkdl._net.server import RateLimitedLog, ThreadedServer, format_peer

HOST = "127.0.0.1"
WAIT = 5.0  # bound on anything the server does promptly; tests normally finish far sooner
SUMMARY = re.compile(r"dropped ([\d,]+) more unauthenticated connections")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def summarized(self) -> int:
        return sum(int(m.group(1).replace(",", "")) for m in map(SUMMARY.search, self.lines) if m)


@pytest.fixture
def records():
    handler = Records()
    logger = logging.getLogger("sparkdl.test_tcpserver")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_log(clock: Clock) -> RateLimitedLog:
    return RateLimitedLog(
        logging.getLogger("sparkdl.test_tcpserver"),
        "channel",
        "dropped {count} more unauthenticated connections",
        burst=5,
        interval_s=10.0,
        clock=clock,
    )


# ---- the rate-limited log -------------------------------------------------------------------


def test_first_events_are_logged_then_one_summary_per_interval(records):
    clock = Clock()
    log = make_log(clock)
    for i in range(5):
        clock.now = 1000.0 + 0.25 * i  # the last single line at 1001.0
        log.event(("127.0.0.1", 40000 + i), "bad HMAC", "channel: dropping peer %d", i)
    assert records.lines == [f"channel: dropping peer {i}" for i in range(5)]
    for i in range(1994):  # within the interval: counted, not logged
        clock.now = 1001.0 + (i + 1) * 9.0 / 1994
        log.event(("127.0.0.1", 50000), "bad HMAC", "channel: dropping peer %d", i)
    assert len(records.lines) == 5
    clock.now = 1011.0
    log.event(("127.0.0.1", 53211), "bad HMAC", "never logged as such")
    assert records.lines[5:] == [
        "channel: dropped 1,995 more unauthenticated connections in the last 10 s (last from 127.0.0.1:53211: bad HMAC)"
    ]
    for _ in range(3):
        clock.now += 1.0
        log.event(("::1", 7, 0, 0), "too many pending handshakes", "never logged as such")
    assert len(records.lines) == 6
    log.flush()  # what close() does
    assert records.lines[6] == (
        "channel: dropped 3 more unauthenticated connections in the last 3.0 s "
        "(last from [::1]:7: too many pending handshakes)"
    )
    log.flush()  # nothing new to report
    assert len(records.lines) == 7
    assert log.total == 5 + 1994 + 1 + 3


def test_a_steady_flood_gets_one_summary_per_interval_and_loses_no_count(records):
    clock = Clock()
    log = make_log(clock)
    for i in range(5 + 120):  # one event every 0.5 s for a minute
        log.event(("10.0.0.1", i), "bad HMAC", "single %d", i)
        clock.now += 0.5
    singles = [line for line in records.lines if line.startswith("single")]
    summaries = [line for line in records.lines if SUMMARY.search(line)]
    assert len(singles) == 5
    assert len(summaries) == 6  # 62.5 s after the burst, at most one per 10 s
    log.flush()  # the last event came with a summary: nothing left
    assert records.summarized() == 120
    assert len(records.lines) == 5 + 6


def test_a_quiet_interval_starts_a_new_burst_but_pending_counts_are_reported_first(records):
    clock = Clock()
    log = make_log(clock)
    for i in range(6):
        log.event(("10.0.0.1", i), "bad HMAC", "single %d", i)
    assert len(records.lines) == 5  # the sixth is pending in the next summary
    clock.now += 60.0
    log.event(("10.0.0.1", 99), "late", "single late")
    # Quiet, but one was still unreported: the summary comes first and includes this one.
    assert records.lines[5] == (
        "channel: dropped 2 more unauthenticated connections in the last 60 s (last from 10.0.0.1:99: late)"
    )
    clock.now += 60.0
    log.event(("10.0.0.1", 100), "much later", "single much later")
    assert records.lines[6] == "single much later"  # nothing pending: a problem long after is logged as such
    log.flush()
    assert len(records.lines) == 7


def test_accept_failures_and_other_peerless_events_read_well(records):
    clock = Clock()
    log = RateLimitedLog(
        logging.getLogger("sparkdl.test_tcpserver"), "srv", "{count} more accept failures", burst=0, clock=clock
    )
    log.event(None, OSError(24, "Too many open files"), "never logged as such")
    log.flush()
    assert records.lines == ["srv: 1 more accept failures in the last 0.0 s (last: [Errno 24] Too many open files)"]
    assert format_peer(("127.0.0.1", 5)) == "127.0.0.1:5" and format_peer("x") == "x"
    with pytest.raises(ValueError):
        RateLimitedLog(logging.getLogger("x"), "srv", "{count}", interval_s=0)


# ---- the pending-handshake cap ---------------------------------------------------------------


class Greeter(ThreadedServer):
    """Greets each admitted peer with b"hi"; a peer that answers b"ok" is authenticated (and
    answered b"in"), anything else (hanging up, silence past ``handshake_s``) is dropped."""

    def __init__(self, cap: int, handshake_s: float = 60.0, per_peer=None) -> None:
        self.handshake_s = handshake_s
        self.ended = threading.Semaphore(0)  # one release per served connection that ended
        listener = socket.create_server((HOST, 0), backlog=256)
        self.address = listener.getsockname()[:2]
        super().__init__(
            listener,
            "greeter",
            logging.getLogger("sparkdl.test_tcpserver"),
            max_pending_handshakes=cap,
            max_pending_per_peer=per_peer,
        )

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            conn.settimeout(self.handshake_s)
            conn.sendall(b"hi")
            if conn.recv(2) != b"ok":
                raise ConnectionAbortedError("hung up during the handshake")
            self._authenticated()
            conn.sendall(b"in")
            conn.settimeout(None)
            conn.recv(1)  # until the peer hangs up or close()
        except OSError as exc:
            if not self._closed.is_set():
                self._log_drop(peer, exc, "greeter: dropping %s: %s", peer, exc)
        finally:
            self._forget_connection(conn)
            self._release()
            self.ended.release()

    def live_threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def wait_ended(self, count: int) -> None:
        deadline = time.monotonic() + WAIT
        for _ in range(count):
            assert self.ended.acquire(timeout=max(0.0, deadline - time.monotonic())), "connections not dropped"


@pytest.fixture
def servers():
    made: List[ThreadedServer] = []
    yield made
    for server in made:
        server.close()


def connect(address, count: int, source: str = HOST) -> List[socket.socket]:
    return [socket.create_connection(address, timeout=WAIT, source_address=(source, 0)) for _ in range(count)]


def greeted(address, count: int, source: str = HOST) -> List[socket.socket]:
    """``count`` connections, one after the other, each asserted to be greeted (b"hi")."""
    socks: List[socket.socket] = []
    try:
        for _ in range(count):
            socks += connect(address, 1, source)
            assert socks[-1].recv(2) == b"hi", "a new connection must be served, never refused"
    except BaseException:
        close_all(socks)
        raise
    return socks


def first_bytes(socks: List[socket.socket]) -> List[bytes]:
    """What each peer got first: b"hi" if admitted, b"" if the server closed it unserved
    (each recv is bounded by the socket timeout)."""
    return [sock.recv(2) for sock in socks]


def dropped(sock: socket.socket) -> bool:
    """Whether the server has closed this (greeted, idle) connection: EOF, within WAIT."""
    sock.settimeout(WAIT)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def still_pending(sock: socket.socket) -> bool:
    """Whether the server still holds this connection open (nothing to read, no EOF)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(WAIT)
    return False


def close_all(socks: List[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_over_the_cap_the_oldest_pending_connections_are_dropped_and_every_new_one_is_served(servers, records):
    cap, excess = 8, 40
    threads_before = threading.active_count()
    server = Greeter(cap, per_peer=cap)
    servers.append(server)
    socks = greeted(server.address, cap + excess)  # each one is greeted: nobody is refused
    try:
        # The oldest `excess` were dropped to make room, in order; the newest `cap` are pending.
        assert [dropped(sock) for sock in socks[:excess]] == [True] * excess
        server.wait_ended(excess)
        assert all(still_pending(sock) for sock in socks[excess:])
        assert server.pending_handshakes == cap and server.live_threads() == cap
        assert threading.active_count() <= threads_before + cap + 1  # + the accept thread
        # Drops are logged five at a time, not one line each, and say why.
        assert len(records.lines) == 5 and all("to make room" in line for line in records.lines), records.lines
    finally:
        close_all(socks)
    server.wait_ended(cap)
    assert server.pending_handshakes == 0
    server.close()
    assert records.summarized() == excess - 5 + cap  # the final summary at close loses no count
    assert len(records.lines) == 6


def test_a_flood_of_idle_connections_cannot_keep_a_peer_from_authenticating(servers):
    server = Greeter(64)  # the servers' default cap, and 32 from one address
    servers.append(server)
    flood = connect(server.address, 300)  # idle: never answer the greeting
    try:
        start = time.monotonic()
        with socket.create_connection(server.address, timeout=WAIT) as peer:
            assert peer.recv(2) == b"hi", "the job's own peer must be served during a flood"
            peer.sendall(b"ok")
            assert peer.recv(2) == b"in"
            assert time.monotonic() - start < 2.0
        assert server.pending_handshakes <= 32
    finally:
        close_all(flood)


def test_a_flooding_address_only_evicts_its_own_connections(servers):
    # 127.0.0.x are all this host's: three "hosts" on loopback. Ranks (.1) start their
    # handshakes; two flooders (.2, .3) open far more idle connections after them.
    server = Greeter(8, per_peer=4)
    servers.append(server)
    ranks = greeted(server.address, 3)
    floods = []
    try:
        floods += greeted(server.address, 20, source="127.0.0.2")
        floods += greeted(server.address, 20, source="127.0.0.3")
        assert all(still_pending(sock) for sock in ranks), "a flooder must not evict another address's peers"
        assert server.pending_handshakes == 8
        for sock in ranks:  # and they authenticate, late as they are
            sock.sendall(b"ok")
            assert sock.recv(2) == b"in"
        assert server.pending_handshakes == 5
    finally:
        close_all(ranks + floods)


def test_pending_handshakes_that_time_out_free_their_slots(servers):
    cap = 4
    server = Greeter(cap, handshake_s=1.0, per_peer=cap)
    servers.append(server)
    silent = greeted(server.address, cap)
    try:
        server.wait_ended(cap)  # the server gives up on them after 1 s
        assert [dropped(sock) for sock in silent] == [True] * cap
        assert server.pending_handshakes == 0
        late = greeted(server.address, cap)
        assert all(still_pending(sock) for sock in late)  # the slots are free: nobody dropped
        close_all(late)
    finally:
        close_all(silent)


def test_authenticated_peers_do_not_count_against_the_cap_and_are_never_dropped(servers):
    cap = 2
    server = Greeter(cap, per_peer=cap)
    servers.append(server)
    socks = []
    try:
        for _ in range(5 * cap):
            sock = greeted(server.address, 1)[0]
            socks.append(sock)
            sock.sendall(b"ok")
            assert sock.recv(2) == b"in"
        assert server.live_threads() == 5 * cap
        assert server.pending_handshakes == 0
        # Room for `cap` more pending handshakes; one more drops the oldest pending only.
        pending = greeted(server.address, cap + 1)
        socks += pending
        assert dropped(pending[0]) and all(still_pending(sock) for sock in pending[1:])
        assert all(still_pending(sock) for sock in socks[: 5 * cap])
    finally:
        close_all(socks)
    server.wait_ended(6 * cap + 1)


class OwnPolicy(Greeter):
    """Like the parameter server's ShardServer: its own _admit replaces the generic cap."""

    def _admit(self, peer) -> bool:
        return True


def test_a_subclass_admit_replaces_the_generic_cap(servers):
    server = OwnPolicy(cap=1)
    servers.append(server)
    socks = connect(server.address, 3)
    try:
        assert first_bytes(socks) == [b"hi"] * 3
        assert server.pending_handshakes == 3  # still tracked, just not capped
    finally:
        close_all(socks)
    server.wait_ended(3)
    assert server.pending_handshakes == 0


def test_cap_must_be_positive():
    listener = socket.create_server((HOST, 0))
    try:
        with pytest.raises(ValueError, match="max_pending_handshakes"):
            ThreadedServer(listener, "x", logging.getLogger("x"), max_pending_handshakes=0)
    finally:
        listener.close()
