"""A predict job's output, written and committed one input part at a time, so a job killed at
any point resumes without recomputing a committed part and without duplicating a row.

Layout of the output directory (a path or URL)::

    part-<part_id>.parquet        the predictions of one input part (its rows, in order)
    _committed/<part_id>.json     written last: the part is whole (rows, bad rows, run id)
    _temporary/<run_id>/...       files being written
    _sparkdl_predict.json         the job: model, data fingerprint, options (predict_job.py)
    _SUCCESS                      every part is committed

Spark's and pyarrow's readers skip names starting with ``_``, so the directory reads as a plain
Parquet dataset. The commit of a part, run in the task that scored it:

1. its predictions stream into ``_temporary/<run_id>/<part_id>-<attempt>.parquet``;
2. the complete file moves to ``part-<part_id>.parquet``: a rename on a local disk or HDFS; on an
   object store a server-side copy, whose object appears whole or not at all, then a delete;
3. ``_committed/<part_id>.json`` is written (whole, see :func:`~sparkdl.filesystem.write_atomically`).

A part counts as committed only when its marker exists, and the marker exists only after the
whole data file is at its final name, so a part file without a marker (a task killed between
steps 2 and 3) is written again on resume, and a committed one never is. Each file carries the
run that wrote it in its Parquet key-value metadata (:data:`RUN_ID_KEY`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Callable, Iterator, List, Optional, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sparkdl.filesystem import join, open_url, read_bytes, write_atomically
from sparkdl.inference.parts import DEFAULT_BATCH_ROWS, InputPart, part_schema, read_part

#: Where a part's commit marker is, under the output directory.
COMMITTED_DIR = "_committed"
#: Rows per row group of a part file (scored batches are buffered up to this).
ROW_GROUP_ROWS = 65_536
#: Where files being written are, under the output directory.
TEMPORARY_DIR = "_temporary"
#: The Parquet key-value metadata key of the run that wrote a part file.
RUN_ID_KEY = b"sparkdl.predict.run_id"
#: The Parquet key-value metadata key of the part a file holds.
PART_ID_KEY = b"sparkdl.predict.part_id"

#: The rows the Spark job returns, one per part.
OUTCOME_SCHEMA = "part_id string, rows long, bad_rows long, skipped boolean, seconds double"


@dataclasses.dataclass(frozen=True)
class PartOutcome:
    """What became of one part: ``rows`` written (or found committed: ``skipped``), of which
    ``bad_rows`` have a null prediction (a reason in the scorer's error column), in ``seconds``."""

    part_id: str
    rows: int
    bad_rows: int
    skipped: bool
    seconds: float


def part_file(part_id: str) -> str:
    """The name of a part's predictions file in the output directory."""
    return f"part-{part_id}.parquet"


def committed(fs: pafs.FileSystem, root: str, part_id: str) -> Optional[dict]:
    """The commit marker of a part (``rows``, ``bad_rows``, ``run_id``), None when uncommitted."""
    marker = join(root, f"{COMMITTED_DIR}/{part_id}.json")
    if fs.get_file_info(marker).type != pafs.FileType.File:
        return None
    return json.loads(read_bytes(fs, marker))


def run_part(
    part: InputPart,
    scorer: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
    output_url: str,
    run_id: str,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    keep_columns: Optional[Sequence[str]] = None,
) -> PartOutcome:
    """Scores one part into the output and commits it, or skips it when it is committed.

    Args:
        part: the input part.
        scorer: the job's Scorer (``output_schema``, ``error_column``, ``input_columns``, called on
            batches).
        output_url: the output directory.
        run_id: this run of the job, recorded in the file and its marker.
        batch_rows: rows per batch read from the part.
        keep_columns: the input columns the output keeps before the predictions (None: all);
            only these and the scorer's ``input_columns`` are read.
    """
    started = time.monotonic()
    _, fs, root = open_url(output_url, "output")
    marker = committed(fs, root, part.part_id)
    if marker is not None:
        return PartOutcome(part.part_id, marker["rows"], marker["bad_rows"], True, time.monotonic() - started)
    source = part_schema(part)
    read = kept = None
    if keep_columns is not None:  # read what is kept and what the model needs, in the file's order
        wanted = {*keep_columns, *scorer.input_columns}
        read = [name for name in source.names if name in wanted]
    schema = scorer.output_schema(source if read is None else _selected(source, read))
    if keep_columns is not None:
        kept = [*keep_columns, *schema.names[len(read) :]]  # then the columns scoring adds
        schema = _selected(schema, kept)
    metadata = {**(schema.metadata or {}), RUN_ID_KEY: run_id.encode(), PART_ID_KEY: part.part_id.encode()}
    schema = schema.with_metadata(metadata)
    staging = join(root, f"{TEMPORARY_DIR}/{run_id}")
    fs.create_dir(staging, recursive=True)
    temporary = join(staging, f"{part.part_id}-{uuid.uuid4().hex[:8]}.parquet")
    error_column = getattr(scorer, "error_column", None)
    rows = bad_rows = 0
    with fs.open_output_stream(temporary) as stream:  # closed after the writer: the footer first
        with pq.ParquetWriter(stream, schema, use_dictionary=_dictionary_columns(schema)) as writer:
            pending: List[pa.RecordBatch] = []
            held = 0
            for batch in scorer(read_part(part, columns=read, batch_rows=batch_rows)):
                pending.append(batch if kept is None else batch.select(kept))
                held += batch.num_rows
                rows += batch.num_rows
                if error_column is not None:
                    bad_rows += batch.num_rows - batch.column(error_column).null_count
                if held >= ROW_GROUP_ROWS:
                    _write(writer, pending, schema)
                    pending, held = [], 0
            if pending:
                _write(writer, pending, schema)
    if rows != part.rows:  # the scorer must return the part's rows: anything else is not a prediction of it
        fs.delete_file(temporary)
        raise RuntimeError(f"the scorer returned {rows} rows for the {part.rows} rows of input part {part.url!r}")
    _commit(fs, root, part.part_id, temporary, {"rows": rows, "bad_rows": bad_rows, "run_id": run_id})
    return PartOutcome(part.part_id, rows, bad_rows, False, time.monotonic() - started)


def _write(writer: pq.ParquetWriter, batches: List[pa.RecordBatch], schema: pa.Schema) -> None:
    """One row group of ``batches`` (scored batches are small; row groups of many small batches
    would cost a footer entry and a dictionary each)."""
    table = pa.Table.from_batches(batches)
    writer.write_table(table if table.schema.equals(schema) else table.cast(schema), row_group_size=ROW_GROUP_ROWS * 2)


def _selected(schema: pa.Schema, names: Sequence[str]) -> pa.Schema:
    return pa.schema([schema.field(name) for name in names], metadata=schema.metadata)


def _dictionary_columns(schema: pa.Schema) -> List[str]:
    """Columns worth dictionary encoding: not floats (predictions and features rarely repeat, and
    their dictionaries cost more time and space than they save)."""

    def floating(data_type: pa.DataType) -> bool:
        while (
            pa.types.is_list(data_type) or pa.types.is_large_list(data_type) or pa.types.is_fixed_size_list(data_type)
        ):
            data_type = data_type.value_type
        return pa.types.is_floating(data_type)

    return [field.name for field in schema if not floating(field.type) and not pa.types.is_struct(field.type)]


def _commit(fs: pafs.FileSystem, root: str, part_id: str, temporary: str, marker: dict) -> None:
    """Moves the complete file to its final name, then writes the marker that says so."""
    final = join(root, part_file(part_id))
    if fs.get_file_info(final).type == pafs.FileType.File:
        fs.delete_file(final)  # an uncommitted leftover; HDFS renames onto no existing file
    try:
        fs.move(temporary, final)
    except OSError:
        if committed(fs, root, part_id) is None:  # not another attempt of this part that won
            raise
        fs.delete_file(temporary)
        return
    write_atomically(fs, join(root, f"{COMMITTED_DIR}/{part_id}.json"), json.dumps(marker).encode())


class PartRunner:
    """Executor side of the job, for ``mapInArrow`` over ``spark.range(tasks, numPartitions=tasks)``:
    each id is a task's index in ``tasks`` (its parts); yields one :data:`OUTCOME_SCHEMA` row per part.

    Args:
        tasks: the parts of each task.
        scorer: the job's Scorer (picklable).
        output_url: the output directory.
        run_id: this run of the job.
        batch_rows: rows per batch read from a part.
        keep_columns: the input columns the output keeps (None: all).
    """

    def __init__(
        self,
        tasks: Sequence[Sequence[InputPart]],
        scorer: Any,
        output_url: str,
        run_id: str,
        batch_rows: int,
        keep_columns: Optional[Sequence[str]] = None,
    ) -> None:
        self.tasks = [tuple(t) for t in tasks]
        self.scorer, self.output_url, self.run_id, self.batch_rows = scorer, output_url, run_id, batch_rows
        self.keep_columns = None if keep_columns is None else list(keep_columns)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                for part in self.tasks[index]:
                    outcome = run_part(
                        part, self.scorer, self.output_url, self.run_id, self.batch_rows, self.keep_columns
                    )
                    yield pa.RecordBatch.from_pylist([dataclasses.asdict(outcome)], schema=_OUTCOME_ARROW)


_OUTCOME_ARROW = pa.schema(
    [("part_id", pa.string()), ("rows", pa.int64()), ("bad_rows", pa.int64())]
    + [("skipped", pa.bool_()), ("seconds", pa.float64())]
)


def pack_parts(parts: Sequence[InputPart], min_tasks: int, target_rows: int) -> List[List[InputPart]]:
    """Consecutive parts grouped into tasks of up to ``target_rows`` rows (many small files are a
    few tasks, not one task each), but never fewer than ``min_tasks`` tasks while there are parts
    to spread (the cluster's cores all work)."""
    limit = max(1, min(target_rows, -(-sum(p.rows for p in parts) // max(1, min_tasks))))
    tasks: List[List[InputPart]] = []
    rows = 0
    for part in parts:
        if not tasks or rows + part.rows > limit:
            tasks.append([])
            rows = 0
        tasks[-1].append(part)
        rows += part.rows
    return tasks
