"""The DataFrame cache on disk: what a copy looks like, that it is deleted by
``sparkdl.clear_cache()`` and when the driver exits, and that Parquet is never copied."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

import sparkdl
from sparkdl import connectors
from sparkdl._driver.prepare_data import prepare_data
from sparkdl._driver.settings import DataSettings
from sparkdl.data import cache
from sparkdl.data.dataset import inspect_dataset
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.spark


def _parquet_files(directory):
    return sorted(
        os.path.join(root, name) for root, _, names in os.walk(directory) for name in names if name.endswith(".parquet")
    )


def _disk(directory):
    """Every path under ``directory``, relative to it."""
    return sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, dirs, names in os.walk(directory)
        for name in dirs + names
    )


def test_a_dataframes_copy_is_equal_files_per_worker_and_clear_cache_deletes_it(spark):
    from pyspark.sql import functions as F

    # Three input partitions of 200, 10 and 10 rows: written as they are, the files (and so the
    # ranks' row-group shards) would be 20x apart.
    ids = spark.range(0, 600, 1, 3).where("id < 210 or id >= 590")
    df = ids.select(F.array(F.col("id").cast("double")).alias("features"), (F.col("id") % 2).alias("label"))
    assert sorted(df.rdd.glom().map(len).collect()) == [10, 10, 200]

    # fit()/run() prepare a DataFrame exactly so (sparkdl/_driver/prepare_data.py): this is the copy they train on.
    dataset, _, _, _ = prepare_data(
        df, DataSettings(feature_cols=["features"], label_col="label", batch_size=8), num_workers=2, spark=spark
    )
    url = dataset.url
    assert url in cache.cached_urls()
    path = url[len("file://") :]
    # In this driver's private directory in the configured one (sparkdl.data.cache).
    private = os.path.dirname(path)
    assert os.path.dirname(private) == spark.conf.get(cache.CACHE_DIR_CONF) and os.path.basename(private).startswith(
        f"sparkdl-cache-{os.getpid()}-"
    )
    files = _parquet_files(path)
    assert [f"file://{f}" for f in files] == [f.url for f in dataset.files]  # the tasks read exactly these
    # "A multiple of num_workers files of equal size": the same number of row groups per file, and
    # rows per file within one per input partition (Spark's round-robin hands each file the floor
    # or the ceiling of every input partition's rows).
    assert len(files) % 2 == 0 and len(files) >= 2
    assert len({len(f.row_groups) for f in dataset.files}) == 1
    rows = [sum(f.row_groups) for f in dataset.files]
    assert sum(rows) == 220 and max(rows) - min(rows) <= 3, rows
    assert sorted(pq.read_table(path, columns=["label"]).column("label").to_pylist()) == sorted(
        i % 2 for i in list(range(210)) + list(range(590, 600))
    )

    sparkdl.clear_cache()
    assert not os.path.exists(path), f"clear_cache() left {_disk(path)}"
    assert all(not os.path.exists(f) for f in files)
    assert url not in cache.cached_urls()


def test_files_larger_than_a_row_group_are_rewritten_as_even_row_groups(spark, monkeypatch):
    """Spark's writer splits a file larger than the row-group size into full row groups and a
    smaller last one; the copy is rewritten so that every row group has about the same rows
    (a rank's row-group shard is then never a few small groups while another's is large ones),
    with the same rows and still in the float32-bytes layout."""
    from pyspark.sql import functions as F

    # 2,000 rows of 32 float32 (128 bytes) in one partition: two files of ~128 KB; a 48 KB row
    # group makes each file two full groups and a smaller one.
    monkeypatch.setattr(cache, "ROW_GROUP_BYTES", 48 * 1024)
    features = F.array(*[(F.col("id") + k).cast("double") for k in range(32)]).alias("features")
    df = spark.range(0, 2000, 1, 1).select(features, (F.col("id") % 5).alias("label"), F.col("id"))
    spark_copy = cache.materialize(df, ["features", "label", "id"], 2, packed=["features"])
    try:
        dataset = inspect_dataset(spark_copy, ["features"], "label")
        groups = [rows for f in dataset.files for rows in f.row_groups]
        # Even: a round-robin split of the first copy's two files (within one row per file).
        assert max(groups) - min(groups) <= 2, groups
        assert len(groups) % 2 == 0 and len(groups) >= 4, groups  # a multiple of the workers, ≤ 48 KB each
        assert all(len(f.row_groups) == 1 for f in dataset.files)
        assert dataset.infos["features"].packed  # still sparkdl's float32 bytes
        table = pq.read_table(spark_copy[len("file://") :])
        assert sorted(table.column("id").to_pylist()) == list(range(2000))
        rows = {row["id"]: row for row in table.to_pylist()}
        assert np.frombuffer(rows[1234]["features"], dtype=np.float32).tolist() == [1234.0 + k for k in range(32)]
        assert rows[1234]["label"] == 1234 % 5
        # Only the even copy is left: the first one is deleted.
        assert spark_copy.endswith("-even") and not os.path.exists(spark_copy[len("file://") : -len("-even")])

        # Five rows in two files of one row group each (3 and 2 rows): as even as a split can be,
        # so not rewritten (a rewrite would cost a Spark job and change nothing).
        tiny = cache.materialize(
            spark.range(0, 5, 1, 1).select(features, F.col("id").alias("label")),
            ["features", "label"],
            2,
            packed=["features"],
        )
        assert sorted(rows for f in inspect_dataset(tiny, ["features"], "label").files for rows in f.row_groups) == [
            2,
            3,
        ]
        assert not tiny.endswith("-even")
    finally:
        sparkdl.clear_cache()


# A driver as a user writes it: fit's data step on a DataFrame, then the script just ends (the
# session not even stopped). Prints where its copy was while it ran.
_SESSION_AND_DATAFRAME = """
import json, os, sys, time
sys.path[:0] = [{root!r}]
from pyspark.sql import SparkSession

