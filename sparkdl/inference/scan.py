"""Driver side: whether a DataFrame is nothing but a scan of Parquet files, and where they are.

Such a DataFrame can be scored by tasks that read its files themselves
(:mod:`sparkdl.inference.file_scoring`), rows exactly as Spark's scan would give them. Anything
that changes what the scan returns — a filter, a projection, a join, partition directories,
reader options such as ``mergeSchema`` or ``pathGlobFilter``, a schema given to the reader —
makes it an ordinary DataFrame, which ``mapInArrow`` scores as Spark hands it over.
"""

from __future__ import annotations

from typing import Any, List, Optional

#: Reader options that change which files or rows a Parquet scan returns, or their values.
_CHANGING_OPTIONS = (
    "mergeSchema",
    "pathGlobFilter",
    "recursiveFileLookup",
    "modifiedBefore",
    "modifiedAfter",
    "datetimeRebaseMode",
    "int96RebaseMode",
    "basePath",
)


def plain_parquet_sources(dataset: Any) -> Optional[List[str]]:
    """The paths (or the catalog table) a plain Parquet scan reads; None for any other plan."""
    try:
        if hasattr(dataset, "_jdf"):
            return _classic_sources(dataset)
        return _connect_sources(dataset)
    except Exception:  # noqa: BLE001 - a plan this reading does not know is not a plain scan
        return None


def _classic_sources(dataset: Any) -> Optional[List[str]]:
    plan = dataset._jdf.queryExecution().optimizedPlan()
    if plan.getClass().getSimpleName() != "LogicalRelation":
        return None
    relation = plan.relation()
    if relation.getClass().getSimpleName() != "HadoopFsRelation":
        return None
    if relation.fileFormat().getClass().getSimpleName() != "ParquetFileFormat":
        return None
    if relation.partitionSchema().length() > 0:
        return None
    options = relation.options()
    if any(options.contains(name) for name in _CHANGING_OPTIONS):
        return None
    roots = relation.location().rootPaths()
    return [roots.apply(i).toString() for i in range(roots.length())]


def _connect_sources(dataset: Any) -> Optional[List[str]]:
    from pyspark.sql.connect import plan as connect_plan

    node = dataset._plan
    if isinstance(node, connect_plan.DataSource):
        if (node._format or "").lower() != "parquet" or node._schema or getattr(node, "_predicates", None):
            return None
        options = {k.lower() for k in (node._options or {})}
        if options & {name.lower() for name in _CHANGING_OPTIONS}:
            return None
        return list(node._paths or []) or None
    if isinstance(node, connect_plan.Read) and not node._options:
        return [node.table_name]
    return None
