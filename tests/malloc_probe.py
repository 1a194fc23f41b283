"""Whether glibc serves a large allocation of this process with a mapping of its own (its start-up
threshold, 128 KiB) or from its heap (after ``sparkdl._task.allocator.keep_step_memory``), read
from ``mallinfo2().hblks``. Linux and glibc 2.33+ only."""

from __future__ import annotations

import ctypes


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mapped_blocks_added(size: int = 1 << 20) -> int:
    """Mapped blocks added by one ``malloc(size)`` (1: mapped on its own, 0: from the heap)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2().hblks
    block = libc.malloc(size)
    try:
        return int(libc.mallinfo2().hblks - before)
    finally:
        libc.free(block)
