"""Socket helpers for the tests that play a bad peer against sparkdl's servers."""

from __future__ import annotations

import socket


def closed_by_server(sock: socket.socket, timeout: float = 30.0) -> bool:
    """True once the server has closed the connection (EOF or reset), False on timeout; closes
    ``sock`` either way."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True
