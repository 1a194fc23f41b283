"""The shard cache on a real local-cluster: a fit whose later epochs read the ranks' decoded
shards from memory trains exactly as a streamed one, and says what it kept."""

from __future__ import annotations

import re

import pytest
import torch

import sparkdl
from tests.models import digits_mlp

pytestmark = pytest.mark.spark


def _fit(digits_df, setting):
    estimator = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        feature_cols=["features"],
        num_workers=2,
        batch_size=32,
        epochs=3,
        seed=7,
        shard_cache=setting,
        progress=False,
    )
    return estimator.fit(digits_df)


def test_a_fit_from_memory_trains_exactly_as_a_streamed_one_and_reports_its_cache(digits_df):
    streamed, cached = _fit(digits_df, "none"), _fit(digits_df, "memory")
    # The same batches on every rank at every step: the same losses, bit for bit.
    assert [r["loss"] for r in cached.history] == [r["loss"] for r in streamed.history]
    kept = cached.run_info["dataset"]["shard_cache"]
    assert kept["setting"] == "memory" and kept["budget_bytes"] > 0 and kept["shard_bytes"] > 0
    rank0 = kept["rank0"]
    assert rank0["held_bytes"] > 0 and rank0["row_groups"] > 0 and not rank0["full"]
    # Epochs 2 and 3 were served from memory (the reader reads ahead into the next pass too).
    assert rank0["served_row_groups"] >= rank0["row_groups"] and rank0["streamed_row_groups"] == 0
    assert all(record["cache_mb"] > 0 for record in cached.history)
    none = streamed.run_info["dataset"]["shard_cache"]
    assert none["budget_bytes"] is None and none["rank0"] is None and "every pass streams" in none["reason"]
    assert all("cache_mb" not in record for record in streamed.history)


def test_by_default_a_shard_that_fits_is_kept(digits_df):
    kept = _fit(digits_df, "auto").run_info["dataset"]["shard_cache"]
    assert kept["setting"] == "auto" and kept["budget_bytes"] > 0 and kept["rank0"]["held_bytes"] > 0
    assert "spark.executor" in kept["reason"]


@pytest.fixture(scope="module")
def over_a_gigabyte(tmp_path_factory):
    """A Parquet file whose footers say 1.2 GB of floats (zeros, plain-encoded, zstd: a few MB
    on disk), more than the 1 GiB a task of the test cluster has."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    width, rows = 256, 65_536  # 64 MiB of float32 a row group
    values = pa.array(np.zeros(rows * width, dtype=np.float32))
    features = pa.FixedSizeListArray.from_arrays(values, width).cast(pa.list_(pa.float32()))
    table = pa.table({"features": features, "label": pa.array(np.zeros(rows, dtype=np.int64))})
    path = tmp_path_factory.mktemp("large") / "part-0.parquet"
    with pq.ParquetWriter(path, table.schema, compression="zstd", use_dictionary=False) as writer:
        for _ in range(18):
            writer.write_table(table, row_group_size=rows)
    return str(path.parent)


def test_memory_on_a_shard_larger_than_a_tasks_memory_is_refused_before_launch(spark, over_a_gigabyte):
    tracker = spark.sparkContext.statusTracker()
    jobs_before = set(tracker.getJobIdsForGroup(None))
    estimator = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Linear(256, 2),
        feature_cols=["features"],
        label_col="label",
        num_workers=1,
        batch_size=1024,
        shard_cache="memory",
        progress=False,
    )
    with pytest.raises(sparkdl.ConfigError) as refused:
        estimator.fit(over_a_gigabyte)
    message = str(refused.value)
    # Both sizes, the setting they come from and what to change.
    assert "shard_cache='memory'" in message and "spark.executor.memory=1g" in message, message
    shard_mb = int(re.search(r"takes about ([\d,]+) MB decoded", message).group(1).replace(",", ""))
    assert shard_mb > 1_207 and "more than the 1,074 MB a task has" in message, message  # 18 x 64 MiB of floats
    assert "shard_cache='auto'" in message and "more workers" in message, message
    assert set(tracker.getJobIdsForGroup(None)) == jobs_before  # nothing ran on the cluster
    # "auto" streams it instead, and says why (not launched here: the decision alone).
    from sparkdl._driver.prepare_data import prepare_data
    from sparkdl._driver.settings import DataSettings

    _, spec, _, _ = prepare_data(
        over_a_gigabyte, DataSettings(feature_cols=["features"], label_col="label", batch_size=1024), 1, spark=spark
    )
    assert spec.shard_cache.budget_bytes is None and "every pass streams" in spec.shard_cache.reason
