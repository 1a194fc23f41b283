"""Deep-learning inputs on the real local-cluster Spark: images as PNG bytes, token sequences with
a dense side input, an id Embedding beside dense features, Spark's own image sources, and exact
resume with dict batches."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

import sparkdl
from tests.integration.test_strategy_contract import STRATEGIES
from tests.models import DigitsCNN, TokenCounter, WideAndDeep, png_bytes

pytestmark = pytest.mark.spark


def _accuracy(output, label):
    return (output.argmax(1) == label).float().mean()


def _digit_pngs(features):
    """Digits (8x8 in [0, 1]) as grayscale PNG bytes."""
    return [png_bytes((f.reshape(8, 8) * 255).round().astype(np.uint8)) for f in features]


def _decoded(pngs):
    """What sparkdl.Image(size=(8, 8), channels=1) must hand the model, decoded independently."""
    from PIL import Image

    return np.stack([np.asarray(Image.open(io.BytesIO(b)), dtype=np.float32)[None] / 255.0 for b in pngs])


@pytest.fixture(scope="module")
def png_digits(spark, digits_split):
    (train_x, train_y), (test_x, test_y) = digits_split
    schema = "png binary, label long"
    train = spark.createDataFrame([(bytearray(b), int(y)) for b, y in zip(_digit_pngs(train_x), train_y)], schema)
    test_pngs = _digit_pngs(test_x)
    test = spark.createDataFrame([(bytearray(b), int(y)) for b, y in zip(test_pngs, test_y)], schema)
    return train, test, test_pngs, test_y


def _cnn_estimator(strategy, **overrides):
    settings = dict(
        model=DigitsCNN,
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        inputs={"image": sparkdl.Image("png", size=(8, 8), channels=1)},
        label_col="label",
        strategy=strategy,
        num_workers=2,
        batch_size=32,
        epochs=6,
        progress=False,
    )
    settings.update(overrides)
    return sparkdl.TorchEstimator(**settings)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_cnn_trains_on_png_bytes_with_every_strategy_and_transform_agrees(png_digits, strategy):
    train, test, test_pngs, test_y = png_digits
    model = _cnn_estimator(strategy).fit(train)
    expected = model.module(torch.from_numpy(_decoded(test_pngs))).detach()
    accuracy = float((expected.argmax(1).numpy() == test_y).mean())
    assert accuracy >= 0.9, f"CNN accuracy {accuracy:.3f} on PNG digits"
    predictions = np.array([r["prediction"] for r in model.transform(test).select("prediction").collect()])
    np.testing.assert_allclose(predictions, expected.numpy(), rtol=1e-4, atol=1e-5)


def test_images_kept_as_pixels_train_exactly_as_decoded_every_pass_augmentation_included(png_digits):
    """The shard cache keeps the decoded pixels after the first epoch; crops and flips still
    apply per pass, so the losses are those of a fit that decodes every pass, bit for bit."""
    train = png_digits[0]
    image = sparkdl.Image("png", size=(8, 8), channels=1, random_crop=1, random_flip=True)

    def fit(setting):
        estimator = _cnn_estimator(sparkdl.AllReduce(), inputs={"image": image}, epochs=3, seed=4, shard_cache=setting)
        return estimator.fit(train)

    streamed, cached = fit("none"), fit("memory")
    assert [r["loss"] for r in cached.history] == [r["loss"] for r in streamed.history]
    rank0 = cached.run_info["dataset"]["shard_cache"]["rank0"]
    assert rank0["images_decoded"] and rank0["served_row_groups"] > 0 and rank0["streamed_row_groups"] == 0
    assert rank0["held_bytes"] >= rank0["rows"] * 8 * 8  # one uint8 channel of 8 x 8 a row


def test_an_image_model_saves_loads_and_predicts_the_same(png_digits, tmp_path):
    train, test, _, _ = png_digits
    model = _cnn_estimator(sparkdl.AllReduce(), epochs=1).fit(train)
    model.save(str(tmp_path / "model"))
    loaded = sparkdl.TorchModel.load(str(tmp_path / "model"), model=DigitsCNN)
    assert loaded.input_plan == model.input_plan
    first = [r["prediction"] for r in model.transform(test).limit(20).collect()]
    again = [r["prediction"] for r in loaded.transform(test).limit(20).collect()]
    np.testing.assert_allclose(np.array(again), np.array(first), rtol=1e-6)


def _token_task(count, seed):
    """Label = 1 when (#1s - #2s) + 2 * dense > 0: neither the tokens nor the dense input alone
    decide it. Sequences have 3..30 tokens from 1..11."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        tokens = rng.integers(1, 12, rng.integers(3, 31)).tolist()
        dense = float(rng.standard_normal())
        score = tokens.count(1) - tokens.count(2) + 2.0 * dense
        rows.append((tokens, [dense], int(score > 0)))
    return rows


def test_a_gru_learns_a_variable_length_token_task_with_a_dense_side_input(spark):
    schema = "tokens array<int>, dense array<double>, label long"
    train = spark.createDataFrame(_token_task(3000, 0), schema)
    test_rows = _token_task(600, 1)
    test = spark.createDataFrame(test_rows, schema)
    estimator = sparkdl.TorchEstimator(
        model=TokenCounter,
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        inputs={"tokens": sparkdl.Sequence("tokens", max_length=32, lengths_input="lengths"), "dense": ["dense"]},
        label_col="label",
        num_workers=2,
        batch_size=32,
        epochs=8,
        progress=False,
        validation=0.1,
        metrics={"accuracy": _accuracy},
    )
    model = estimator.fit(train)
    predicted = np.array([np.argmax(r["prediction"]) for r in model.transform(test).select("prediction").collect()])
    accuracy = float((predicted == np.array([r[2] for r in test_rows])).mean())
    assert accuracy >= 0.85, f"GRU accuracy {accuracy:.3f}; history {model.history[-1]}"
    assert model.history[-1]["val_accuracy"] >= 0.8


def _users(count, seed, users=40):
    rng = np.random.default_rng(seed)
    bias = np.random.default_rng(99).uniform(-1.5, 1.5, users)
    ids = rng.integers(0, users, count)
    dense = rng.standard_normal((count, 2))
    labels = (bias[ids] + dense[:, 0] > 0).astype(int)
    return [(int(i), float(a), float(b), int(y)) for i, (a, b), y in zip(ids, dense, labels)]


def test_wide_and_deep_learns_a_per_user_effect_through_an_id_embedding(spark):
    schema = "user_id int, x0 double, x1 double, label long"
    train = spark.createDataFrame(_users(4000, 0), schema)
    test_rows = _users(800, 1)
    test = spark.createDataFrame(test_rows, schema)

    def ids_are_int64(inputs, labels):
        assert (
            inputs["user"].dtype == np.int64 and inputs["dense"].dtype == np.float32 and inputs["dense"].shape[1] == 2
        )
        return inputs, labels

    model = sparkdl.TorchEstimator(
        model=WideAndDeep,
        optimizer=lambda p: torch.optim.Adam(p, lr=0.02),
        inputs={"user": "user_id", "dense": ["x0", "x1"]},
        label_col="label",
        num_workers=2,
        batch_size=64,
        epochs=8,
        progress=False,
        transform_fn=ids_are_int64,
    ).fit(train)
    predicted = np.array([np.argmax(r["prediction"]) for r in model.transform(test).collect()])
    accuracy = float((predicted == np.array([r[3] for r in test_rows])).mean())
    # Without the user's own bias the dense input alone reaches about 0.75.
    assert accuracy >= 0.9, f"wide-and-deep accuracy {accuracy:.3f}"


def _record_batches(ctx):
    seen = []
    for _ in range(2):
        for inputs, labels in ctx.epoch_batches():
            assert set(inputs) == {"image", "user"}
            assert inputs["image"].dtype == torch.float32 and inputs["image"].shape[1:] == (3, 6, 6)
            assert inputs["user"].dtype == torch.int64
            seen.append((inputs["user"].tolist(), inputs["image"].sum(dim=(1, 2, 3)).tolist(), labels.tolist()))
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, seen)
    return gathered


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory):
    """Parquet with RGB PNG images of two sizes, token sequences and ids, in 6 row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("mixed")
    rows = 240
    images = [
        png_bytes(rng.integers(0, 256, (6 if i % 2 else 9, 6 if i % 2 else 9, 3), dtype=np.uint8)) for i in range(rows)
    ]
    tokens = [rng.integers(1, 50, rng.integers(0, 12)).tolist() for _ in range(rows)]
    table = pa.table(
        {
            "image": pa.array(images, type=pa.binary()),
            "tokens": pa.array(tokens, type=pa.list_(pa.int32())),
            "user": np.arange(rows),
            "label": np.arange(rows) % 5,
        }
    )
    pq.write_table(table, os.path.join(path, "part-0.parquet"), row_group_size=40)
    return str(path)


@pytest.mark.petastorm
def test_both_readers_hand_out_the_same_dict_batches(spark, mixed_dataset):
    inputs = {"image": sparkdl.Image("image", size=(6, 6), channels=3, random_flip=True, random_crop=1), "user": "user"}
    runs = {
        reader: sparkdl.run(
            _record_batches,
            num_workers=2,
            data=mixed_dataset,
            inputs=inputs,
            label_col="label",
            batch_size=16,
            seed=7,
            reader=reader,
            spark=spark,
            progress=False,
        )
        for reader in ("petastorm", "arrow")
    }
    assert runs["arrow"] == runs["petastorm"]
    rank0, rank1 = runs["arrow"]
    users0 = {u for batch in rank0 for u in batch[0]}
    users1 = {u for batch in rank1 for u in batch[0]}
    assert not users0 & users1 and len(users0 | users1) == 240  # disjoint shards, every row seen
    # Petastorm's make_batch_reader cannot stack variable-length lists: refused before launch.
    with pytest.raises(
        sparkdl.ConfigError,
        match="reader='petastorm' cannot read the variable-length arrays of sparkdl.Sequence input\\(s\\) 'tokens'",
    ):
        sparkdl.run(
            _record_batches,
            num_workers=2,
            data=mixed_dataset,
            inputs={"tokens": sparkdl.Sequence("tokens", max_length=8)},
            label_col="label",
            reader="petastorm",
            spark=spark,
            progress=False,
        )


def test_kill_and_resume_is_exact_with_dict_batches(png_digits, tmp_path):
    from tests.integration.test_recovery import _KillOnce

    train, _, _, _ = png_digits
    settings = dict(
        epochs=3,
        checkpoint_every=8,
        max_failures=1,
        seed=0,
        inputs={"image": sparkdl.Image("png", size=(8, 8), channels=1, random_crop=1, random_flip=True)},
    )
    reference = _cnn_estimator(sparkdl.AllReduce(), checkpoint_dir=str(tmp_path / "reference"), **settings).fit(train)
    killer = _KillOnce(str(tmp_path / "killed-once"), at=27)
    resumed = _cnn_estimator(
        sparkdl.AllReduce(), checkpoint_dir=str(tmp_path / "resumed"), loss=killer, **settings
    ).fit(train)
    assert len(resumed.run_info["attempts"]) == 2 and resumed.run_info["steps"]["resumed_at"] == 24
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in reference.history]
    for name, value in reference.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[name]), name


@pytest.fixture(scope="module")
def image_files(tmp_path_factory, digits_split):
    """Digits as RGB PNG files in class folders, for spark.read.format('image'/'binaryFile')."""
    (train_x, train_y), _ = digits_split
    root = tmp_path_factory.mktemp("image-files")
    for i, (x, y) in enumerate(zip(train_x[:400], train_y[:400])):
        os.makedirs(root / str(y), exist_ok=True)
        gray = (x.reshape(8, 8) * 255).round().astype(np.uint8)
        rgb = np.stack([gray, gray // 2, 255 - gray], axis=2)  # distinct channels: a BGR mix-up shows
        with open(root / str(y) / f"{i}.png", "wb") as handle:
            handle.write(png_bytes(rgb))
    return str(root)


def _collect_images(ctx):
    out = []
    for inputs, labels in ctx.epoch_batches():
        out += [
            (round(float(img[0].sum()), 3), round(float(img[2].sum()), 3), int(y))
            for img, y in zip(inputs["image"], labels)
        ]
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, out)
    return sorted(x for part in gathered for x in part)


def test_spark_image_and_binary_file_sources_decode_to_the_same_rgb_pixels(spark, image_files):
    from pyspark.sql import functions as F

    label = F.regexp_extract(F.col("path"), r"/(\d)/[^/]*$", 1).cast("long")
    binary = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.png")
        .option("recursiveFileLookup", "true")
        .load(image_files)
    )
    binary = binary.withColumn("label", label)
    images = spark.read.format("image").option("recursiveFileLookup", "true").load(image_files)
    images = images.withColumn("path", F.col("image.origin")).withColumn("label", label)
    common = dict(num_workers=2, label_col="label", batch_size=40, shuffle=False, spark=spark, progress=False)
    from_binary = sparkdl.run(
        _collect_images, data=binary, inputs={"image": sparkdl.Image("content", size=(8, 8))}, **common
    )
    from_struct = sparkdl.run(
        _collect_images, data=images, inputs={"image": sparkdl.Image("image", size=(8, 8))}, **common
    )
    assert len(from_binary) == 400 and from_binary == from_struct
    # Red is the digit, blue its inverse: channel 0 and 2 sums differ, so the order is RGB.
    assert all(abs(r + b - 64.0) < 1e-2 for r, b, _ in from_binary)

    model = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 10)),
        inputs={"image": sparkdl.Image("image", size=(8, 8))},
        label_col="label",
        epochs=1,
        num_workers=2,
        progress=False,
    )
    with pytest.raises(sparkdl.ConfigError, match="forward does not accept the input\\(s\\) 'image'"):
        model.fit(images)


def test_feature_cols_and_inputs_together_are_refused():
    with pytest.raises(sparkdl.ConfigError, match="give feature_cols= or inputs=, not both"):
        sparkdl.TorchEstimator(model=DigitsCNN, feature_cols=["x"], inputs={"image": "x"})


def _image_sums(ctx):
    out = []
    for inputs, labels in ctx.epoch_batches():
        out += [(int(y), round(float(img.sum()), 3), tuple(img.shape)) for img, y in zip(inputs["picture"], labels)]
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, out)
    return sorted(x for part in gathered for x in part)


@pytest.mark.petastorm
def test_petastorm_unischema_image_fields_map_onto_image_inputs(spark, tmp_path):
    """uint8 NdarrayCodec and CompressedImageCodec (PNG) image fields read as sparkdl.Image, the
    same through both readers: Petastorm decodes with its codec (OpenCV), the Arrow reader hands the
    stored PNG bytes to sparkdl's own decoder."""
    from petastorm.codecs import CompressedImageCodec, NdarrayCodec, ScalarCodec
    from petastorm.etl.dataset_metadata import materialize_dataset
    from petastorm.unischema import Unischema, UnischemaField
    from pyspark.sql.types import BinaryType, LongType, StructField, StructType

    pictures = [np.full((5, 5, 3), i, dtype=np.uint8) for i in range(96)]
    expected = sorted((i, round(float(i) / 255 * 75, 3), (3, 5, 5)) for i in range(96))
    spark_schema = StructType([StructField("picture", BinaryType()), StructField("label", LongType())])
    for name, codec, encode in [
        (
            "ndarray",
            NdarrayCodec(),
            lambda p: NdarrayCodec().encode(UnischemaField("picture", np.uint8, (5, 5, 3), NdarrayCodec(), False), p),
        ),
        (
            "png",
            CompressedImageCodec("png"),
            lambda p: CompressedImageCodec("png").encode(
                UnischemaField("picture", np.uint8, (5, 5, 3), CompressedImageCodec("png"), False), p
            ),
        ),
    ]:
        schema = Unischema(
            "Pictures",
            [
                UnischemaField("picture", np.uint8, (5, 5, 3), codec, False),
                UnischemaField("label", np.int64, (), ScalarCodec(LongType()), False),
            ],
        )
        url = "file://" + str(tmp_path / name)
        with materialize_dataset(spark, url, schema, row_group_size_mb=1):
            rows = [(bytearray(encode(p)), i) for i, p in enumerate(pictures)]
            spark.createDataFrame(rows, spark_schema).repartition(2).write.mode("overwrite").parquet(url)
        for reader in ("arrow", "petastorm"):
            seen = sparkdl.run(
                _image_sums,
                num_workers=2,
                data=url,
                inputs={"picture": sparkdl.Image("picture", size=(5, 5))},
                label_col="label",
                batch_size=8,
                shuffle=False,
                reader=reader,
                spark=spark,
                progress=False,
            )
            # Each label's picture holds that value everywhere; shards may wrap by a row or two.
            assert set(seen) <= set(expected) and len(set(seen)) >= 90, (name, reader, seen[:3])
