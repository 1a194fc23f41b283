"""The connection lifecycle shared by sparkdl's servers (progress channel, parameter server).

One daemon thread accepts; each connection gets a daemon thread running the subclass's
``_serve``; ``close()`` stops accepting, shuts every connection down and joins the threads with a
bounded wait. What a connection says (handshake, frames) is entirely the subclass's business.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Set

#: Safety net for platforms where shutdown() of a listening socket does not interrupt accept().
ACCEPT_POLL_S = 0.5
#: Server threads are daemons, so a callback stuck forever must not hang close().
JOIN_TIMEOUT_S = 5.0


def checked_secret(secret: bytes) -> bytes:
    """The per-job secret a server authenticates peers with; an empty one would admit anyone."""
    if not secret:
        raise ValueError("secret must be non-empty")
    return bytes(secret)


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


class ThreadedServer:
    """Accept loop, one thread per connection, bounded close.

    Subclasses set up their own state, call ``super().__init__`` last (it starts accepting) and
    implement ``_serve(conn, peer)``, which must end with :meth:`_release` in a ``finally``.
    """

    def __init__(self, listener: socket.socket, name: str, logger: logging.Logger) -> None:
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._conns: Set[socket.socket] = set()
        self._threads: Set[threading.Thread] = set()
        self._name = name
        self._log = logger
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

    def _admit(self, peer: Any) -> bool:
        """Called under the lock for each accepted connection; False drops it unserved."""
        return True

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        raise NotImplementedError

    def _forget_connection(self, conn: socket.socket) -> None:
        """Closes a served connection (call from ``_serve``'s ``finally``)."""
        with self._lock:
            self._conns.discard(conn)
        close_quietly(conn)

    def _release(self) -> None:
        """Deregisters the calling connection thread. Called last, so that ``close()`` also waits
        for whatever ``_serve`` does after the connection ended (disconnect callbacks)."""
        with self._lock:
            self._threads.discard(threading.current_thread())

    def _accept_loop(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    conn, peer = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    if self._closed.is_set():
                        break
                    # E.g. EMFILE: keep serving, but back off instead of spinning.
                    self._log.warning("%s: accept failed: %s", self._name, exc)
                    self._closed.wait(0.1)
                    continue
                with self._lock:
                    if self._closed.is_set():
                        close_quietly(conn)
                        break
                    if not self._admit(peer):
                        close_quietly(conn)
                        continue
                    thread = threading.Thread(target=self._serve, args=(conn, peer), name=f"{self._name}-{peer}", daemon=True)
                    self._conns.add(conn)
                    self._threads.add(thread)
                    thread.start()
        finally:
            close_quietly(self._listener)
