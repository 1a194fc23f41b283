"""The connection lifecycle shared by sparkdl's servers (progress channel, parameter server).

One daemon thread accepts; each connection gets a daemon thread running the subclass's
``_serve``; ``close()`` stops accepting, shuts every connection down and joins the threads with a
bounded wait. What a connection says (handshake, frames) is entirely the subclass's business.

Anyone who can reach a port can connect, so two things are bounded here for every server:

* connections that have not finished their handshake (``max_pending_handshakes``, counted from
  accept until the subclass calls :meth:`ThreadedServer._authenticated`, and
  ``max_pending_per_peer`` of them from one address). A new connection is never refused: when
  a cap is hit, the oldest pending connection of the address holding the most (or of the new
  peer's own, over its cap) is dropped, an idle one (nothing sent yet) before one whose bytes
  wait. Idle peers can then only delay the job's own ranks, never lock them out: a rank's
  connection is the newest, it answers the greeting at once, and a rank that is dropped anyway
  retries (:func:`sparkdl._net.frames.connect_retrying`) within its timeout. Each server also gives a new peer only
  :data:`HANDSHAKE_S` to authenticate;
* the warnings about dropped peers (:class:`RateLimitedLog`): a few one by one, then
  at most one summary line per interval, and a last one at close.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import select
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

#: Safety net for platforms where shutdown() of a listening socket does not interrupt accept().
ACCEPT_POLL_S = 0.5
#: Server threads are daemons, so a callback stuck forever must not hang close().
JOIN_TIMEOUT_S = 5.0
#: Default bound on a server's connections that have not finished their handshake: a flood of
#: idle connections must not hold a thread and a file descriptor each for the whole timeout.
MAX_PENDING_HANDSHAKES = 64
#: How long a new peer has to authenticate (the servers' default): idle connections go soon.
HANDSHAKE_S = 5.0
#: A server logs its first few drops one by one, then at most one summary per interval.
LOG_BURST = 5
LOG_INTERVAL_S = 10.0
#: Authenticated peers are bounded by the world size and each one's loss matters: more lines.
PEER_LOG_BURST = 20


def checked_secret(secret: bytes) -> bytes:
    """The per-job secret a server authenticates peers with; an empty one would admit anyone."""
    if not secret:
        raise ValueError("secret must be non-empty")
    return bytes(secret)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
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


def shutdown_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected; either way nothing left to wake


def close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def format_peer(peer: Any) -> str:
    """``host:port`` (``[host]:port`` for IPv6) for a socket address, ``str()`` otherwise."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peer)


def _seconds(elapsed: float) -> str:
    return f"{elapsed:,.0f}" if elapsed >= 10 else f"{elapsed:.1f}"


