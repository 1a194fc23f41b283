"""The shard cache on a real local-cluster: a fit whose later epochs read the ranks' decoded
shards from memory trains exactly as a streamed one, and says what it kept."""

from __future__ import annotations

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
