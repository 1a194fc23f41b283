"""What every connector promises, on real tables and the shared local-cluster session.

A new connector joins by adding one entry to ``CONNECTORS``: a function that writes the rows
``ids`` (``features`` = [id, -id], ``label`` = id % 2) to a table of its kind under a fresh
directory and returns a :class:`connectors.Source` for it. Every connector must then

* resolve, on the driver, to Parquet files read in place (under the table's own location,
  nothing materialized) or to a DataFrame that sparkdl materializes once;
* give each row to exactly one rank's shard, and every row to a real run;
* name a missing column in terms of the source, before anything launches.
"""

from __future__ import annotations

import pathlib
import uuid
from typing import Callable, Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist

import sparkdl
from sparkdl import connectors
from sparkdl._driver.prepare_data import prepare_dataset
from sparkdl.data import cache
from sparkdl.data.dataset import ParquetFiles
from sparkdl.data.readers import reader_from_name
from sparkdl.data.spec import DataSpec
from tests.models import pairs

pytestmark = pytest.mark.spark

IDS = list(range(40)) + list(range(100, 124))


def _table(ids: List[int]) -> pa.Table:
    values = np.asarray(ids)
    features = pa.array(list(np.stack([values, -values], 1).astype(np.float32)), type=pa.list_(pa.float32()))
    return pa.table({"features": features, "label": values % 2})


def _parquet_directory(spark, directory: pathlib.Path, ids: List[int]) -> connectors.Source:
    directory.mkdir()
    for part, chunk in enumerate((ids[:30], ids[30:])):
        pq.write_table(_table(chunk), directory / f"part-{part}.parquet", row_group_size=8)
    return connectors.ParquetSource(str(directory))


def _delta_table(spark, directory: pathlib.Path, ids: List[int]) -> connectors.Source:
    from deltalake import write_deltalake

    write_deltalake(str(directory), _table(ids[:30]))
    write_deltalake(str(directory), _table(ids[30:]), mode="append")
    return connectors.DeltaSource(str(directory))


def _spark_table(spark, directory: pathlib.Path, ids: List[int]) -> connectors.Source:
    name = f"contract_{uuid.uuid4().hex[:8]}"
    frame = spark.createDataFrame([([float(i), float(-i)], i % 2) for i in ids], "features array<double>, label long")
    frame.repartition(2).write.option("path", str(directory)).saveAsTable(name)
    return connectors.SparkTable(name)


CONNECTORS: Dict[str, Callable[..., connectors.Source]] = {
    "parquet": _parquet_directory,
    "delta": _delta_table,
    "spark_table": _spark_table,
}


@pytest.fixture(params=sorted(CONNECTORS))
def source_and_location(request, spark, tmp_path):
    location = tmp_path / "table"
    return CONNECTORS[request.param](spark, location, IDS), location


def _ids_per_rank(ctx):
    """Ids each rank saw in two epochs (rows beyond an epoch's last full step open the next)."""
    ids = [int(i) for _ in range(2) for features, _ in ctx.epoch_batches() for i in features[:, 0]]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, ids)
    return gathered


def test_resolves_on_the_driver_to_files_in_place_or_a_dataframe(spark, source_and_location):
    source, location = source_and_location
    resolved = source.resolve(spark, ["features", "label"])
    assert isinstance(resolved, (ParquetFiles, type(spark.range(1))))
    if isinstance(resolved, ParquetFiles):
        files = resolved.files or (resolved.url,)
        assert all(f.startswith(f"file://{location}") for f in files), f"not read in place: {files}"
    assert type(source).__name__ in repr(source)


def test_every_row_reaches_exactly_one_rank_and_files_are_read_in_place(spark, source_and_location):
    source, location = source_and_location
    before = cache.cached_urls()
    per_rank = sparkdl.run(
        _ids_per_rank,
        num_workers=2,
        data=source,
        feature_cols=["features"],
        label_col="label",
        batch_size=4,
        shuffle=False,
        spark=spark,
        progress=False,
    )
    # An epoch is the same number of steps on both ranks, so shards of unequal size wrap around
    # at different times: a run sees every row, some twice; one pass of each shard sees each row
    # once (the next test).
    assert all(per_rank) and sorted(set(i for ids in per_rank for i in ids)) == IDS
    resolved = source.resolve(spark, ["features", "label"])
    if isinstance(resolved, ParquetFiles):
        assert cache.cached_urls() == before, "a table readable in place was copied"


def test_one_pass_of_every_shard_reads_each_row_exactly_once(spark, source_and_location):
    source, _ = source_and_location
    dataset = prepare_dataset(source, ["features"], num_workers=2, spark=spark, label_col="label")
    spec = DataSpec(batch_size=4, shuffle=False)
    chunks = [c for rank in range(2) for c in reader_from_name("arrow").read_pass(dataset, spec, rank, 2, 0)]
    seen = [int(i) for features, _ in pairs(chunks) for i in features[:, 0]]
    assert sorted(seen) == IDS


def test_a_missing_column_is_named_before_launch(spark, source_and_location):
    source, _ = source_and_location
    with pytest.raises(sparkdl.DataError, match="'nope'"):
        prepare_dataset(source, ["features", "nope"], num_workers=2, spark=spark, label_col="label")