class RateLimitedLog:
    """Warnings about a stream of similar events (dropped peers) that cannot flood the console.

    The first ``burst`` events are logged one by one, with their own message. Later ones are
    only counted, and at most one summary line per ``interval_s`` reports them, e.g.
    ``sparkdl-channel: dropped 1,995 more unauthenticated connections in the last 10 s (last
    from 127.0.0.1:53211: authentication failed)``. There is no timer thread: the summary is
    written by the first event once the interval has passed, or by :meth:`flush` (servers call it
    at close). After a whole interval without any event, the next ones are logged one by one
    again, so a problem long after a flood is not hidden in a summary. Thread-safe.
    """

    def __init__(
        self,
        logger: logging.Logger,
        prefix: str,
        what: str,
        burst: int = LOG_BURST,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            logger: where the lines go (at WARNING).
            prefix: starts every summary line (the server's name).
            what: the summary's description of the suppressed events, a format string with a
                ``{count}`` field, e.g. ``"dropped {count} more unauthenticated connections"``.
            burst: events logged one by one before summarizing starts.
            interval_s: the least time between two summary lines.
            clock: monotonic seconds (injectable for tests).
        """
        if burst < 0 or interval_s <= 0:
            raise ValueError("burst must be >= 0 and interval_s > 0")
        self._logger, self._prefix, self._what = logger, prefix, what
        self._burst, self._interval_s, self._clock = burst, interval_s, clock
        self._lock = threading.Lock()
        self._logged = 0  # lines logged one by one in the current burst
        self._suppressed = 0  # events since the last line, not yet in a summary
        self._since = 0.0  # when the last line (single or summary) was written
        self._last_event: Optional[float] = None
        self._last: Tuple[Any, str] = (None, "")
        self.total = 0  # every event, logged or not

    def event(self, peer: Any, reason: object, msg: str, *args: Any) -> None:
        """Records one event: logs ``msg % args`` while in the burst, else counts it under
        ``peer`` and ``reason`` (the summary names the last ones)."""
        summary: Optional[str] = None
        with self._lock:
            now = self._clock()
            self.total += 1
            quiet = self._last_event is None or now - self._last_event >= self._interval_s
            self._last_event = now
            if quiet and not self._suppressed:
                self._logged, self._since = 0, now  # a new burst
            single = self._logged < self._burst
            if single:
                self._logged += 1
                self._since = now
            else:
                self._suppressed += 1
                self._last = (peer, str(reason))
                if now - self._since >= self._interval_s:
                    summary = self._take_summary(now)
        # Outside the lock: a slow console must not serialize the server's threads on it.
        if single:
            self._logger.warning(msg, *args)
        elif summary is not None:
            self._logger.warning("%s", summary)

    def flush(self) -> None:
        """Logs a summary of the events not yet reported, if any."""
        with self._lock:
            summary = self._take_summary(self._clock()) if self._suppressed else None
        if summary is not None:
            self._logger.warning("%s", summary)

    def _take_summary(self, now: float) -> str:
        peer, reason = self._last
        last = f"last from {format_peer(peer)}: {reason}" if peer is not None else f"last: {reason}"
        text = self._what.format(count=f"{self._suppressed:,}")
        self._suppressed = 0
        elapsed, self._since = now - self._since, now
        return f"{self._prefix}: {text} in the last {_seconds(elapsed)} s ({last})"


class ThreadedServer:
    """Accept loop, one thread per connection, bounded close, bounded pending handshakes.

    Subclasses set up their own state, call ``super().__init__`` last (it starts accepting) and
    implement ``_serve(conn, peer)``, which calls :meth:`_authenticated` once the peer has proven
    itself and must end with :meth:`_forget_connection` and :meth:`_release` in a ``finally``.
    Warnings about dropped peers should go through :meth:`_log_drop`.
    """

    def __init__(
        self,
        listener: socket.socket,
        name: str,
        logger: logging.Logger,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
        max_pending_per_peer: Optional[int] = None,
    ) -> None:
        """``max_pending_per_peer``: pending handshakes of one address (half the cap, at least 1)."""
        if max_pending_handshakes < 1:
            raise ValueError("max_pending_handshakes must be at least 1")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified whenever a connection ends
        self._closed = threading.Event()
        self._conns: Set[socket.socket] = set()
        self._threads: Set[threading.Thread] = set()
        # Connection threads whose peer has not authenticated yet (see _admit), and those dropped
        # to make room (their own drop is logged as that).
        self._unauthenticated: Dict[threading.Thread, _Pending] = {}
        self._evicted: Set[threading.Thread] = set()
        self._max_unauthenticated = max_pending_handshakes
        self._max_per_peer = (
            max(1, max_pending_handshakes // 2) if max_pending_per_peer is None else max(1, max_pending_per_peer)
        )
        self._accepted = itertools.count()
        self._name = name
        self._log = logger
        self._drop_log = RateLimitedLog(logger, name, "dropped {count} more unauthenticated connections")
        self._peer_log = RateLimitedLog(
            logger, name, "{count} more authenticated connections lost or dropped", burst=PEER_LOG_BURST
        )
        self._accept_log = RateLimitedLog(logger, name, "{count} more accept failures")
        self._listener = listener
        self._listener.settimeout(ACCEPT_POLL_S)
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._accept_thread.start()

    def close(self) -> None:
        """Stops accepting, drops every connection and waits (bounded) for server threads.
        Idempotent, and safe to call from a connection's own thread."""
        with self._lock:
            if self._closed.is_set():
                return
            # Set under the lock so the accept thread cannot register a connection we miss.
            self._closed.set()
            conns, threads = list(self._conns), list(self._threads)
        # Only shutdown here: the owning threads close their sockets, so no fd is reused under them.
        shutdown_quietly(self._listener)
        for conn in conns:
            shutdown_quietly(conn)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for thread in [self._accept_thread, *threads]:
            if thread is threading.current_thread():
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self._log.warning("%s: %s did not stop in %.0fs", self._name, thread.name, JOIN_TIMEOUT_S)
        for log in (self._drop_log, self._peer_log, self._accept_log):
            log.flush()

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until no connection is open (peers hung up); True if so.
        Before :meth:`close`, it lets peers that finished later read their last replies."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._conns, timeout=timeout_s)

    @property
    def pending_handshakes(self) -> int:
        """Connections accepted whose peer has not authenticated (yet)."""
        with self._lock:
            return len(self._unauthenticated)

    def _admit(self, peer: Any) -> bool:
        """Called under the lock for each accepted connection; False drops it unserved.

        The default admits every connection and makes room for it (:meth:`_make_room`): every
        server of sparkdl keeps that (the channel, the store, the parameter server's shards). A
        subclass overriding it replaces that policy; call ``super()._admit(peer)`` to keep it.
        """
        self._make_room(_host(peer))
        return True

    def _make_room(self, host: str) -> None:
        """Under the lock, before a connection from ``host`` is admitted: with ``host`` at
        ``max_pending_per_peer`` pending handshakes, drops its oldest; else with all
        ``max_pending_handshakes`` taken, the oldest of the address holding the most (of those,
        the one that connected last). An idle
        connection (no byte waiting: a rank answers its greeting at once) goes before others."""
        pending = list(self._unauthenticated.values())
        mine = [entry for entry in pending if entry.host == host]
        if len(mine) >= self._max_per_peer:
            candidates = mine
        elif len(pending) >= self._max_unauthenticated:
            rank: Dict[str, Tuple[int, int]] = {}  # host -> (pending, newest): ties go to who connects now
            for entry in pending:
                count, newest = rank.get(entry.host, (0, 0))
                rank[entry.host] = (count + 1, max(newest, entry.seq))
            top = max(rank, key=lambda name: rank[name])
            candidates = [entry for entry in pending if entry.host == top]
        else:
            return
        victim = min(_idle(candidates) or candidates, key=lambda entry: entry.seq)
        del self._unauthenticated[victim.thread]
        self._evicted.add(victim.thread)
        shutdown_quietly(victim.conn)  # its thread sees EOF, logs the drop and closes it

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        raise NotImplementedError

    def _authenticated(self) -> None:
        """Marks the calling connection's peer as authenticated (call from ``_serve`` once the
        handshake succeeded): it no longer counts against ``max_pending_handshakes``. Raises
        ConnectionAbortedError if it was dropped to make room meanwhile (its socket is shut)."""
        with self._lock:
            if self._unauthenticated.pop(threading.current_thread(), None) is None:
                raise ConnectionAbortedError("dropped to make room for newer connections")

    def _log_drop(self, peer: Any, reason: object, msg: str, *args: Any, authenticated: bool = False) -> None:
        """Warns ``msg % args`` about a dropped or lost peer, rate-limited and summarized per
        server (separately for peers that had authenticated)."""
        if not authenticated and threading.current_thread() in self._evicted:
            reason = f"the oldest of {self._max_unauthenticated} pending handshakes ({self._max_per_peer} from one address) go first"
            msg, args = "%s: dropping %s to make room: %s", (self._name, format_peer(peer), reason)
        (self._peer_log if authenticated else self._drop_log).event(peer, reason, msg, *args)

    def _forget_connection(self, conn: socket.socket) -> None:
        """Closes a served connection (call from ``_serve``'s ``finally``)."""
        with self._lock:
            self._conns.discard(conn)
            self._unauthenticated.pop(threading.current_thread(), None)
            self._idle.notify_all()
        close_quietly(conn)

    def _release(self) -> None:
        """Deregisters the calling connection thread. Called last, so that ``close()`` also waits
        for whatever ``_serve`` does after the connection ended (disconnect callbacks)."""
        with self._lock:
            self._threads.discard(threading.current_thread())
            self._unauthenticated.pop(threading.current_thread(), None)
            self._evicted.discard(threading.current_thread())
            self._idle.notify_all()

    def _accept_loop(self) -> None:
        try:
            while not self._closed.is_set():
                # Threads of dropped peers still winding down count against the cap too (at most
                # a poll's wait): a flood cannot make the server hold more threads than that.
                with self._idle:
                    self._idle.wait_for(
                        lambda: len(self._evicted) < max(1, self._max_unauthenticated - len(self._unauthenticated)),
                        ACCEPT_POLL_S,
                    )
                try:
                    conn, peer = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    if self._closed.is_set():
                        break
                    # E.g. EMFILE: keep serving, but back off instead of spinning.
                    self._accept_log.event(None, exc, "%s: accept failed: %s", self._name, exc)
                    self._closed.wait(0.1)
                    continue
                with self._lock:
                    if self._closed.is_set():
                        close_quietly(conn)
                        break
                    if not self._admit(peer):
                        # At once and without a thread: a refused peer costs nothing to hold.
                        close_quietly(conn)
                        continue
                    thread = threading.Thread(
                        target=self._serve, args=(conn, peer), name=f"{self._name}-{peer}", daemon=True
                    )
                    self._conns.add(conn)
                    self._threads.add(thread)
                    self._unauthenticated[thread] = _Pending(thread, conn, _host(peer), next(self._accepted))
                    thread.start()
        finally:
            close_quietly(self._listener)


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A connection whose peer has not authenticated yet; ``seq`` orders them by accept."""

    thread: threading.Thread
    conn: socket.socket
    host: str
    seq: int


def _host(peer: Any) -> str:
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


def _idle(entries: List[_Pending]) -> List[_Pending]:
    """Those with nothing to read (under the server's lock: their sockets are open)."""
    poller = select.poll()
    by_fd = {}
    for entry in entries:
        try:
            by_fd[entry.conn.fileno()] = entry
            poller.register(entry.conn.fileno(), select.POLLIN)
        except (OSError, ValueError):
            continue
    busy = {fd for fd, _ in poller.poll(0)}
    return [entry for fd, entry in by_fd.items() if fd not in busy]
