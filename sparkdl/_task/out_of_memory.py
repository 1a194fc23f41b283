"""A rank that ran out of memory, told in terms of the setting that limits it.

Under ``spark.executor.pyspark.memory`` Spark caps each Python worker's address space
(``RLIMIT_AS``, from ``PYSPARK_EXECUTOR_MEMORY_MB``), so an allocation past it fails in the
rank — as Python's ``MemoryError`` or torch's "DefaultCPUAllocator: can't allocate memory" —
instead of the kernel killing the executor. That error alone names neither the limit nor what
to change; :func:`explain_out_of_memory` turns it into a :class:`~sparkdl.errors.ConfigError`
that does (and that the driver does not retry: a relaunch would run out the same way). A GPU's
``torch.OutOfMemoryError`` is told the same way with the GPU's remedies.
"""

from __future__ import annotations

import os
import resource
from typing import Optional

import torch

from sparkdl.errors import ConfigError

#: What torch's and numpy's CPU allocators say when an allocation fails.
_CPU_ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "unable to allocate")


def explain_out_of_memory(exc: BaseException, rank: int) -> BaseException:
    """``exc``, or a ConfigError saying which limit the rank hit and what to change when ``exc``
    is an allocation failure; the original stays the ``__cause__`` with its traceback."""
    if isinstance(exc, torch.OutOfMemoryError):
        what = (
            f"rank {rank} ran out of GPU memory: lower batch_size, train in precision='bf16', or shard the model "
            f"over the ranks (strategy=sparkdl.ShardedDataParallel())"
        )
    elif _a_servers_memory(exc):
        # Another rank's parameter server (a sparse table's shard) could not grow; its limit is
        # this rank's too: every Python worker of the stage gets the same share.
        what = f"rank {rank}'s request found a parameter server out of memory{_limit(own=False)}: {_REMEDIES}"
    elif isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and any(text in str(exc).lower() for text in _CPU_ALLOCATION_FAILED)
    ):
        what = f"rank {rank} ran out of memory{_limit()}: {_REMEDIES}"
    else:
        return exc
    new = ConfigError(f"{what}. The allocation failed with {type(exc).__name__}: {str(exc).strip()[:300]}")
    new.__cause__ = exc
    return new.with_traceback(exc.__traceback__)


_REMEDIES = (
    "raise spark.executor.pyspark.memory (or the executors' memory), lower batch_size, shard the parameters over "
    "the ranks (strategy=sparkdl.ShardedDataParallel()), or, for large embedding tables, use sparkdl.ShardedEmbedding "
    "under strategy=sparkdl.ParameterServer(), whose rows are sharded over the ranks (docs/embeddings.md)"
)


def _a_servers_memory(exc: BaseException) -> bool:
    from sparkdl.strategies.parameter_server.transport import OUT_OF_MEMORY
    from sparkdl.strategies.parameter_server.wire import ParameterServerError

    return isinstance(exc, ParameterServerError) and OUT_OF_MEMORY in str(exc)


def _limit(own: bool = True) -> str:
    """Which limit applied to this process (the same for every rank of the stage), in words;
    "" when none is known. ``own``: say what this process held at its peak."""
    limit = _address_space_limit()
    if limit is None:
        return ""
    setting = os.environ.get("PYSPARK_EXECUTOR_MEMORY_MB")
    peak = _peak_resident_bytes() if own else None
    told = f" (it held {peak / (1 << 20):,.0f} MiB resident at its peak)" if peak else ""
    source = (
        f": each Python worker may use {int(setting):,} MiB of address space, its share of spark.executor.pyspark.memory"
        if setting and setting.lstrip("-").isdigit() and int(setting) > 0
        else f": its address space is limited to {limit / (1 << 20):,.0f} MiB (RLIMIT_AS)"
    )
    return source + told


def _address_space_limit() -> Optional[int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def _peak_resident_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        return None
    return None