spark = (
    SparkSession.builder.master("{master}").appName("sparkdl-cache-driver")
    .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate()
)
df = spark.createDataFrame([([float(i)], i % 2) for i in range(64)], "features array<double>, label long")
"""
_DRIVER = (
    _SESSION_AND_DATAFRAME
    + """
from sparkdl._driver.settings import DataSettings
from sparkdl._driver.prepare_data import prepare_data

dataset, _, _, _ = prepare_data(df, DataSettings(feature_cols=["features"], label_col="label", batch_size=8), num_workers=2, spark=spark)
path = dataset.url[len("file://"):]
print(json.dumps({{"pid": os.getpid(), "path": path, "files": sorted(os.listdir(path))}}))
"""
)


def test_a_driver_that_exits_leaves_no_copy_behind(tmp_path):
    # Its own temp dir: the default cache location is <tmp>/sparkdl-cache-<pid>, and no other
    # driver's stale-cache sweep (which deletes dead drivers' copies) can reach it and hide a leak.
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(temp),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": REPO_ROOT,
    }
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER.format(root=REPO_ROOT, master="local[1]")],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    own = os.path.dirname(seen["path"])
    assert os.path.dirname(own) == str(temp) and os.path.basename(own).startswith(
        f"sparkdl-cache-{seen['pid']}-"
    )  # the default location
    assert any(name.endswith(".parquet") for name in seen["files"])  # the copy existed while it ran
    assert not os.path.exists(seen["path"]), f"the exited driver left {_disk(seen['path'])}"
    assert os.listdir(temp) == [], f"the exited driver left its cache directory: {_disk(temp)}"


# A driver stopped mid-fit by SIGTERM (how Airflow, Kubernetes and YARN stop one): rank 0 says
# when it trains, then trains until stopped (bounded).
_STOPPED_DRIVER = (
    _SESSION_AND_DATAFRAME
    + """
import sparkdl

marker = {marker!r}

def loop(ctx):
    for _ in ctx.epoch_batches():
        if ctx.rank == 0 and not os.path.exists(marker):
            open(marker, "w").close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # "training" until the driver is stopped
        time.sleep(0.1)

