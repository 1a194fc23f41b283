"""A predict job killed twice at random points, then rerun to completion: every input row is in
the output exactly once, and no part committed by a killed run is computed again (each part
file carries the run that wrote it in its Parquet metadata). The killed drivers leave no
process behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparkdl.errors import ConfigError
from sparkdl.inference.committed_output import RUN_ID_KEY
from sparkdl.inference.parts import list_parts
from sparkdl.inference.predict_job import predict_parts
from tests.conftest import REPO_ROOT
from tests.integration.test_cache import _alive, _descendants
from tests.models import doubling_model

pytestmark = pytest.mark.spark

ROW_GROUP = 25
FILES = {"a.parquet": 8, "b.parquet": 8, "c.parquet": 6}  # row groups per file: one part each
PARTS = sum(FILES.values())
ROWS = PARTS * ROW_GROUP
OPTIONS = {"batch_size": 10}

# A driver of its own (process, JVM, Python workers) that runs the job until the test kills it:
# its model (a real TorchModel, y = 2x) holds in forward once the control file's count of parts
# is committed.
_DRIVER = """
import json, sys
sys.path[:0] = [{root!r}]
from pyspark.sql import SparkSession
from sparkdl.inference.parts import list_parts
from sparkdl.inference.predict_job import predict_parts
from tests.models import doubling_model

json.dump({{"output": {output!r}, "hold_at": {at}}}, open({control!r}, "w"))

