"""Input specs without Spark: image decoding, sequence padding, named batches through both
readers on real Parquet, transforms, seeded augmentation and the errors that name the input."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sparkdl
from sparkdl._driver.prepare_data import prepare_data
from sparkdl._driver.settings import DataSettings
from sparkdl.data.batching import batches, validation_batches
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers import reader_from_name
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError, DataError
from tests.models import png_bytes

READERS = ["arrow", pytest.param("petastorm", marks=pytest.mark.petastorm)]


def _write(path, row_group_size=10, **columns):
    os.makedirs(path, exist_ok=True)
    pq.write_table(pa.table(columns), os.path.join(path, "part-0.parquet"), row_group_size=row_group_size)
    return str(path)


def _plan(inputs, label="label"):
    return InputPlan.from_inputs(inputs, label)


def _take(path, inputs, n, reader="arrow", label="label", **spec):
    info = inspect_dataset(path, _plan(inputs, label))
    stream = batches(reader_from_name(reader), info, DataSpec(**{"batch_size": 4, "shuffle": False, **spec}), 0, 1)
    try:
        return [next(stream) for _ in range(n)]
    finally:
        stream.close()


def test_images_of_any_size_and_mode_decode_to_float_nchw_in_the_requested_shape(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)
    rgba = np.concatenate([rgb, np.full((12, 10, 1), 7, np.uint8)], axis=2)
    gray = rng.integers(0, 256, (6, 5), dtype=np.uint8)
    images = [png_bytes(rgb), png_bytes(rgba), png_bytes(gray), png_bytes(rgb, "JPEG")]
    path = _write(tmp_path, image=pa.array(images, pa.binary()), label=np.arange(4))
    (batch,) = _take(path, {"image": sparkdl.Image("image", size=(6, 5), channels=3)}, 1)
    image = batch[0]["image"]
    assert image.dtype == np.float32 and image.shape == (4, 3, 6, 5)
    assert 0.0 <= image.min() and image.max() <= 1.0
    np.testing.assert_array_equal(image[0], image[1])  # alpha dropped
    np.testing.assert_allclose(image[2][0], gray / np.float32(255), atol=1e-6)  # grayscale repeated, not resized
    np.testing.assert_array_equal(image[2][0], image[2][2])
    from PIL import Image

    resized = np.asarray(Image.fromarray(rgb).resize((5, 6), Image.BILINEAR)).transpose(2, 0, 1) / np.float32(255)
    np.testing.assert_allclose(image[0], resized, atol=1e-6)
    assert np.abs(image[3] - image[0]).mean() < 0.1  # the JPEG of the same picture

    (batch,) = _take(path, {"image": sparkdl.Image("image", size=(6, 5), channels=1, mean=0.5, std=0.25)}, 1)
    assert batch[0]["image"].shape == (4, 1, 6, 5)
    np.testing.assert_allclose(batch[0]["image"][2][0], (gray / 255.0 - 0.5) / 0.25, atol=1e-5)


def test_an_undecodable_image_names_the_input_column_file_and_row_group(tmp_path):
    good = png_bytes(np.zeros((4, 4), np.uint8))
    images = [good] * 13 + [b"not an image"] + [good] * 2
    path = _write(tmp_path, row_group_size=8, image=pa.array(images, pa.binary()), label=np.arange(16))
    with pytest.raises(
        DataError,
        match=r"input 'pixels' column 'image': cannot decode an image .*row 5 of row group 1 of file .*part-0.parquet",
    ):
        _take(path, {"pixels": sparkdl.Image("image", size=(4, 4), channels=1)}, 4)


def test_image_inputs_refuse_columns_that_hold_no_images(tmp_path):
    path = _write(tmp_path, image=np.arange(4.0), label=np.arange(4))
    with pytest.raises(
        DataError, match="input 'img' column 'image' .* has type double; sparkdl.Image needs a binary column"
    ):
        inspect_dataset(path, _plan({"img": sparkdl.Image("image", size=(4, 4))}))
    with pytest.raises(ConfigError, match="channels=4 must be 1"):
        sparkdl.Image("image", size=(4, 4), channels=4)
    with pytest.raises(ConfigError, match="size=8 must be"):
        sparkdl.Image("image", size=8)


def test_sequences_pad_to_the_longest_row_of_the_batch_truncate_and_report_lengths_and_mask(tmp_path):
    tokens = [[5, 6, 7], [1], [], [9, 9, 9, 9, 9, 9, 9], [2, 3]]
    path = _write(tmp_path, tokens=pa.array(tokens, pa.list_(pa.int32())), label=np.arange(5))
    spec = sparkdl.Sequence("tokens", max_length=5, pad_value=-1, lengths_input="n", mask_input="mask")
    (batch,) = _take(path, {"tokens": spec}, 1)
    inputs = batch[0]
    np.testing.assert_array_equal(inputs["tokens"], [[5, 6, 7, -1, -1], [1, -1, -1, -1, -1], [-1] * 5, [9] * 5])
    assert inputs["tokens"].dtype == np.int64
    np.testing.assert_array_equal(inputs["n"], [3, 1, 0, 5])
    np.testing.assert_array_equal(inputs["mask"], inputs["tokens"] != -1)
    (batch,) = _take(path, {"tokens": sparkdl.Sequence("tokens", max_length=5)}, 1, batch_size=2)
    assert batch[0]["tokens"].shape == (2, 3)  # padded to the batch's longest row


def test_sequence_columns_of_non_integers_or_nulls_are_named(tmp_path):
    path = _write(tmp_path, tokens=pa.array([[1.5], [2.0]], pa.list_(pa.float64())), label=np.arange(2))
    with pytest.raises(DataError, match=r"input 'tokens' column 'tokens' .* list<.*double> \(arrays of non-integers\)"):
        inspect_dataset(path, _plan({"tokens": sparkdl.Sequence("tokens", max_length=4)}))
    path = _write(tmp_path / "nulls", tokens=pa.array([[1], None, [2], [3]], pa.list_(pa.int64())), label=np.arange(4))
    with pytest.raises(DataError, match="input 'tokens' column 'tokens' has 1 null arrays in row group 0 of file"):
        _take(path, {"tokens": sparkdl.Sequence("tokens", max_length=4)}, 1)


@pytest.mark.parametrize("reader", READERS)
def test_ids_stay_int64_dense_lists_concatenate_and_labels_may_be_arrays(tmp_path, reader):
    path = _write(
        tmp_path,
        user=np.arange(8, dtype=np.int32),
        age=np.arange(8.0),
        vec=pa.array([[1.0, 2.0]] * 8, pa.list_(pa.float32())),
        tags=pa.array([[0, 1, 1]] * 8, pa.list_(pa.int64())),
    )
    (batch,) = _take(path, {"user": "user", "dense": ["age", "vec"]}, 1, reader=reader, label="tags")
    inputs, labels = batch
    assert inputs["user"].dtype == np.int64 and inputs["dense"].dtype == np.float32 and inputs["dense"].shape == (4, 3)
    np.testing.assert_array_equal(inputs["dense"][:, 0], inputs["user"])
    assert labels.shape == (4, 3) and labels.dtype == np.int64


def test_transform_fn_takes_and_returns_named_inputs_and_can_tokenize_strings(tmp_path):
    path = _write(tmp_path, text=["a bb", "ccc", "d", "ee ff gg"], label=np.arange(4))

    def tokenize(inputs, labels):
        lengths = np.array([len(t.split()) for t in inputs["text"]])
        return {"n_words": lengths}, labels

    (batch,) = _take(path, {"text": "text"}, 1, transform_fn=tokenize)
    np.testing.assert_array_equal(batch[0]["n_words"], [2, 1, 1, 3])
    with pytest.raises(ConfigError, match="input 'text' reads string column 'text' as it is.*transform_fn"):
        prepare_data(path, DataSettings(inputs={"text": "text"}, label_col="label", batch_size=2), num_workers=1)
    with pytest.raises(DataError, match="model input 'text' holds strings or bytes \\(column 'text'\\)"):
        _take(path, {"text": "text"}, 1, transform_fn=lambda inputs, labels: (inputs, labels))


def test_augmentation_is_seeded_by_the_batch_not_the_thread_and_skipping_matches(tmp_path):
    rng = np.random.default_rng(1)
    images = [png_bytes(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(64)]
    path = _write(tmp_path, row_group_size=16, image=pa.array(images, pa.binary()), label=np.arange(64))
    inputs = {"image": sparkdl.Image("image", size=(8, 8), random_crop=2, random_flip=True)}
    info = inspect_dataset(path, _plan(inputs))

    def run(threads, skip=0, n=12):
        stream = batches(
            reader_from_name("arrow"), info, DataSpec(batch_size=8, seed=3, decode_threads=threads), 0, 1, skip=skip
        )
        try:
            return [next(stream) for _ in range(n)]
        finally:
            stream.close()

    one, two = run(1), run(2)
    for (a, la), (b, lb) in zip(one, two):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(la, lb)
    for (a, _), (b, _) in zip(one[5:], run(2, skip=5, n=7)):
        np.testing.assert_array_equal(a["image"], b["image"])
    plain = _take(path, {"image": sparkdl.Image("image", size=(8, 8))}, 8, batch_size=8, seed=3, shuffle=True)
    assert any(not np.array_equal(a["image"], p["image"]) for (a, _), (p, _) in zip(one, plain))
    # Validation never augments.
    val = list(validation_batches(reader_from_name("arrow"), info, DataSpec(batch_size=8, shuffle=False), 0, 1))
    plain_val = _take(path, {"image": sparkdl.Image("image", size=(8, 8))}, 8, batch_size=8)
    for (a, _), (p, _) in zip(val, plain_val):
        np.testing.assert_array_equal(a["image"], p["image"])


def test_plans_refuse_bad_inputs_with_the_name_to_fix():
    with pytest.raises(ConfigError, match="give feature_cols= or inputs=, not both"):
        InputPlan.build(["x"], {"x": "x"}, "label")
    with pytest.raises(ConfigError, match="'not-a-name' is not a valid model input name"):
        InputPlan.from_inputs({"not-a-name": "x"}, "label")
    with pytest.raises(ConfigError, match=r"inputs\['x'\]=3 must be a column name"):
        InputPlan.from_inputs({"x": 3}, "label")
    with pytest.raises(ConfigError, match="'n' given twice"):
        InputPlan.from_inputs({"t": sparkdl.Sequence("t", max_length=3, lengths_input="n"), "n": "n"}, None)
    with pytest.raises(ConfigError, match="label column 'y' is also a model input"):
        InputPlan.from_inputs({"x": "y"}, "y")
    plan = InputPlan.from_inputs(
        {"i": sparkdl.Image("c", size=(2, 3), mean=(0.1, 0.2, 0.3), std=0.5), "d": ["a", "b"], "u": "u"},
        sparkdl.Sequence("l", 4, -100),
    )
    assert InputPlan.from_json(plan.to_json()) == plan


def test_null_images_and_unconvertible_channel_counts_are_named(tmp_path):
    good = png_bytes(np.zeros((4, 4), np.uint8))
    path = _write(
        tmp_path, row_group_size=4, image=pa.array([good] * 5 + [None] + [good] * 2, pa.binary()), label=np.arange(8)
    )
    with pytest.raises(
        DataError, match=r"input 'img' column 'image' has 1 null values in file .*part-0.parquet.* \(row group 1\)"
    ):
        inspect_dataset(path, _plan({"img": sparkdl.Image("image", size=(4, 4))}))
    plan = _plan({"img": sparkdl.Image("image", size=(4, 4))}, None)
    two_channels = np.empty(2, dtype=object)
    two_channels[0], two_channels[1] = np.zeros((4, 4, 3), np.uint8), np.zeros((4, 4, 2), np.uint8)
    with pytest.raises(
        DataError,
        match="input 'img' column 'image': cannot decode an image .*has 2 channels\\), in row 11 of somewhere",
    ):
        plan.finish({"img": two_channels, "\x00position": np.array([10, 11])}, None, lambda p: f"row {p} of somewhere")


def test_the_petastorm_reader_says_what_to_install_where_it_cannot_run():
    from sparkdl.data.petastorm_schema import petastorm_problem
    from sparkdl.data.readers.petastorm import PetastormReader

    problem = petastorm_problem()
    if problem:  # the latest stack: no Petastorm, pyarrow >= 15
        with pytest.raises(
            ConfigError,
            match=r"reader='petastorm' cannot run here: .*pip install 'sparkdl-torch\[petastorm\]'.*reader='arrow'",
        ):
            reader_from_name("petastorm")
        with pytest.raises(ConfigError, match="reader='petastorm' cannot run here"):
            sparkdl.TorchEstimator(model=lambda: None.__class__, reader="petastorm")
    else:  # the Petastorm stack
        assert isinstance(reader_from_name("petastorm"), PetastormReader)


def test_a_sequence_label_pads_like_its_tokens_for_token_tagging(tmp_path):
    tokens = [[5, 6, 7], [1], [9, 9]]
    tags = [[1, 0, 2], [3], [0, 0]]
    path = _write(tmp_path, tokens=pa.array(tokens, pa.list_(pa.int32())), tags=pa.array(tags, pa.list_(pa.int64())))
    (batch,) = _take(
        path,
        {"tokens": sparkdl.Sequence("tokens", max_length=4)},
        1,
        label=sparkdl.Sequence("tags", 4, pad_value=-100),
        batch_size=3,
    )
    inputs, labels = batch
    np.testing.assert_array_equal(inputs["tokens"], [[5, 6, 7], [1, 0, 0], [9, 9, 0]])
    np.testing.assert_array_equal(labels, [[1, 0, 2], [3, -100, -100], [0, 0, -100]])
    assert labels.dtype == np.int64 and labels.shape == inputs["tokens"].shape