sparkdl.run(loop, num_workers=2, data=df, feature_cols=["features"], label_col="label", batch_size=8, spark=spark, progress=False)
"""
)


def test_a_driver_stopped_by_sigterm_mid_fit_deletes_the_copy_and_leaves_no_process(tmp_path):
    temp, marker = tmp_path / "tmp", tmp_path / "training"
    temp.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(temp),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": REPO_ROOT,
    }
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    driver = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_DRIVER.format(root=REPO_ROOT, master="local[2]", marker=str(marker))],
        env=env,
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():  # the fit trains (bounded poll on another process's file)
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate(timeout=30)[0][-3000:]
            time.sleep(0.1)
        copies = [name for name in os.listdir(temp) if name.startswith("sparkdl-cache-")]
        assert len(copies) == 1 and os.listdir(temp / copies[0]), _disk(temp)  # the copy, while it trains
        descendants = _descendants(driver.pid)
        assert descendants, "the driver's JVM"
        driver.terminate()
        output = driver.communicate(timeout=60)[0]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == -15, output[-3000:]
    # (torch's own compile cache, torchinductor_<user>, may be there too: not ours)
    assert not [name for name in os.listdir(temp) if name.startswith("sparkdl-")], (
        f"SIGTERM left the training data behind: {_disk(temp)}"
    )
    deadline = time.monotonic() + 30
    while [pid for pid in descendants if _alive(pid)] and time.monotonic() < deadline:  # the JVM and its workers go
        time.sleep(0.1)
    assert not [pid for pid in descendants if _alive(pid)], "a process of the stopped driver outlived it"


def _descendants(pid):
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    children = [int(child) for child in handle.read().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


# ---- Parquet is read in place ----------------------------------------------------------------


def _write(path, ids):
    pq.write_table(
        pa.table({"id": np.asarray(ids, dtype=np.float64), "label": np.asarray(ids, dtype=np.int64) % 2}), path
    )
    return str(path)


def _ids_per_rank(ctx):
    """Every id each rank trained on in one epoch, in order."""
    ids = [int(i) for features, _ in ctx.epoch_batches() for i in features[:, 0]]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, ids)
    return gathered


def test_a_parquet_url_and_a_parquet_source_are_read_in_place_never_copied(spark, tmp_path):
    """README: "Parquet URLs are read in place, never copied" — for fit/run on a URL and for
    connectors.ParquetSource: nothing is written to the cache directory, and the ranks train on
    the user's files themselves (one row group each: rank r reads the r-th file of the list)."""
    (tmp_path / "data").mkdir()
    first = _write(tmp_path / "data" / "part-0.parquet", range(0, 48))
    second = _write(tmp_path / "data" / "part-1.parquet", range(100, 148))
    cache_root = spark.conf.get(cache.CACHE_DIR_CONF)
    on_disk, cached = _disk(cache_root), cache.cached_urls()

    def run(data):
        return sparkdl.run(
            _ids_per_rank,
            num_workers=2,
            data=data,
            feature_cols=["id"],
            label_col="label",
            batch_size=8,
            shuffle=False,
            spark=spark,
            progress=False,
        )

    # 96 rows, 2 ranks of 8-row batches: 6 steps, exactly one file per rank, in file order.
    assert run(str(tmp_path / "data")) == [list(range(0, 48)), list(range(100, 148))]
    assert _disk(cache_root) == on_disk and cache.cached_urls() == cached, "a Parquet URL was copied"
    # The estimator takes the same path: fit on the URL trains on the 96 rows, copying nothing.
    model = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Linear(1, 2),
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-4),
        loss=torch.nn.functional.cross_entropy,
        feature_cols=["id"],
        label_col="label",
        num_workers=2,
        batch_size=8,
        epochs=1,
        progress=False,
    ).fit(str(tmp_path / "data"))
    assert model.history[0]["samples"] == 96
    assert _disk(cache_root) == on_disk and cache.cached_urls() == cached, "fit copied a Parquet URL"
    # An explicit list is read in its own order, so the ranks swap files.
    assert run(connectors.ParquetSource([second, first])) == [list(range(100, 148)), list(range(0, 48))]
    assert _disk(cache_root) == on_disk and cache.cached_urls() == cached, "a ParquetSource was copied"
    # The files the run read are the user's, not a copy of them.
    dataset, _, _, _ = prepare_data(
        connectors.ParquetSource([second, first]),
        DataSettings(feature_cols=["id"], label_col="label", batch_size=8),
        num_workers=2,
        spark=spark,
    )
    assert [f.url for f in dataset.files] == [f"file://{second}", f"file://{first}"] and not dataset.origin
