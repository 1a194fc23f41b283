"""The commit protocol of a predict job, without Spark: the part runner on real Parquet files,
markers written last, committed parts skipped, uncommitted leftovers rewritten, and the driver's
checks of an existing output (sparkdl.inference.committed_output, predict_job)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from sparkdl.errors import ConfigError
from sparkdl.inference.committed_output import (
    PART_ID_KEY,
    RUN_ID_KEY,
    PartRunner,
    committed,
    pack_parts,
    part_file,
    run_part,
)
from sparkdl.inference.parts import InputPart, list_parts
from sparkdl.inference.predict_job import JOB_RECORD, _prepare_output, checked_keep_columns
from tests.doubling_scorer import DoublingScorer


@pytest.fixture
def parts(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name, start in (("a.parquet", 0), ("b.parquet", 40)):
        ids = list(range(start, start + 40))
        table = pa.table({"id": pa.array(ids, pa.int64()), "x": pa.array([i - 5.0 for i in ids], pa.float64())})
        pq.write_table(table, str(data / name), row_group_size=10)
    return list_parts(None, str(data), target_rows=20)


def _run_ids(path):
    metadata = pq.read_schema(path).metadata
    return metadata[RUN_ID_KEY].decode(), metadata[PART_ID_KEY].decode()


def test_a_part_is_written_then_committed_and_a_committed_part_is_skipped(tmp_path, parts):
    output = str(tmp_path / "out")
    outcome = run_part(parts[0], DoublingScorer(), output, "run-1", batch_rows=7)
    assert (outcome.rows, outcome.bad_rows, outcome.skipped) == (20, 0, False)
    written = pq.read_table(os.path.join(output, part_file(parts[0].part_id)))
    assert written.column("id").to_pylist() == list(range(20))
    assert written.column("y").to_pylist() == [2 * (i - 5.0) for i in range(20)]
    assert _run_ids(os.path.join(output, part_file(parts[0].part_id))) == ("run-1", parts[0].part_id)
    assert json.load(open(os.path.join(output, "_committed", f"{parts[0].part_id}.json"))) == {
        "rows": 20,
        "bad_rows": 0,
        "run_id": "run-1",
    }
    again = run_part(parts[0], DoublingScorer(), output, "run-2")
    assert (again.rows, again.skipped) == (20, True)
    assert _run_ids(os.path.join(output, part_file(parts[0].part_id)))[0] == "run-1"  # not recomputed


def test_a_part_file_without_its_marker_is_written_again(tmp_path, parts):
    """A task killed between the move and the marker leaves a whole file that is not committed."""
    output = str(tmp_path / "out")
    run_part(parts[1], DoublingScorer(), output, "run-1")
    os.remove(os.path.join(output, "_committed", f"{parts[1].part_id}.json"))
    assert committed(pafs.LocalFileSystem(), output, parts[1].part_id) is None
    outcome = run_part(parts[1], DoublingScorer(), output, "run-2")
    assert not outcome.skipped and outcome.rows == 20
    assert _run_ids(os.path.join(output, part_file(parts[1].part_id)))[0] == "run-2"
    assert committed(pafs.LocalFileSystem(), output, parts[1].part_id)["run_id"] == "run-2"


def test_bad_rows_are_counted_from_the_error_column(tmp_path, parts):
    outcome = run_part(parts[0], DoublingScorer(error_column="y_error"), str(tmp_path / "out"), "run-1")
    assert (outcome.rows, outcome.bad_rows) == (20, 5)  # x = id - 5 < 0 for ids 0..4
    table = pq.read_table(os.path.join(str(tmp_path / "out"), part_file(parts[0].part_id)))
    assert table.column("y").null_count == 5 and table.column("y_error").to_pylist()[:6] == ["negative x"] * 5 + [None]


class _DroppingScorer(DoublingScorer):
    def __call__(self, batches):
        for batch in super().__call__(batches):
            yield batch.slice(1)


def test_a_scorer_that_loses_rows_commits_nothing(tmp_path, parts):
    output = str(tmp_path / "out")
    with pytest.raises(RuntimeError, match="returned 18 rows for the 20 rows of input part"):
        run_part(parts[0], _DroppingScorer(), output, "run-1", batch_rows=10)
    assert not os.path.exists(os.path.join(output, part_file(parts[0].part_id)))
    assert committed(pafs.LocalFileSystem(), output, parts[0].part_id) is None


def test_the_runner_reports_each_part_of_its_task(tmp_path, parts):
    tasks = pack_parts(parts, min_tasks=2, target_rows=1_000_000)
    assert [len(t) for t in tasks] == [2, 2] and [p for t in tasks for p in t] == parts
    runner = PartRunner(tasks, DoublingScorer(), str(tmp_path / "out"), "run-1", 8)
    rows = pa.Table.from_batches(list(runner(iter([pa.RecordBatch.from_pydict({"id": [1]})])))).to_pylist()
    assert [(r["part_id"], r["rows"], r["skipped"]) for r in rows] == [(p.part_id, 20, False) for p in parts[2:]]


class _SeeingScorer(DoublingScorer):
    """Records the columns it is handed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def __call__(self, batches):
        for batch in batches:
            self.seen.append(batch.schema.names)
            yield from super().__call__(iter([batch]))


