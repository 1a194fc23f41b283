"""On the driver, before a fit launches: can its ``ShardedEmbedding`` tables come back?

Without ``ParameterServer(tables_dir=...)`` the fitted tables come back whole: rank 0 assembles
every table and sends it, inside the model's state dict, as its task result, which passes
through rank 0's executor JVM and the driver's (a byte array each, several copies while it is
serialized) before the driver's Python loads it. Tables too large for that trained fine and
then failed the run (``OutOfMemoryError: Java heap space`` after training; the recommendation
example's 305 MB of tables needed 3 GB executor heaps and a 6 GB driver heap, and 610 MB failed
with 3 GB: docs/embeddings.md). So a fit whose tables and dense weights exceed
``spark.driver.maxResultSize`` (which Spark enforces on every task result), or an eighth of the
driver's or an executor's heap (``spark.driver.memory``, ``spark.executor.memory``; 1g when
unset), is refused here, with the setting that writes them sharded instead. With
``tables_dir`` the directory is checked writable instead.
"""

from __future__ import annotations

import re
from typing import Any, Callable, List, Optional, Tuple

import torch

from sparkdl import filesystem
from sparkdl._driver.memory_check import _size, dense_bytes
from sparkdl.errors import ConfigError
from sparkdl.strategies.parameter_server.embedding import sharded_embeddings

#: The share of a JVM heap a returned model may take (the measured failures above: 610 MB of
#: tables failed in a 3 GB heap, 305 MB passed in 3 GB).
HEAP_FRACTION = 8


def check_table_return(module: torch.nn.Module, strategy: Any, conf: Callable[[str], Optional[str]]) -> None:
    """Raises ConfigError when ``module``'s ShardedEmbedding tables would come back whole and
    exceed what the driver takes; with ``tables_dir``, when that directory cannot be written."""
    tables = sharded_embeddings(module)
    if not tables:
        return
    tables_dir = getattr(strategy, "tables_dir", None)
    if tables_dir:
        filesystem.check_writable(tables_dir, "ParameterServer(tables_dir=...)")
        return
    table_bytes = sum(t.num_rows * t.dim * torch.empty((), dtype=t.dtype).element_size() for _, t in tables)
    total = table_bytes + dense_bytes(module)
    limit, source = min(_limits(conf))
    if total <= limit:
        return
    names = ", ".join(f"{name!r} ({t.num_rows:,} x {t.dim})" for name, t in tables[:5])
    raise ConfigError(
        f"{type(module).__name__}'s ShardedEmbedding tables ({names}) take {_size(table_bytes)}; returned whole, "
        f"the fitted model ({_size(total)}) travels as rank 0's task result through an executor's and the driver's "
        f"JVM, more than {source} allows ({_size(limit)}). Write the tables sharded instead: "
        f"strategy=sparkdl.ParameterServer(tables_dir='s3://bucket/tables' or a shared path), which the fitted "
        f"model reads in place (docs/embeddings.md); or raise that setting"
    )


def _limits(conf: Callable[[str], Optional[str]]) -> List[Tuple[int, str]]:
    limits = []
    result = conf("spark.driver.maxResultSize") or "1g"
    if _bytes(result, "b"):  # 0: unlimited
        limits.append((_bytes(result, "b"), f"spark.driver.maxResultSize={result}"))
    for key in ("spark.driver.memory", "spark.executor.memory"):
        value = conf(key) or "1g"
        if _bytes(value, "m"):
            limits.append((_bytes(value, "m") // HEAP_FRACTION, f"1/{HEAP_FRACTION} of {key}={value}"))
    return limits or [(2**63, "no limit")]


def _bytes(value: str, default_unit: str) -> int:
    """Bytes in a Spark size (``1g``, ``512m``, ``2048k``; ``default_unit`` without one, as Spark
    reads that setting); 0 for a value this does not parse (no limit from it)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(value).lower())
    if match is None:
        return 0
    unit = match.group(2) or default_unit
    return int(float(match.group(1)) * {"b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit])
