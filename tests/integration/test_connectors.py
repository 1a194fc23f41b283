"""Connectors against real tables: Spark catalog tables (managed, external, partitioned, other
formats, views) and Delta tables (time travel; partition columns, column mapping and deletion
vectors read in place), trained on through the cluster."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed as dist

import sparkdl
from sparkdl import connectors
from sparkdl.data import cache
from sparkdl.data.dataset import ParquetFiles

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def database(spark, tmp_path_factory):
    """A database whose managed tables live in a temporary directory (not ./spark-warehouse)."""
    location = tmp_path_factory.mktemp("warehouse") / "sparkdl_test.db"
    spark.sql(f"CREATE DATABASE IF NOT EXISTS sparkdl_test LOCATION '{location}'")
    yield "sparkdl_test", str(location)
    spark.sql("DROP DATABASE IF EXISTS sparkdl_test CASCADE")


def _ids_frame(spark, n=96, partitions=3):
    rows = [([float(i), float(-i)], i % 2) for i in range(n)]
    return spark.createDataFrame(rows, "features array<double>, label long").repartition(partitions)


def _all_ids(ctx):
    """Every id any rank saw in 3 epochs: shards differ in size, so one epoch may not cover the
    bigger shard, while three cover every shard here."""
    ids = [int(i) for _ in range(3) for features, _ in ctx.epoch_batches() for i in features[:, 0]]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, ids)
    return sorted(set(i for rank_ids in gathered for i in rank_ids))


def _run(spark, source, n, batch_size=8):
    return sparkdl.run(
        _all_ids,
        num_workers=2,
        data=source,
        feature_cols=["features"],
        label_col="label",
        batch_size=batch_size,
        shuffle=False,
        spark=spark,
        progress=False,
    )


def test_managed_parquet_table_is_read_in_place(spark, database):
    name, location = database
    _ids_frame(spark).write.mode("overwrite").saveAsTable(f"{name}.clicks")
    resolved = connectors.SparkTable(f"{name}.clicks").resolve(spark, ["features", "label"])
    assert isinstance(resolved, ParquetFiles)
    assert resolved.url == f"file://{location}/clicks" and len(resolved.files) == 3
    assert all(f.startswith(f"file://{location}/clicks/part-") for f in resolved.files)
    assert "managed parquet, read in place" in resolved.description

    before = cache.cached_urls()
    assert _run(spark, connectors.SparkTable(f"{name}.clicks"), 96) == list(range(96))
    assert cache.cached_urls() == before  # nothing was materialized


def test_external_table_in_place_and_what_must_be_materialized(spark, database, tmp_path):
    name, _ = database
    frame = _ids_frame(spark, n=64, partitions=2)
    frame.write.mode("overwrite").option("path", str(tmp_path / "external")).saveAsTable(f"{name}.external")
    external = connectors.SparkTable(f"{name}.external").resolve(spark, ["features", "label"])
    assert isinstance(external, ParquetFiles) and all(str(tmp_path / "external") in f for f in external.files)

    frame.write.mode("overwrite").partitionBy("label").saveAsTable(f"{name}.by_label")
    # The label lives only in the partition directories: materialize (a DataFrame comes back)...
    assert not isinstance(connectors.SparkTable(f"{name}.by_label").resolve(spark, ["features", "label"]), ParquetFiles)
    # ...but a run that does not need it reads the files in place.
    assert isinstance(connectors.SparkTable(f"{name}.by_label").resolve(spark, ["features"]), ParquetFiles)

    frame.write.mode("overwrite").format("json").option("path", str(tmp_path / "json")).saveAsTable(f"{name}.as_json")
    frame.createOrReplaceTempView("sparkdl_ids_view")
    for table in (f"{name}.as_json", "sparkdl_ids_view"):
        assert not isinstance(connectors.SparkTable(table).resolve(spark, ["features", "label"]), ParquetFiles)
    with pytest.raises(
        sparkdl.DataError, match="cannot be read in place \\(its format is json, not Parquet\\) and materialize='never'"
    ):
        connectors.SparkTable(f"{name}.as_json", materialize="never").resolve(spark, ["features", "label"])
    with pytest.raises(sparkdl.DataError, match="no table 'sparkdl_test.nope' in the Spark catalog"):
        connectors.SparkTable(f"{name}.nope").resolve(spark, ["features"])

    before = len(cache.cached_urls())
    assert _run(spark, connectors.SparkTable(f"{name}.by_label"), 64) == list(range(64))
    assert len(cache.cached_urls()) == before + 1  # materialized once through the cache


def test_fit_on_a_delta_table_version(spark, tmp_path):
    from deltalake import write_deltalake

    path = str(tmp_path / "delta")

    def table(start, count):
        ids = np.arange(start, start + count)
        return pa.table(
            {
                "features": pa.array(list(np.stack([ids, -ids], 1).astype(np.float32)), type=pa.list_(pa.float32())),
                "label": ids % 2,
            }
        )

    write_deltalake(path, table(0, 80))
    write_deltalake(path, table(1000, 48), mode="append")
    assert _run(spark, connectors.DeltaSource(path, version=0), 80) == list(range(80))
    assert _run(spark, connectors.DeltaSource(path), 128) == list(range(80)) + list(range(1000, 1048))

    model = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Linear(2, 2),
        num_workers=2,
        batch_size=8,
        epochs=1,
        validation=0.25,
        progress=False,
    ).fit(connectors.DeltaSource(path, version=0))
    from sparkdl.data.dataset import inspect_dataset
    from sparkdl.data.selection import shard_rows

    held_out = sum(
        shard_rows(
            inspect_dataset(connectors.DeltaSource(path, version=0).resolve(), ["features"], "label"),
            2,
            0.25,
            "holdout",
        )
    )
    assert model.run_info["dataset"]["rows"] == 80 and 0 < held_out < 40
    # Trained on the version's rows and validated on exactly the held-out ones, every rank's.
    assert model.history[0]["val_samples"] == held_out and np.isfinite(model.history[0]["val_loss"])


def _id_label_pairs(ctx):
    """(id, label) of every row any rank took in 3 epochs."""
    pairs = [
        (int(f[0]), int(y))
        for _ in range(3)
        for features, labels in ctx.epoch_batches()
        for f, y in zip(features, labels)
    ]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, pairs)
    return sorted(set(p for rank_pairs in gathered for p in rank_pairs))


def test_training_on_a_production_delta_table_reads_what_the_table_holds(spark, tmp_path):
    """Partitioned (the label is a partition column: its values live only in the log), column
    mapped, with deletion vectors: the ranks train on exactly the rows delta-rs's own reader says
    the version holds, each with its partition value, and nothing is copied."""
    from tests.delta_tables import production_table, table_rows

    table = production_table(str(tmp_path / "clicks"))
    expected = sorted((row[0], row[1]) for row in table_rows(table.path))
    assert [i for i, _ in expected] == sorted(table.live)
    before = cache.cached_urls()
    seen = sparkdl.run(
        _id_label_pairs,
        num_workers=2,
        data=connectors.DeltaSource(table.path),
        feature_cols=["features"],
        label_col="label",
        batch_size=8,
        shuffle=False,
        spark=spark,
        progress=False,
    )
    assert seen == expected and cache.cached_urls() == before


def test_a_session_without_delta_is_told_apart_and_the_table_copied_once(spark, tmp_path):
    """This session has no Delta reader (delta-spark's jars come from Maven, which this machine
    cannot reach): sparkdl says so, and materialize='always' copies the version under
    spark.sparkdl.cacheDir instead, once."""
    from deltalake import write_deltalake

    from sparkdl.connectors.delta_copy import spark_read

    path = str(tmp_path / "delta")
    write_deltalake(
        path, pa.table({"features": pa.array([[1.0, 2.0]] * 40, pa.list_(pa.float32())), "label": list(range(40))})
    )
    assert spark_read(spark, path, {"versionAsOf": "0"}) == (
        None,
        "the Spark session has no Delta reader (delta-spark is not configured)",
    )
    copy = connectors.DeltaSource(path, materialize="always").resolve(spark, ["features", "label"])
    assert (
        copy.url.startswith(f"file://{spark.conf.get('spark.sparkdl.cacheDir')}/") and copy.url in cache.cached_urls()
    )
    assert connectors.DeltaSource(path, materialize="always").resolve(spark, []).url == copy.url
