"""On the driver, before a fit launches: a model too large for a task's Python memory is refused.

When ``spark.executor.pyspark.memory`` is set, Spark caps each Python worker's address space
(``RLIMIT_AS``) at its share of it, so a rank whose model does not fit gets an allocation error
some seconds into the stage — or, without the setting, the machine's out-of-memory killer ends
the executor. Every training rank holds its model's dense parameters and their gradients at
least (the optimizer's state, DDP's gradient buckets and the activations come on top): when
that lower bound alone exceeds a task's share, the fit cannot succeed, and is refused here with
what to change. Anything nearer the limit is left to the run, whose allocation failure the rank
reports in the same terms (:mod:`sparkdl._task.out_of_memory`).

The limit counts address space, not resident memory, and pyarrow's default allocator (mimalloc)
reserves about 1 GiB of it in every Python worker at its first use (measured: a process that
wrote one Parquet file grew by 1,077 MiB of address space, 88 MiB with pyarrow's system
allocator). pyarrow reads its choice when it is imported, before any sparkdl code runs in the
worker, so it is the session's to make: a launch warns when the limit is set
without ``spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL=system`` (every launch checks the
session: :func:`warn_of_pyarrow_reservations`).

``ShardedDataParallel`` shards parameters and gradients over the ranks, so it is charged its
share; a ``ShardedEmbedding``'s rows are not parameters of the module and are not counted (they
live on the parameter servers, sharded: docs/embeddings.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

from sparkdl.errors import ConfigError

if TYPE_CHECKING:  # the session checks import this module; torch only where a model is checked
    import torch

logger = logging.getLogger("sparkdl")

#: The executor environment that makes pyarrow allocate with malloc: no reservation of its own.
ARROW_POOL_SETTING = "spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL"


def dense_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers (what each rank holds once)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_model_memory(
    module: torch.nn.Module,
    strategy_name: str,
    num_workers: int,
    conf: Callable[[str], Optional[str]],
    task_cpus: Optional[float] = None,
) -> None:
    """Raises ConfigError when the model's parameters and gradients alone exceed the memory a
    task's Python process may use under ``spark.executor.pyspark.memory``; nothing when that is
    not set (Spark then sets no limit on the Python workers)."""
    from sparkdl.data.shard_cache import task_memory_bytes

    if not conf("spark.executor.pyspark.memory"):
        return
    budget, source = task_memory_bytes(conf, task_cpus)
    weights = dense_bytes(module)
    held = 2 * weights / (num_workers if strategy_name == "sharded" else 1)
    if held <= budget:
        return
    sharded = " (its share on each of the ranks)" if strategy_name == "sharded" else ""
    raise ConfigError(
        f"{type(module).__name__}'s parameters and buffers take {_size(weights)}; training holds them and their "
        f"gradients on every rank{sharded}: at least {_size(held)}, more than the {_size(budget)} a task's Python "
        f"process may use ({source}). Raise spark.executor.pyspark.memory, shard the parameters over the ranks "
        f"(strategy=sparkdl.ShardedDataParallel()), or, for large embedding tables, use sparkdl.ShardedEmbedding "
        f"under strategy=sparkdl.ParameterServer(), whose rows are sharded over the ranks (docs/embeddings.md)"
    )


def warn_of_pyarrow_reservations(conf: Callable[[str], Optional[str]]) -> None:
    """Warns (once per setting) when ``spark.executor.pyspark.memory`` limits the Python workers'
    address space and pyarrow's allocator is left to reserve its gigabyte in each of them."""
    limit = conf("spark.executor.pyspark.memory")
    if not limit or conf(ARROW_POOL_SETTING) is not None or limit in _warned:
        return
    _warned.add(limit)
    logger.warning(
        "spark.executor.pyspark.memory=%s limits each Python worker's address space, and pyarrow's default "
        "allocator reserves about 1 GiB of it in every worker: set %s=system in the session's configuration "
        "so that the limit goes to training",
        limit,
        ARROW_POOL_SETTING,
    )


_warned: set = set()


def session_conf(spark: Any) -> Callable[[str], Optional[str]]:
    """A reader of the session's settings (None for a key not set or not readable, as over Spark
    Connect for some keys); every key None without a session, active or given."""

    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()  # a fit from a URL: the session its stage runs in

    def conf(key: str) -> Optional[str]:
        if spark is None:
            return None
        try:
            return spark.conf.get(key, None)
        except Exception:  # noqa: BLE001 - a key the server refuses to read: not known, so not set
            return None

    return conf


def _size(count: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{int(count)} bytes"
