"""A resume on a DataFrame that is not the one the checkpoints were trained on: its rows differ
from those of the copy kept beside the checkpoints, so it is materialized again, and the
checkpoint's stream positions would index other rows. The checkpoint records which data its
positions index (the copy's files and row groups); on other data the interrupted epoch ends and
training resumes at the next epoch, saying so, instead of training some rows twice and others
never. Counted on row ids. (The same rows resumed by a new driver process, exactly:
test_resume_new_driver.py.)"""

from __future__ import annotations

import collections
import logging

import pytest

import sparkdl
from tests.integration.test_elastic import ALL_ROWS, BATCH, ROWS, _epoch_ids, _IdLoop, write_ids_data

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def ids_data(tmp_path_factory) -> str:
    return write_ids_data(tmp_path_factory)


def _run(spark, df, loop, num_workers, checkpoint_dir):
    return sparkdl.run(
        loop,
        num_workers=num_workers,
        data=df,
        feature_cols=["id", "x0"],
        label_col="label",
        batch_size=BATCH,
        seed=0,
        spark=spark,
        progress=False,
        checkpoint_dir=checkpoint_dir,
        checkpoint_async=False,
    )


@pytest.mark.parametrize("old_world, new_world", [(2, 2), (2, 1)])
def test_a_resume_on_a_dataframe_of_other_rows_materialized_again_trains_no_row_twice(
    spark, ids_data, tmp_path, caplog, old_world, new_world
):
    from pyspark.sql import functions as F

    log_dir, checkpoint_dir = tmp_path / "log", str(tmp_path / "ckpt")
    log_dir.mkdir()
    steps = ROWS // (BATCH * old_world)
    at = steps + steps // 2 - 1  # mid-epoch 2
    loop = _IdLoop(str(log_dir), checkpoint_at=at, kill_rank=old_world - 1, epochs=3)
    rows = spark.read.parquet(ids_data)
    with pytest.raises(sparkdl.TrainingError, match="WorkerLost"):
        _run(spark, rows.orderBy(F.rand(1)), loop, old_world, checkpoint_dir)
    # The same ids in another order, one feature changed: not the rows of the copy kept beside the checkpoints.
    sparkdl.clear_cache()
    changed = rows.orderBy(F.rand(2)).withColumn("x0", F.col("x0") * 2)
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        result = _run(spark, changed, loop, new_world, checkpoint_dir)
    assert result["world_size"] == new_world
    before, after = _epoch_ids(str(log_dir), 1, 2, until_step=at), _epoch_ids(str(log_dir), 2, 2)
    assert sum(before.values()) == (at - steps) * BATCH * old_world and max(before.values()) == 1
    # Replaying the old positions onto the new copy would train rows here, some of them again.
    assert not after, f"the interrupted epoch went on over other rows: {sum((before & after).values())} rows twice"
    left = steps - (at - steps)
    assert (
        f"epoch 2 ends here ({left} of its steps per rank skipped) and training resumes at the start of epoch 3"
        in caplog.text
    )
    assert (
        "the DataFrame is not the one whose copy is kept beside the checkpoints in "
        f"file://{checkpoint_dir}/dataframe-copy: it has {ROWS} rows like the copy, but not the same values"
        in caplog.text
    )
    assert "the DataFrame" in caplog.text and "a DataFrame of the same rows" in caplog.text
    # The next epoch, on the new copy: a whole one, every row at most once.
    third = _epoch_ids(str(log_dir), 2, 3)
    assert sum(third.values()) == (ROWS // (BATCH * new_world)) * BATCH * new_world and set(third) <= set(ALL_ROWS)
    assert max(third.values()) == 1
    sparkdl.clear_cache()


def test_a_relaunch_by_the_same_driver_on_its_copy_resumes_mid_epoch_exactly(spark, ids_data, tmp_path, caplog):
    from pyspark.sql import functions as F

    log_dir, checkpoint_dir = tmp_path / "log", str(tmp_path / "ckpt")
    log_dir.mkdir()
    steps = ROWS // (BATCH * 2)
    at = steps + steps // 2 - 1
    loop = _IdLoop(str(log_dir), checkpoint_at=at, kill_rank=1)
    df = spark.read.parquet(ids_data).orderBy(F.rand(3))
    with pytest.raises(sparkdl.TrainingError, match="WorkerLost"):
        _run(spark, df, loop, 2, checkpoint_dir)
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        _run(spark, df, loop, 2, checkpoint_dir)  # the cached copy: the same files, the same rows
    before, after = _epoch_ids(str(log_dir), 1, 2, until_step=at), _epoch_ids(str(log_dir), 2, 2)
    assert before + after == collections.Counter(ALL_ROWS), "the interrupted epoch lost or repeated rows"
    assert "cannot be replayed" not in caplog.text
    sparkdl.clear_cache()
