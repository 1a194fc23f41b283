"""glibc's allocator thresholds for a training task: keep each step's freed memory for the next.

glibc serves an allocation larger than ``M_MMAP_THRESHOLD`` (128 KiB in a new process) with a
mapping of its own and unmaps it when freed, and gives the top of its heap back to the kernel
once more than ``M_TRIM_THRESHOLD`` (twice that) is free. Both rise by themselves, to the size of
the largest mapped block freed (at most 32 MiB), but only when such a block is freed. Until they
cover a step's memory, a fresh Spark Python worker hands every step's batches, activations and
gradients back to the kernel and faults them in again, page by page and zeroed, on the next step. Measured in
``sparkdl plan``'s calibration on the namespace cluster: steps of a 1.3 M-parameter MLP 40-60%
slower, the difference spent in the kernel, for as long as no collective had freed a large buffer.

:func:`keep_step_memory` sets the thresholds where glibc's own adjustment ends (32 MiB, trim
twice that), so a task trains at its steady speed from its first step. The settings hold for the
life of the worker process (they cannot be handed back to glibc's adjustment); a user's own
``MALLOC_*`` tunables, or an allocator preloaded in glibc's place, are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Where glibc's dynamic mmap threshold stops rising on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD = 32 * 2**20
#: What glibc pairs with it when it raises the mmap threshold itself.
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _user_chose() -> bool:
    """The user tuned the allocator: glibc's environment tunables, or another allocator preloaded."""
    if any(name in os.environ for name in _USER_TUNABLES):
        return True
    if "malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = os.environ.get("LD_PRELOAD", "")
    return any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc"))


def keep_step_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process; True when they were set (False
    off glibc, or where the user chose otherwise)."""
    if not sys.platform.startswith("linux") or _user_chose():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 when glibc took the value (0: refused, e.g. by a C library that only stubs it).
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
