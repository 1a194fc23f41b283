"""The data path on a real cluster: shards, balance, uneven and few row groups, Petastorm datasets."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

import sparkdl

pytestmark = pytest.mark.spark


def _write_ids(path, row_group_sizes_per_file):
    """Files whose rows carry their own id (as the feature), with the given row-group sizes."""
    os.makedirs(path, exist_ok=True)
    next_id = 0
    for index, sizes in enumerate(row_group_sizes_per_file):
        writer = None
        for size in sizes:
            ids = np.arange(next_id, next_id + size)
            next_id += size
            table = pa.table({"id": ids.astype(np.float64), "label": (ids % 3).astype(np.int64)})
            writer = writer or pq.ParquetWriter(os.path.join(path, f"part-{index}.parquet"), table.schema)
            writer.write_table(table)
        writer.close()
    return str(path), next_id


class _RecordIds:
    """Runs ``epochs`` epochs and returns, from rank 0, every rank's ids per epoch."""

    def __init__(self, epochs):
        self.epochs = epochs

    def __call__(self, ctx):
        per_epoch = []
        for _ in range(self.epochs):
            ids = []
            steps = 0
            for features, labels in ctx.epoch_batches():
                ids.extend(features[:, 0].long().tolist())
                assert torch.equal(labels, features[:, 0].long() % 3), "features and labels came apart"
                steps += 1
            per_epoch.append((steps, ids))
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, per_epoch)
        return gathered