spark = (
    SparkSession.builder.master("local[2]").appName("sparkdl-killed-predict")
    .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.local.dir", {local_dir!r})
    .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate()
)
parts = list_parts(spark, {data!r}, target_rows={row_group})
predict_parts(spark, doubling_model({control!r}), parts, {data!r}, {output!r}, options={options!r})
"""


def _write_data(directory):
    start = 0
    for name, groups in FILES.items():
        ids = list(range(start, start + groups * ROW_GROUP))
        table = pa.table({"id": pa.array(ids, pa.int64()), "x": pa.array([i / 2 for i in ids], pa.float64())})
        pq.write_table(table, os.path.join(directory, name), row_group_size=ROW_GROUP)
        start += len(ids)


def _markers(output):
    """part id -> run id of every committed part."""
    import json

    directory = os.path.join(output, "_committed")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return {
        n[: -len(".json")]: json.load(open(os.path.join(directory, n)))["run_id"] for n in names if n.endswith(".json")
    }


def _kill_when_committed(tmp_path, name, data, output, at):
    """Runs a driver until ``at`` parts are committed (watched on disk), SIGKILLs it, and checks
    that its JVM and Python workers end with it (what is left is killed, by PID, and fails)."""
    local_dir = tmp_path / f"{name}-tmp"
    local_dir.mkdir()
    env = {**os.environ, "TMPDIR": str(local_dir), "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    env["PYTHONPATH"] = REPO_ROOT
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    script = _DRIVER.format(
        root=REPO_ROOT,
        local_dir=str(local_dir),
        data=data,
        row_group=ROW_GROUP,
        output=output,
        at=at,
        options=OPTIONS,
        control=str(tmp_path / "hold.json"),
    )
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT)
    descendants = []
    try:
        deadline = time.monotonic() + 120
        while len(_markers(output)) < at:  # bounded poll of another process's output
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        descendants = _descendants(driver.pid)
        driver.kill()
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        deadline = time.monotonic() + 30
        while [pid for pid in descendants if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in descendants if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert descendants and not left, f"the killed driver left processes behind: {left}"
    assert driver.returncode == -signal.SIGKILL


def test_a_predict_job_killed_twice_resumes_without_recomputing_a_committed_part(spark, tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    data, output = tmp_path / "data", str(tmp_path / "predictions")
    data.mkdir()
    _write_data(str(data))

    first_at = rng.randint(2, 7)
    _kill_when_committed(tmp_path, "first", str(data), output, first_at)
    first = _markers(output)
    # Two tasks at once: each may have passed its hold just before the other's commit.
    assert first_at <= len(first) <= first_at + 1, (seed, first)
    second_at = rng.randint(len(first) + 2, PARTS - 3)
    _kill_when_committed(tmp_path, "second", str(data), output, second_at)
    second = _markers(output)
    assert second_at <= len(second) <= second_at + 1 and set(first) < set(second), (seed, second)
    assert {second[p] for p in first} == set(first.values()) and len(set(first.values())) == 1
    assert len({second[p] for p in set(second) - set(first)}) == 1 and set(first.values()) != set(second.values())

    parts = list_parts(spark, str(data), target_rows=ROW_GROUP)
    control = str(tmp_path / "hold.json")
    os.remove(control)  # the last run holds nowhere
    result = predict_parts(spark, doubling_model(control), parts, str(data), output, options=OPTIONS)

    assert (result.parts, result.parts_skipped, result.parts_written) == (PARTS, len(second), PARTS - len(second))
    assert (result.rows, result.bad_rows) == (ROWS, 0)
    files = sorted(n for n in os.listdir(output) if n.startswith("part-"))
    assert len(files) == PARTS and os.path.exists(os.path.join(output, "_SUCCESS"))
    assert not os.path.exists(os.path.join(output, "_temporary"))
    ids = [i for n in files for i in pq.read_table(os.path.join(output, n)).column("id").to_pylist()]
    assert ids == list(range(ROWS)), f"seed {seed}: rows lost, repeated or out of order"
    written_by = {
        n[len("part-") : -len(".parquet")]: pq.read_schema(os.path.join(output, n)).metadata[RUN_ID_KEY] for n in files
    }
    for part_id, run_id in second.items():  # committed before the last run: not recomputed
        assert written_by[part_id].decode() == run_id, (seed, part_id)
    last = {written_by[p] for p in written_by if p not in second}
    assert len(last) == 1 and last.isdisjoint({r.encode() for r in second.values()}), seed
    assert spark.read.parquet(output).where("prediction = 2 * x").count() == ROWS

    # The same job again: complete, nothing runs; refused where asked (sparkdl predict).
    again = predict_parts(spark, doubling_model(control), parts, str(data), output, options=OPTIONS)
    assert (again.rows, again.parts_written, again.parts_skipped) == (ROWS, 0, PARTS)
    with pytest.raises(
        ConfigError, match="already exists: pass --overwrite .* holds the complete predictions of this job"
    ):
        predict_parts(spark, doubling_model(control), parts, str(data), output, options=OPTIONS, refuse_complete=True)
    with pytest.raises(ConfigError, match="another model than this one"):
        predict_parts(spark, doubling_model(control, weight=3.0), parts, str(data), output, options=OPTIONS)


def test_sparkdl_predict_with_a_torch_model_resumes_a_lost_part_and_refuses_other_options(spark, tmp_path):
    """The public function with a real TorchModel: predictions equal the module's own, a part
    lost after a run is the only one a rerun computes, another output kind is refused."""
    import numpy as np
    import torch

    import sparkdl
    from tests.models import digits_mlp

    torch.manual_seed(0)
    module = digits_mlp()
    model = sparkdl.TorchModel.from_state(
        module.state_dict(), model=digits_mlp, feature_cols=["features"], output_shape=[10]
    )
    features = np.random.default_rng(0).random((120, 64), dtype=np.float32)
    data = tmp_path / "digits"
    data.mkdir()
    for index in range(2):
        rows = slice(index * 60, index * 60 + 60)
        table = pa.table(
            {"id": pa.array(range(rows.start, rows.stop), pa.int64()), "features": features[rows].tolist()}
        )
        pq.write_table(table, str(data / f"part-{index}.parquet"), row_group_size=30)
    output = str(tmp_path / "out")

    first = sparkdl.predict(model, str(data), output, output="label")
    assert (first.rows, first.parts, first.parts_written, first.parts_skipped) == (120, 2, 2, 0)
    written = pq.read_table(output).sort_by("id")
    expected = module(torch.from_numpy(features)).argmax(1).tolist()
    assert written.column("prediction").to_pylist() == expected

    lost = sorted(n for n in os.listdir(output) if n.startswith("part-"))[1]
    os.remove(os.path.join(output, lost))
    os.remove(os.path.join(output, "_committed", lost[len("part-") : -len(".parquet")] + ".json"))
    os.remove(os.path.join(output, "_SUCCESS"))
    again = sparkdl.predict(model, str(data), output, output="label", batch_size=7)  # batch size: same results
    assert (again.rows, again.parts_written, again.parts_skipped) == (120, 1, 1)
    assert pq.read_table(output).sort_by("id").column("prediction").to_pylist() == expected
    with pytest.raises(sparkdl.ConfigError, match="another job \\(other options than this one\\): pass --overwrite"):
        sparkdl.predict(model, str(data), output, output="probabilities")
    replaced = sparkdl.predict(model, str(data), output, overwrite=True, output="top_k", top_k=3)
    assert replaced.parts_written == 2
    assert pq.read_table(output).sort_by("id").column("prediction").to_pylist()[0]["indices"][0] == expected[0]
    with pytest.raises(sparkdl.ConfigError, match="other options than this one"):  # what it keeps differs
        sparkdl.predict(model, str(data), output, keep_columns=["id"], output="top_k", top_k=3)

    narrow = str(tmp_path / "ids")
    with pytest.raises(
        sparkdl.ConfigError, match=r"keep_columns \['user'\] not in data .*columns are: \['id', 'features'\]"
    ):
        sparkdl.predict(model, str(data), narrow, keep_columns=["user"], output="label")
    sparkdl.predict(model, str(data), narrow, keep_columns=["id"], output="label")
    kept = pq.read_table(narrow).sort_by("id")
    assert kept.schema.names == ["id", "prediction"] and kept.column("prediction").to_pylist() == expected
