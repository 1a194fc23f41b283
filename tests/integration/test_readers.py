"""Both readers on a real cluster: same batches, validation with metrics, filters and transforms
through TorchEstimator, Petastorm codec datasets, and read-time data errors."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

import sparkdl
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers import reader_from_name
from sparkdl.data.selection import shard_rows
from sparkdl.data.spec import DataSpec
from tests.models import accuracy, digits_mlp, pairs

pytestmark = pytest.mark.spark


def _write_ids(path, row_groups_per_file):
    os.makedirs(path, exist_ok=True)
    next_id = 0
    for index, sizes in enumerate(row_groups_per_file):
        with pq.ParquetWriter(
            os.path.join(path, f"part-{index}.parquet"), pa.schema([("id", pa.float64()), ("label", pa.int64())])
        ) as writer:
            for size in sizes:
                ids = np.arange(next_id, next_id + size)
                next_id += size
                writer.write_table(pa.table({"id": ids.astype(np.float64), "label": ids % 3}))
    return str(path)


def _record_ids(ctx):
    per_epoch = [[int(i) for features, _ in ctx.epoch_batches() for i in features[:, 0]] for _ in range(2)]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, per_epoch)
    return gathered


@pytest.mark.petastorm
def test_both_readers_hand_every_rank_the_same_batches(spark, tmp_path):
    path = _write_ids(tmp_path / "ids", [[120, 40, 17], [100, 23]])
    runs = {
        reader: sparkdl.run(
            _record_ids,
            num_workers=2,
            data=path,
            feature_cols=["id"],
            label_col="label",
            batch_size=8,
            seed=4,
            reader=reader,
            spark=spark,
            progress=False,
        )
        for reader in ("petastorm", "arrow")
    }
    assert runs["arrow"] == runs["petastorm"]
    (rank0, rank1) = runs["arrow"]
    assert rank0[0] != sorted(rank0[0])  # shuffled
    assert not set(rank0[0] + rank0[1]) & set(rank1[0] + rank1[1])  # row groups 0,2,4 vs 1,3


def _digits_raw(path):
    """Digits with raw pixel values 0..16 and labels stored as digit + 100: training only works if
    transform_fn (which undoes both) runs on every batch, validation included."""
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    table = pa.table(
        {"features": pa.array(list(features.astype(np.float32)), type=pa.list_(pa.float32())), "label": labels + 100}
    )
    os.makedirs(path, exist_ok=True)
    pq.write_table(table, os.path.join(path, "part-0.parquet"), row_group_size=300)
    return str(path)


def _undo_encoding(features, labels):
    return features / 16.0, labels - 100


def _accuracy(output, label):
    return (output.argmax(1) == label).float().mean()


def _max_label(output, label):
    return label.max()


@pytest.mark.parametrize("reader", ["arrow", pytest.param("petastorm", marks=pytest.mark.petastorm)])
def test_fit_with_validation_metrics_filters_and_transform(spark, tmp_path, reader):
    path = _digits_raw(tmp_path / "digits")
    filters = [("label", "!=", 109)]  # no nines, in training or validation
    estimator = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
        num_workers=2,
        batch_size=32,
        epochs=6,
        reader=reader,
        filters=filters,
        transform_fn=_undo_encoding,
        validation=0.2,
        metrics={"accuracy": _accuracy, "max_label": _max_label},
        progress=False,
    )
    model = estimator.fit(path)
    info = inspect_dataset(path, ["features"], "label", filters=filters)
    held_out = sum(shard_rows(info, 2, holdout=0.2, part="holdout", filters=filters))
    trained = sum(shard_rows(info, 2, holdout=0.2, part="train", filters=filters))
    assert model.run_info["steps_per_epoch"] == trained // 64 and model.run_info["dataset"]["reader"] == reader
    for record in model.history:
        assert record["val_samples"] == held_out and 0.15 * 1797 < held_out < 0.25 * 1797
        assert record["val_max_label"] == 8.0  # filtered, and the transform ran on validation batches
        assert record["val_loss"] > 0
    assert model.history[-1]["val_accuracy"] >= 0.9
    assert model.history[-1]["val_loss"] < model.history[0]["val_loss"]


def test_custom_loop_validates_on_a_separate_dataframe(spark, digits_df, digits_test_df, digits_split):
    def train_fn(ctx):
        torch.manual_seed(0)
        model = ctx.prepare_model(digits_mlp())
        optimizer = ctx.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=3e-3))
        for _ in range(6):
            for features, labels in ctx.epoch_batches():
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(features), labels).backward()
                optimizer.step()
        sizes = [len(f) for f, _ in ctx.validation_batches()]
        return ctx.validate(model, torch.nn.functional.cross_entropy), sizes, ctx.final_module(model).state_dict()

    result, sizes, state = sparkdl.run(
        train_fn,
        num_workers=2,
        data=digits_df,
        feature_cols=["features"],
        label_col="label",
        batch_size=32,
        validation=digits_test_df,
        metrics={"accuracy": _accuracy},
        spark=spark,
        progress=False,
    )
    _, (test_x, test_y) = digits_split
    module = digits_mlp()
    module.load_state_dict(state)
    assert result["val_samples"] == len(test_y) == 360
    # The validation pass saw every test row once: its accuracy is the test accuracy.
    assert result["val_accuracy"] == pytest.approx(accuracy(module, test_x, test_y), abs=1e-6)
    assert result["val_accuracy"] >= 0.9 and all(s <= 32 for s in sizes)


@pytest.mark.petastorm
def test_petastorm_codec_dataset_reads_identically_with_both_readers(spark, tmp_path):
    """A Unischema dataset whose images are stored with NdarrayCodec: the Arrow reader decodes the
    codec itself and hands out the same batches as Petastorm's make_reader."""
    from petastorm.codecs import NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import LongType

    schema = Unischema(
        "Tiles",
        [
            UnischemaField("image", np.float32, (3, 4), NdarrayCodec(), False),
            UnischemaField("label", np.int64, (), ScalarCodec(LongType()), False),
        ],
    )
    url = "file://" + str(tmp_path / "tiles")
    rows = [dict_to_spark_row(schema, {"image": np.full((3, 4), i, dtype=np.float32), "label": i}) for i in range(120)]
    with materialize_dataset(spark, url, schema, row_group_size_mb=1):
        spark.createDataFrame(rows, schema.as_spark_schema()).repartition(3).write.mode("overwrite").parquet(url)

    info = inspect_dataset(url, ["image"], "label")
    assert info.is_petastorm and info.infos["image"].codec_field is not None
    spec = DataSpec(batch_size=8, seed=2)
    out = {}
    for name in ("petastorm", "arrow"):
        out[name] = [pairs(reader_from_name(name).read_pass(info, spec, rank, 2, 0)) for rank in range(2)]
    for rank in range(2):
        arrow = np.concatenate([f for f, _ in out["arrow"][rank]])
        petastorm = np.concatenate([f for f, _ in out["petastorm"][rank]])
        np.testing.assert_array_equal(arrow, petastorm)
        assert arrow.shape[1:] == (3, 4)
        labels = np.concatenate([labels for _, labels in out["arrow"][rank]])
        np.testing.assert_array_equal(arrow[:, 0, 0], labels)
    seen = [set(np.concatenate([labels for _, labels in out["arrow"][rank]]).tolist()) for rank in range(2)]
    assert seen[0] | seen[1] == set(range(120)) and not seen[0] & seen[1]


def test_nan_met_by_the_arrow_reader_names_column_file_and_row_group(spark, tmp_path):
    path = str(tmp_path / "nan")
    os.makedirs(path)
    x = np.ones((64, 4), dtype=np.float32)
    x[40, 2] = np.nan
    pq.write_table(
        pa.table({"f": pa.array(list(x), type=pa.list_(pa.float32())), "label": np.zeros(64, dtype=np.int64)}),
        path + "/p.parquet",
        row_group_size=32,
    )
    estimator = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Linear(4, 2),
        feature_cols=["f"],
        num_workers=2,
        batch_size=8,
        reader="arrow",
        progress=False,
    )
    with pytest.raises(
        sparkdl.TrainingError,
        match="feature column\\(s\\) f contain NaN or null values in row group 1 of file .*p.parquet",
    ):
        estimator.fit(path)