def test_uneven_row_groups_give_equal_steps_and_the_remainder_opens_the_next_epoch(spark, tmp_path):
    path, total = _write_ids(tmp_path / "uneven", [[300, 40, 17, 5], [100]])
    batch = 16
    epochs = 4
    per_rank = sparkdl.run(
        _RecordIds(epochs),
        num_workers=2,
        data=path,
        feature_cols=["id"],
        label_col="label",
        batch_size=batch,
        shuffle=False,
        spark=spark,
        progress=False,
    )
    steps = total // (2 * batch)
    for rank_epochs in per_rank:
        assert [s for s, _ in rank_epochs] == [steps] * epochs  # every rank, every epoch: same steps
    # Row groups are the shard unit: global groups (300, 40, 17, 5, 100 rows) 0, 2, 4 go to
    # rank 0 (417 rows) and 1, 3 to rank 1 (45 rows), each read in file order without shuffling.
    shards = [
        list(range(0, 300)) + list(range(340, 357)) + list(range(362, 462)),
        list(range(300, 340)) + list(range(357, 362)),
    ]
    for rank, (rank_epochs, shard) in enumerate(zip(per_rank, shards)):
        stream = [i for _, ids in rank_epochs for i in ids]
        # One stream across epochs that cycles the shard: an epoch starts where the one before it
        # stopped, and the smaller shard wraps around inside every epoch.
        assert stream == (shard * (len(stream) // len(shard) + 1))[: len(stream)], f"rank {rank}"
    # Rank 0's epoch 1 is rows 0-223 (14 steps of 16); epoch 2 opens with the rows past them, not
    # with row 0 again, and after its shard's last row (461) wraps to row 0.
    assert per_rank[0][1][1][:2] == [224, 225] and per_rank[0][1][1][-32:-30] == [461, 0]
    seen = [set(shard) for shard in shards]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(total))  # disjoint, none lost


def test_fewer_row_groups_than_workers_stride_rows(spark, tmp_path):
    path, total = _write_ids(tmp_path / "single", [[100]])
    per_rank = sparkdl.run(
        _RecordIds(1),
        num_workers=2,
        data=path,
        feature_cols=["id"],
        label_col="label",
        batch_size=10,
        shuffle=False,
        spark=spark,
        progress=False,
    )
    ((steps0, ids0),) = per_rank[0]
    ((steps1, ids1),) = per_rank[1]
    assert steps0 == steps1 == 5
    assert ids0 == list(range(0, 100, 2))
    assert ids1 == list(range(1, 100, 2))


def test_same_seed_same_batches_different_seed_different_order(spark, tmp_path):
    path, _ = _write_ids(tmp_path / "seeded", [[64] * 6])

    def fingerprint(seed):
        per_rank = sparkdl.run(
            _RecordIds(3),
            num_workers=2,
            data=path,
            feature_cols=["id"],
            label_col="label",
            batch_size=8,
            seed=seed,
            spark=spark,
            progress=False,
        )
        return [[ids for _, ids in rank_epochs] for rank_epochs in per_rank]

    first, again, other = fingerprint(7), fingerprint(7), fingerprint(8)
    assert first == again
    assert first != other
    # Shuffled, the shards stay disjoint and whole: 6 row groups of 64 rows, 3 per rank, and an
    # epoch of 24 steps of 8 is exactly one pass over a rank's 192 rows.
    for epoch in range(3):
        ranks = [set(first[rank][epoch]) for rank in (0, 1)]
        assert [len(first[rank][epoch]) for rank in (0, 1)] == [len(r) for r in ranks] == [192, 192]
        assert not ranks[0] & ranks[1] and ranks[0] | ranks[1] == set(range(384))
    # Shuffling really mixes rows: within an epoch, ids are not in file order.
    assert first[0][0] != sorted(first[0][0])


def test_fit_is_deterministic_for_a_fixed_seed(spark, tmp_path):
    from examples.digits import write_dataset
    from tests.models import digits_mlp

    path = write_dataset(str(tmp_path / "digits"))

    def fit():
        return sparkdl.TorchEstimator(
            model=digits_mlp,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            num_workers=2,
            batch_size=32,
            epochs=6,
            seed=3,
            progress=False,
        ).fit(path)

    a, b = fit(), fit()
    assert [r["loss"] for r in a.history] == [r["loss"] for r in b.history]
    for key, value in a.module.state_dict().items():
        assert torch.equal(value, b.module.state_dict()[key]), key


@pytest.mark.petastorm
def test_petastorm_unischema_dataset_is_read_with_make_reader(spark, tmp_path):
    """An image-like ndarray field stored with Petastorm's codec keeps its shape in the batches."""
    from petastorm.codecs import NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField, dict_to_spark_row
    from pyspark.sql.types import LongType

    schema = Unischema(
        "Tiles",
        [
            UnischemaField("image", np.float32, (4, 4), NdarrayCodec(), False),
            UnischemaField("label", np.int64, (), ScalarCodec(LongType()), False),
        ],
    )
    url = "file://" + str(tmp_path / "petastorm")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=96)
    rows = []
    for label in labels:
        image = np.full((4, 4), float(label), dtype=np.float32) + rng.normal(scale=0.1, size=(4, 4)).astype(np.float32)
        rows.append(dict_to_spark_row(schema, {"image": image, "label": int(label)}))
    with materialize_dataset(spark, url, schema, row_group_size_mb=1):
        spark.createDataFrame(rows, schema.as_spark_schema()).repartition(4).write.mode("overwrite").parquet(url)

    def train_fn(ctx):
        shapes = set()
        model = ctx.prepare_model(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 2)))
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        for _ in range(5):
            for images, labels in ctx.epoch_batches():
                shapes.add(tuple(images.shape))
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(images), labels).backward()
                optimizer.step()
        module = ctx.final_module(model)
        with torch.no_grad():
            test = torch.stack([torch.zeros(4, 4), torch.ones(4, 4)])
            predicted = module(test).argmax(1).tolist()
        return shapes, predicted

    shapes, predicted = sparkdl.run(
        train_fn,
        num_workers=2,
        data=url,
        feature_cols=["image"],
        label_col="label",
        batch_size=8,
        spark=spark,
        progress=False,
    )
    assert shapes == {(8, 4, 4)}
    assert predicted == [0, 1]


def test_dataframe_with_several_numeric_and_array_columns(spark):
    """Feature columns are concatenated in order: [a, vec[0], vec[1], b]."""
    rows = [(float(i), [float(i) * 10, float(i) * 100], i % 2, i % 2) for i in range(64)]
    df = spark.createDataFrame(rows, "a double, vec array<double>, b int, label long")

    def train_fn(ctx):
        features, labels = next(iter(ctx.epoch_batches()))
        return features.tolist(), labels.tolist()

    features, labels = sparkdl.run(
        train_fn,
        num_workers=2,
        data=df,
        feature_cols=["a", "vec", "b"],
        label_col="label",
        batch_size=8,
        shuffle=False,
        spark=spark,
        progress=False,
    )
    for (a, v0, v1, b), label in zip(features, labels):
        assert v0 == pytest.approx(a * 10) and v1 == pytest.approx(a * 100)
        assert b == label == int(a) % 2


def _digest(values):
    return hashlib.sha256(np.asarray(values).tobytes()).hexdigest()
