"""``sparkdl.predict``: a model's predictions for a Parquet dataset, written part by part so that a
job killed at any point resumes where it stopped (driver side).

The input is listed once into stable parts (:mod:`sparkdl.inference.parts`); the tasks read them
themselves and commit each part on its own (:mod:`sparkdl.inference.committed_output`). The
driver records the job in ``<output>/_sparkdl_predict.json`` (the model's key, the data's
fingerprint, the options) before any task runs; a rerun on the same output compares it:

* the same job, partial: it resumes; committed parts are skipped, not recomputed;
* the same job, complete (``_SUCCESS``): nothing runs; its result is returned (or refused);
* another model, data or options: refused, naming ``overwrite``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

import pyarrow.fs as pafs

from sparkdl.errors import ConfigError, DataError
from sparkdl.filesystem import join, open_url, read_bytes, write_atomically
from sparkdl.inference.committed_output import OUTCOME_SCHEMA, TEMPORARY_DIR, PartRunner, pack_parts
from sparkdl.inference.parts import DEFAULT_BATCH_ROWS, TARGET_ROWS, InputPart, data_fingerprint, list_parts

#: The job record in the output directory.
JOB_RECORD = "_sparkdl_predict.json"
#: Written when every part is committed.
SUCCESS = "_SUCCESS"


class OutputConflictError(ConfigError):
    """``output`` already holds something this job may not resume: another job's predictions,
    other files, or (where refused) this job's complete predictions. ``overwrite`` replaces it."""


@dataclasses.dataclass(frozen=True)
class PredictResult:
    """What a predict job wrote.

    Attributes:
        rows: rows in the output (all parts, written now or before).
        bad_rows: rows whose prediction is null (``on_error="null"``), reason in the error column.
        parts: input parts of the job.
        parts_written: parts scored and committed by this call.
        parts_skipped: parts an earlier run had committed (a resumed job), not recomputed.
        seconds: wall time of this call.
        output: the output directory's URL.
    """

    rows: int
    bad_rows: int
    parts: int
    parts_written: int
    parts_skipped: int
    seconds: float
    output: str


def predict(
    model: Any,
    data: str,
    output: str,
    /,
    *,
    overwrite: bool = False,
    keep_columns: Optional[Sequence[str]] = None,
    **options: Any,
) -> PredictResult:
    """Writes ``model``'s predictions for a Parquet dataset to ``output``, resumable.

    Each input part's predictions are committed on their own, so rerunning the same call after
    a failure or a kill computes only the parts that were not committed. A complete output is
    left as it is and its result returned. ``model``, ``data`` and ``output`` are positional:
    ``output=`` is the scoring option (what the prediction column holds), as in ``transform``.

    Args:
        model: a :class:`~sparkdl.TorchModel`.
        data: a Parquet file or directory (path or URL; ``key=value`` directories become
            columns), or a catalog table stored as Parquet.
        output: the output directory (path or URL): ``part-<part id>.parquet`` files with the
            input columns and the prediction column(s).
        overwrite: replace whatever is at ``output`` instead of resuming or refusing.
        keep_columns: the input columns the output keeps, in this order, before the
            prediction column(s) (e.g. ``["id"]``); None keeps them all. The model's own input
            columns are read either way; the others are not read. Writing fewer columns is
            faster: a table's wide feature columns can cost more to write than to score.
        **options: scoring options (``batch_size``, ``output``, ``top_k``, ``on_error``...:
            :class:`~sparkdl.inference.api.InferenceOptions`).

    Raises:
        ConfigError: ``output`` holds another job's predictions (another model, data, options
            or kept columns) or something else, and ``overwrite`` is False; a bad option; a
            kept column the data does not have.
        DataError: the input cannot be read as Parquet (the message names the file or table).
    """
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    return predict_parts(
        spark,
        model,
        list_parts(spark, data),
        data,
        output,
        overwrite=overwrite,
        options=options,
        keep_columns=keep_columns,
    )