def test_kept_columns_are_all_the_input_a_part_file_holds_and_the_rest_is_not_read(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    ids = list(range(30))
    wide = pa.array([[float(i)] * 64 for i in ids], pa.list_(pa.float32()))
    table = pa.table({"wide": wide, "x": pa.array([i - 5.0 for i in ids]), "id": pa.array(ids, pa.int64())})
    pq.write_table(table, str(data / "a.parquet"), row_group_size=10)
    part = list_parts(None, str(data))[0]
    scorer, output = _SeeingScorer(error_column="y_error"), str(tmp_path / "out")
    outcome = run_part(part, scorer, output, "run-1", batch_rows=8, keep_columns=["id"])
    assert (outcome.rows, outcome.bad_rows) == (30, 5)
    assert scorer.seen and all(names == ["x", "id"] for names in scorer.seen)  # the file's order; no "wide"
    written = pq.read_table(os.path.join(output, part_file(part.part_id)))
    assert written.schema.names == ["id", "y", "y_error"]
    assert written.column("id").to_pylist() == ids and written.column("y").to_pylist()[5:] == [
        2.0 * (i - 5) for i in ids[5:]
    ]
    assert _run_ids(os.path.join(output, part_file(part.part_id))) == ("run-1", part.part_id)
    again = run_part(part, DoublingScorer(), str(tmp_path / "all"), "run-1", keep_columns=["x", "wide"])
    assert again.rows == 30
    assert pq.read_schema(os.path.join(str(tmp_path / "all"), part_file(part.part_id))).names == ["x", "wide", "y"]


def test_kept_columns_are_checked_against_the_input():
    names = ["id", "x"]
    assert checked_keep_columns(None, names, "data 'd'") is None
    assert checked_keep_columns(("x", "id"), names, "data 'd'") == ["x", "id"]
    with pytest.raises(ConfigError, match=r"keep_columns \['user'\] not in data 'd'; its columns are: \['id', 'x'\]"):
        checked_keep_columns(["id", "user"], names, "data 'd'")
    with pytest.raises(ConfigError, match="must be a list of column names"):
        checked_keep_columns("id", names, "data 'd'")
    with pytest.raises(ConfigError, match=r"names \['id'\] more than once"):
        checked_keep_columns(["id", "id"], names, "data 'd'")


def test_parts_pack_into_tasks_up_to_the_target_and_big_parts_stay_alone():
    parts = [InputPart(f"{i:05d}-x", f"file:///d/{i}", (0,), rows) for i, rows in enumerate([10, 10, 10, 500, 10])]
    assert [[p.rows for p in t] for t in pack_parts(parts, min_tasks=1, target_rows=25)] == [
        [10, 10],
        [10],
        [500],
        [10],
    ]
    assert len(pack_parts(parts, min_tasks=100, target_rows=1000)) == 5  # every core gets a part
    assert [[p.rows for p in t] for t in pack_parts(parts, min_tasks=1, target_rows=1000)] == [[10, 10, 10, 500, 10]]


def test_an_existing_output_is_resumed_only_by_the_same_job(tmp_path):
    fs, root, url = pafs.LocalFileSystem(), str(tmp_path / "out"), "file://" + str(tmp_path / "out")
    record = {"model": "m1", "data": "d1", "options": {"batch_size": 8, "output": "raw"}}
    assert _prepare_output(fs, root, url, record, overwrite=False) is None
    assert json.load(open(os.path.join(root, JOB_RECORD))) == record
    open(os.path.join(root, "part-1.parquet"), "w").close()
    assert _prepare_output(fs, root, url, dict(record), overwrite=False) == record
    for key, word in (("model", "another model"), ("data", "other input data"), ("options", "other options")):
        other = {**record, key: {"batch_size": 8, "output": "label"} if key == "options" else "other"}
        with pytest.raises(ConfigError, match=f"another job \\({word} than this one\\): pass --overwrite"):
            _prepare_output(fs, root, url, other, overwrite=False)
    narrower = {**record, "options": {**record["options"], "keep_columns": ["id"]}}
    with pytest.raises(ConfigError, match="another job \\(other options than this one\\)"):
        _prepare_output(fs, root, url, narrower, overwrite=False)
    faster = {**record, "options": {"batch_size": 64, "output": "raw"}}  # what is written is the same
    assert _prepare_output(fs, root, url, faster, overwrite=False) == record
    assert _prepare_output(fs, root, url, {**record, "model": "m2"}, overwrite=True) is None
    assert not os.path.exists(os.path.join(root, "part-1.parquet"))


def test_an_output_that_is_not_a_predict_job_is_refused(tmp_path):
    fs, root = pafs.LocalFileSystem(), str(tmp_path / "out")
    os.makedirs(root)
    open(os.path.join(root, "notes.txt"), "w").close()
    with pytest.raises(ConfigError, match="is not a sparkdl predict job's output: pass --overwrite"):
        _prepare_output(fs, root, root, {"model": None, "data": "d", "options": {}}, overwrite=False)
    open(tmp_path / "file", "w").close()
    with pytest.raises(ConfigError, match="is a file"):
        _prepare_output(fs, str(tmp_path / "file"), "f", {}, overwrite=False)
