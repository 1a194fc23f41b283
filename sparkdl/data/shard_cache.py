"""The shard cache: a rank's decoded row groups kept in memory after its first pass, so the
passes after it read no Parquet and decode nothing again (``shard_cache="auto"|"memory"|"none"``).

What it keeps is what a reader's pass hands out for a row group: the extracted, row-aligned
numpy columns (:meth:`sparkdl.data.plan.InputPlan.extract`) in the plan's kept form
(:meth:`~sparkdl.data.plan.InputPlan.keep`: images decoded and resized to uint8 pixels), never
a finished batch. Everything after it — the seeded row-group order of each pass, the shuffle
buffer, the batches, image crops, flips and normalization, ``transform_fn`` — runs per pass as
before, so a cached pass hands out exactly the chunks a streamed one would, in the same order:
the cache changes where bytes come from, not which rows a step sees. Downstream code copies
chunks before it changes them (the shuffle buffer's permutation, a batch's concatenation, an
image flip), so a kept chunk is handed out again unchanged.

Memory stays bounded: the driver gives each rank a byte budget (:func:`decide`); a rank whose
row groups need more keeps those that fit and streams the rest every pass, saying so once.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from sparkdl.data.dataset import DatasetInfo
from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl.data")

#: A reader's chunk (sparkdl.data.readers.base.Chunk, which imports this module): named, row-aligned arrays.
Chunk = Dict[str, np.ndarray]

#: ``shard_cache=`` values: "auto" caches when the shard fits a fraction of the executor's
#: memory (:data:`AUTO_FRACTION`), "memory" caches whenever it fits the executor's memory at
#: all (else the fit is refused), "none" streams every pass.
SETTINGS = ("auto", "memory", "none")
#: The share of a task's memory "auto" lets the cache take: the rest is the model's, the
#: optimizer's, the shuffle buffer's and Python's.
AUTO_FRACTION = 0.5
#: Decoded columns take about their Parquet page bytes (uncompressed); the margin covers
#: the offsets, validity and per-chunk overhead the footers do not count.
_DECODED_MARGIN = 1.15


def check_setting(value: str) -> str:
    if value not in SETTINGS:
        raise ConfigError(f"shard_cache={value!r} is unknown; valid: {', '.join(repr(s) for s in SETTINGS)}")
    return value


def rank_bytes(dataset: DatasetInfo, rank: int, world_size: int, holdout: float = 0.0) -> int:
    """The decoded bytes rank ``rank``'s training shard takes in memory, estimated from the
    footers: its row groups' uncompressed bytes of the columns the run reads (a row-striding
    rank holds ``1/world_size`` of every row group), plus, per row, what the inputs kept in
    another form take (images as pixels: :meth:`~sparkdl.data.plan.InputPlan.kept_row_bytes`),
    less the validation hold-out."""
    sizes = dataset.row_group_bytes
    if not sizes:
        return 0
    _, per_row = dataset.plan.kept_row_bytes()
    sizes = [size + rows * per_row for size, rows in zip(sizes, dataset.row_group_rows)]
    if dataset.num_row_groups >= world_size:  # the rank's row groups (sparkdl.data.selection)
        total = float(sum(size for group, size in enumerate(sizes) if group % world_size == rank))
    else:  # row striding: every rank keeps 1/world_size of every row group
        total = sum(sizes) / world_size
    return int(total * (1.0 - holdout) * _DECODED_MARGIN)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the driver decided for a run: the per-rank byte budget (None: stream every pass)
    and why, in the user's terms (run_info and the log say it)."""

    setting: str
    budget_bytes: Optional[int]
    shard_bytes: int
    memory_bytes: int
    reason: str

    def to_json(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


def decide(
    setting: str,
    dataset: DatasetInfo,
    world_size: int,
    holdout: float,
    reader_caches: bool,
    memory_bytes: int,
    memory_source: str,
) -> Decision:
    """The cache budget of every rank, from the largest rank's shard and ``memory_bytes``, the
    memory one task may use (``memory_source`` says which setting gave it).

    Raises:
        ConfigError: ``shard_cache="memory"`` on a shard larger than a task's memory.
    """
    check_setting(setting)
    largest = max(rank_bytes(dataset, rank, world_size, holdout) for rank in range(world_size))

    def made(budget: Optional[int], reason: str) -> Decision:
        return Decision(setting, budget, largest, memory_bytes, reason)

    if setting == "none":
        return made(None, "shard_cache='none': every pass streams from Parquet")
    if not reader_caches:
        return made(None, "the reader streams every pass (the shard cache is the Arrow reader's)")
    if setting == "memory":
        if largest > memory_bytes:
            raise ConfigError(
                f"shard_cache='memory': a rank's shard of {dataset.name} takes about {_mb(largest)} decoded, more than "
                f"the {_mb(memory_bytes)} a task has ({memory_source}); use shard_cache='auto' (streams what does not "
                f"fit), more workers (smaller shards) or more executor memory"
            )
        return made(memory_bytes, f"shard_cache='memory': about {_mb(largest)} per rank kept after the first pass")
    budget = int(memory_bytes * AUTO_FRACTION)
    if largest <= budget:
        return made(
            budget,
            f"about {_mb(largest)} per rank fits {AUTO_FRACTION:.0%} of the {_mb(memory_bytes)} a task has "
            f"({memory_source}): kept in memory after the first pass",
        )
    return made(
        None,
        f"about {_mb(largest)} per rank exceeds {AUTO_FRACTION:.0%} of the {_mb(memory_bytes)} a task has "
        f"({memory_source}): every pass streams (shard_cache='memory' keeps it anyway, up to {_mb(memory_bytes)})",
    )


def task_memory_bytes(conf: Callable[[str], Optional[str]], task_cpus: Optional[float] = None) -> Tuple[int, str]:
    """The memory one task's Python process may use, and the settings it comes from:
    ``spark.executor.pyspark.memory`` when set (Spark's limit on the Python workers), else
    ``spark.executor.memory`` (default 1g), shared by the executor's concurrent tasks
    (``spark.executor.cores / spark.task.cpus`` when both are set; ``task_cpus``, the training
    stage's own CPUs per task from ``resources=``, in place of ``spark.task.cpus``)."""
    pyspark = conf("spark.executor.pyspark.memory")
    name, value = (
        ("spark.executor.pyspark.memory", pyspark)
        if pyspark
        else ("spark.executor.memory", conf("spark.executor.memory") or "1g")
    )
    total = _bytes_of(value)
    cores = conf("spark.executor.cores")
    task_cpus = f"{task_cpus:g}" if task_cpus is not None else conf("spark.task.cpus") or "1"
    tasks = 1
    try:
        if cores:
            tasks = max(1, int(float(cores) // max(float(task_cpus), 1e-9)))
    except ValueError:
        tasks = 1
    source = f"{name}={value}" + (f" shared by {tasks} concurrent tasks" if tasks > 1 else "")
    return total // tasks, source


def _bytes_of(value: str) -> int:
    """Spark's size strings: ``1g``, ``512m``, ``2048k``, plain bytes; ``m`` when no unit (as Spark reads memory settings)."""
    text = str(value).strip().lower().rstrip("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text) * units["m"])


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.1f} kB"


def chunk_bytes(chunk: Chunk) -> int:
    """What a chunk's arrays hold, the objects of object arrays (strings, bytes) included."""
    total = 0
    for values in chunk.values():
        if isinstance(values, np.ndarray):
            total += int(values.nbytes)
            if values.dtype == object:
                total += sum(map(sys.getsizeof, values.ravel()))
    return total


_ABSENT = object()


class ShardCache:
    """One rank's kept row groups, filled by its reader's first pass over each.

    A row group that gives no rows (filtered out, all held out) is kept as ``None``: later
    passes skip it without reading its statistics again. Thread-safe: the reader's read-ahead
    thread fills it while the training thread may read the counters.
    """

    def __init__(self, budget_bytes: int, rank: int, dataset_name: str, images_decoded: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.rank = rank
        self._name = dataset_name
        self.images_decoded = images_decoded  # images kept as their resized pixels
        self._lock = threading.Lock()
        self._groups: Dict[int, Optional[Chunk]] = {}
        self.held_bytes = 0
        self.read_seconds = 0.0  # the reads of the row groups kept: what each later pass saves
        self.served = 0  # row groups handed out from memory
        self.streamed = 0  # row groups read because they did not fit
        self.full = False

    def get(self, group: int) -> object:
        """The kept chunk of ``group`` (``None`` for a row group without rows), or
        :data:`MISSING` when it has to be read."""
        with self._lock:
            found = self._groups.get(group, _ABSENT)
            if found is _ABSENT:
                return MISSING
            self.served += 1
            return found

    def put(self, group: int, chunk: Optional[Chunk], read_seconds: float) -> None:
        """Keeps what a read of ``group`` gave, unless it does not fit the budget any more."""
        size = 0 if chunk is None else chunk_bytes(chunk)
        with self._lock:
            if group in self._groups:
                return
            if self.held_bytes + size > self.budget_bytes:
                self.streamed += 1
                if not self.full:
                    self.full = True
                    logger.warning(
                        "rank %d: the decoded row groups of %s need more than its shard cache's %s: %d row groups "
                        "(%s) stay in memory, the rest is read from Parquet every pass",
                        self.rank,
                        self._name,
                        _mb(self.budget_bytes),
                        len(self._groups),
                        _mb(self.held_bytes),
                    )
                return
            self._groups[group] = chunk
            self.held_bytes += size
            self.read_seconds += read_seconds

    def stats(self) -> Dict[str, object]:
        """What run_info reports: bytes and row groups kept, row groups served from memory and
        read because they did not fit, the reading (and image decoding) seconds each pass from
        memory saves, and whether images are kept decoded."""
        with self._lock:
            return {
                "budget_bytes": self.budget_bytes,
                "held_bytes": self.held_bytes,
                "row_groups": sum(1 for chunk in self._groups.values() if chunk is not None),
                "rows": sum(len(next(iter(chunk.values()))) for chunk in self._groups.values() if chunk),
                "served_row_groups": self.served,
                "streamed_row_groups": self.streamed,
                "full": self.full,
                "read_seconds_per_pass": self.read_seconds,
                "images_decoded": self.images_decoded,
            }


#: :meth:`ShardCache.get` for a row group not kept (``None`` means kept, without rows).
MISSING: object = object()
