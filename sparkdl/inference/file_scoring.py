"""Scoring a plain Parquet scan with tasks that read its files themselves.

Spark's own scan decodes the files in the JVM and hands every row to the Python worker through
a socket; a task that opens its row groups with pyarrow skips both (the same reason training
streams its shards itself). The rows and columns are those the scan would give — the same files
(checked against ``DataFrame.inputFiles()``), every column, Spark's Arrow types — in file order.
"""

from __future__ import annotations

import math
import urllib.parse
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pyarrow as pa

from sparkdl.inference.parts import InputPart, list_parts, part_schema, read_part
from sparkdl.inference.scorer import Scorer


def score_files(
    dataset: Any, roots: Sequence[str], target: pa.Schema, scorer: Scorer, schema: Any, kwargs: Dict[str, Any]
) -> Optional[Any]:
    """The scored DataFrame read from the files under ``roots``; None when they cannot stand
    for ``dataset``'s scan (other files than Spark lists, partition columns, types that do not
    cast to Spark's), and the caller scores ``dataset`` itself."""
    spark = dataset.sparkSession
    parts: List[InputPart] = []
    for root in roots:
        parts.extend(list_parts(spark, root))
    if not parts or any(part.partitions for part in parts):
        return None
    if {_path(part.url) for part in parts if part.rows} != {_path(url) for url in dataset.inputFiles()}:
        return None
    try:  # Spark reads some stored types as others (e.g. unsigned ints): they must cast to its own
        part_schema(parts[0]).empty_table().cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        return None
    groups = _task_groups(parts, _slots(spark))
    reader = _GroupScorer(groups, scorer, target)
    return spark.range(0, len(groups), 1, len(groups)).mapInArrow(reader, schema, **kwargs)


class _GroupScorer:
    """Executor side: the rows of the task's group of parts, scored."""

    def __init__(self, groups: List[List[InputPart]], scorer: Scorer, target: pa.Schema) -> None:
        self.groups, self.scorer, self.target = groups, scorer, target

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                yield from self.scorer(self._rows(self.groups[index]))

    def _rows(self, group: List[InputPart]) -> Iterator[pa.RecordBatch]:
        names = self.target.names
        for part in group:
            for batch in read_part(part, columns=names):
                if batch.schema != self.target:
                    batch = pa.Table.from_batches([batch]).cast(self.target).combine_chunks().to_batches()[0]
                yield batch


def _task_groups(parts: List[InputPart], slots: int) -> List[List[InputPart]]:
    """Consecutive parts packed into tasks of about ``rows / slots`` rows (at least one task per
    slot where there are parts for it; a part is never split)."""
    total = sum(part.rows for part in parts)
    target = max(1, math.ceil(total / max(1, slots)))
    groups: List[List[InputPart]] = [[]]
    held = 0
    for part in parts:
        if groups[-1] and held + part.rows > target:
            groups.append([])
            held = 0
        groups[-1].append(part)
        held += part.rows
    return groups


def _slots(spark: Any) -> int:
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - a Spark Connect client has no SparkContext
        value = spark.conf.get("spark.default.parallelism", None)
        return int(value) if value else 1 << 16


def _path(url: str) -> str:
    """A file's path as both Spark (``file:/x``, ``file:///x``) and sparkdl write it."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "file"):
        return urllib.parse.unquote(parsed.path)
    return f"{parsed.scheme}://{parsed.netloc}{urllib.parse.unquote(parsed.path)}"