def predict_parts(
    spark: Any,
    model: Any,
    parts: Sequence[InputPart],
    data: str,
    output: str,
    *,
    overwrite: bool = False,
    refuse_complete: bool = False,
    options: Optional[Dict[str, Any]] = None,
    keep_columns: Optional[Sequence[str]] = None,
) -> PredictResult:
    """:func:`predict` of parts already listed (``data`` names them in messages); the model's
    own scoring params (``setBatchSize``...) apply where ``options`` does not say otherwise.
    With ``refuse_complete``, a complete output of the same job is refused (``sparkdl predict``)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    from sparkdl.inference.api import inference_options
    from sparkdl.inference.parts import part_schema
    from sparkdl.inference.transform import scorer_for

    own = model.inference_options().to_json() if hasattr(model, "inference_options") else {}
    settings = inference_options(**{**own, **(options or {})})
    schema = part_schema(parts[0])
    try:
        spark_schema = from_arrow_schema(schema)
    except TypeError as exc:  # a stored type Spark has no type for (e.g. an unsigned integer)
        raise DataError(f"data {data!r}: {exc}; rewrite the column with a type Spark reads") from exc
    scorer = scorer_for(model, spark, spark_schema, settings, source=f"data {data!r}")
    kept = checked_keep_columns(keep_columns, schema.names, f"data {data!r}")
    return run_predict_job(
        spark,
        scorer,
        parts,
        output,
        overwrite=overwrite,
        options={**settings.to_json(), "keep_columns": kept},
        keep_columns=kept,
        # Read in batches of at least the default: the scorer cuts them into model calls itself.
        batch_rows=max(settings.batch_size, DEFAULT_BATCH_ROWS),
        refuse_complete=refuse_complete,
    )


def run_predict_job(
    spark: Any,
    scorer: Any,
    parts: Sequence[InputPart],
    output: str,
    *,
    overwrite: bool = False,
    options: Optional[Dict[str, Any]] = None,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    refuse_complete: bool = False,
    keep_columns: Optional[Sequence[str]] = None,
) -> PredictResult:
    """Runs (or resumes) the job of ``scorer`` over ``parts`` into ``output``.

    Args:
        spark: the session.
        scorer: a picklable Scorer (``output_schema``, ``error_column``, ``model_key``, called
            on an iterator of record batches).
        parts: the input, from :func:`~sparkdl.inference.parts.list_parts`.
        output: the output directory (path or URL).
        overwrite: replace what is at ``output``.
        options: the scoring options as JSON, recorded and compared on a rerun.
        batch_rows: rows per batch read from a part.
        refuse_complete: refuse a complete output of the same job (``sparkdl predict``) instead
            of returning its result.
        keep_columns: the input columns the output keeps (None: all), checked by the caller;
            ``options`` should record them (``"keep_columns"``) so that a rerun keeping others
            is refused.
    """
    started = time.monotonic()
    url, fs, root = open_url(output, "output")
    record = {"model": getattr(scorer, "model_key", None), "data": data_fingerprint(parts), "options": options or {}}
    existing = _prepare_output(fs, root, url, record, overwrite)
    if existing is not None and fs.get_file_info(join(root, SUCCESS)).type == pafs.FileType.File:
        if refuse_complete:
            raise OutputConflictError(
                f"{url!r} already exists: pass --overwrite (overwrite=True) to compute it again (it holds the "
                f"complete predictions of this job)"
            )
        done = existing.get("result", {})
        return PredictResult(done.get("rows", 0), done.get("bad_rows", 0), len(parts), 0, len(parts), 0.0, url)
    tasks = pack_parts(parts, _cores(spark, len(parts)), TARGET_ROWS)
    runner = PartRunner(tasks, scorer, url, uuid.uuid4().hex[:16], batch_rows, keep_columns)
    outcomes = [
        row.asDict() for row in spark.range(0, len(tasks), 1, len(tasks)).mapInArrow(runner, OUTCOME_SCHEMA).collect()
    ]
    missing = {p.part_id for p in parts} - {o["part_id"] for o in outcomes}
    if missing:  # every task returned, so this is a bug, not a failure to retry
        raise RuntimeError(f"the predict job reported no outcome for parts {sorted(missing)[:5]}")
    result = {
        "rows": sum(o["rows"] for o in outcomes),
        "bad_rows": sum(o["bad_rows"] for o in outcomes),
        "parts": len(parts),
    }
    if fs.get_file_info(join(root, TEMPORARY_DIR)).type == pafs.FileType.Directory:
        fs.delete_dir(join(root, TEMPORARY_DIR))
    write_atomically(fs, join(root, JOB_RECORD), _json({**record, "result": result}))
    write_atomically(fs, join(root, SUCCESS), b"")
    skipped = sum(1 for o in outcomes if o["skipped"])
    return PredictResult(
        result["rows"], result["bad_rows"], len(parts), len(parts) - skipped, skipped, time.monotonic() - started, url
    )


def _prepare_output(
    fs: pafs.FileSystem, root: str, url: str, record: Dict[str, Any], overwrite: bool
) -> Optional[Dict[str, Any]]:
    """Makes ``root`` ready for the job: replaced with ``overwrite``, else new, or the same job's
    (whose record it returns). Refuses anything else, naming ``overwrite``."""
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        raise OutputConflictError(f"output {url!r} is a file: give a directory")
    if info.type == pafs.FileType.Directory and overwrite:
        fs.delete_dir(root)
    elif info.type == pafs.FileType.Directory and _has_entries(fs, root):
        existing = _read_record(fs, root, url)
        differences = [what for key, what in _COMPARED.items() if _differs(key, existing.get(key), record[key])]
        if differences:
            raise OutputConflictError(
                f"output {url!r} holds the predictions of another job ({', '.join(differences)} than this one): "
                f"pass --overwrite (overwrite=True) to replace them, or choose another output"
            )
        return existing
    fs.create_dir(root, recursive=True)
    write_atomically(fs, join(root, JOB_RECORD), _json(record))
    return None


_COMPARED = {"model": "another model", "data": "other input data", "options": "other options"}

#: Options that change what is written; the others (batch size, threads, device) may differ
#: between a run and its resume, as after a crash on another cluster.
_RESULT_OPTIONS = ("output", "top_k", "on_error", "error_col", "precision", "keep_columns")


def checked_keep_columns(keep_columns: Any, names: Sequence[str], source: str) -> Optional[List[str]]:
    """``keep_columns`` as a list of columns of ``source`` (None: all of them).

    Raises:
        ConfigError: not a list of column names, a name twice, or a name ``source`` lacks.
    """
    if keep_columns is None:
        return None
    if isinstance(keep_columns, str) or not all(isinstance(name, str) for name in keep_columns):
        raise ConfigError(f"keep_columns={keep_columns!r} must be a list of column names, e.g. ['id']")
    kept = list(keep_columns)
    repeated = sorted({name for name in kept if kept.count(name) > 1})
    if repeated:
        raise ConfigError(f"keep_columns names {repeated} more than once")
    missing = [name for name in kept if name not in names]
    if missing:
        raise ConfigError(f"keep_columns {missing} not in {source}; its columns are: {list(names)}")
    return kept


def _differs(key: str, recorded: Any, current: Any) -> bool:
    """Whether a recorded field names something else; a model without a key matches any."""
    if key == "options" and isinstance(recorded, dict) and isinstance(current, dict):
        return any(recorded.get(name) != current.get(name) for name in _RESULT_OPTIONS)
    return recorded is not None and current is not None and recorded != current


def _read_record(fs: pafs.FileSystem, root: str, url: str) -> Dict[str, Any]:
    path = join(root, JOB_RECORD)
    if fs.get_file_info(path).type != pafs.FileType.File:
        raise OutputConflictError(
            f"output {url!r} already exists and is not a sparkdl predict job's output: pass --overwrite "
            f"(overwrite=True) to replace it, or choose another output"
        )
    return json.loads(read_bytes(fs, path))


def _has_entries(fs: pafs.FileSystem, root: str) -> bool:
    selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
    return bool(fs.get_file_info(selector))


def _cores(spark: Any, default: int) -> int:
    """How many tasks run at once (classic sessions), else ``default``."""
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        return default


def _json(document: Dict[str, Any]) -> bytes:
    return json.dumps(document, indent=2, sort_keys=True, default=str).encode()
