"""TorchModel.transform on the shared local-cluster (2 executors x 1 core): the tasks read a
Parquet scan's files themselves, the model is built once per Python worker, output kinds are
Spark types, bad rows give nulls and reasons (or one clear error), out of memory splits."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image as PILImage

import sparkdl
from sparkdl.inference.scan import plain_parquet_sources
from tests.models import CountingFactory, Poisonable

pytestmark = pytest.mark.spark

ROWS = 2000


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """4 Parquet files of 2 row groups each: ``id`` and ``features`` (8 floats)."""
    root = tmp_path_factory.mktemp("inference-features")
    x = np.random.default_rng(0).standard_normal((ROWS, 8)).astype(np.float32)
    for i in range(4):
        part = slice(i * ROWS // 4, (i + 1) * ROWS // 4)
        table = pa.table({"id": np.arange(ROWS)[part], "features": pa.array(list(x[part]), pa.list_(pa.float32()))})
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=ROWS // 8)
    return str(root), x


def _expected(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return Poisonable()(torch.from_numpy(x)).numpy()


def _builds(directory) -> list:
    """The builds on executors (from_state builds the module once on the driver, too)."""
    found = [json.loads(p.read_text()) for p in sorted(directory.iterdir())]
    return [b for b in found if b["pid"] != os.getpid()]


def _model(directory) -> sparkdl.TorchModel:
    factory = CountingFactory(str(directory))
    return sparkdl.TorchModel.from_state(
        Poisonable().state_dict(), model=factory, feature_cols=["features"], output_shape=[3]
    )


def test_a_parquet_scan_is_read_by_the_tasks_themselves_and_scores_every_row_once(spark, features, tmp_path):
    path, x = features
    df = spark.read.parquet(path)
    assert plain_parquet_sources(df) is not None
    model = _model(tmp_path)
    out = model.transform(df)
    plan = out._jdf.queryExecution().executedPlan().toString()
    assert "FileScan" not in plan and "Range" in plan, plan
    assert out.schema.simpleString() == "struct<id:bigint,features:array<float>,prediction:array<float>>"
    table = out.toArrow().sort_by("id")
    assert table.column("id").to_pylist() == list(range(ROWS))
    np.testing.assert_allclose(np.array(table.column("prediction").to_pylist()), _expected(x), rtol=1e-5, atol=1e-6)

    # A filtered DataFrame is not a plain scan: Spark reads it and hands it over, same numbers.
    filtered = model.transform(df.filter("id % 3 = 0"))
    assert "FileScan" in filtered._jdf.queryExecution().executedPlan().toString()
    rows = filtered.toArrow().sort_by("id")
    ids = np.array(rows.column("id").to_pylist())
    np.testing.assert_allclose(np.array(rows.column("prediction").to_pylist()), _expected(x[ids]), rtol=1e-5, atol=1e-6)


def test_the_model_is_built_once_per_python_worker_and_again_only_for_new_weights(spark, features, tmp_path):
    path, x = features
    builds = tmp_path / "builds"
    builds.mkdir()
    model = _model(builds)
    df = spark.read.parquet(path).repartition(8)
    assert model.transform(df).count() == ROWS  # 8 tasks
    first = _builds(builds)
    pids = {b["pid"] for b in first}
    assert 1 <= len(first) == len(pids) <= 2, first  # one build per worker, 2 executors x 1 core
    assert model.transform(df).count() == ROWS
    assert len(_builds(builds)) == len(first)  # the same weights: every worker had it

    with torch.no_grad():  # weights changed in place: a new identity, never the cached model
        model.module.net[2].bias.add_(10.0)
    table = model.transform(spark.read.parquet(path)).toArrow().sort_by("id")
    assert len(_builds(builds)) > len(first)
    with torch.inference_mode():
        want = model.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.array(table.column("prediction").to_pylist()), want, rtol=1e-5, atol=1e-6)


def test_output_kinds_and_heads_are_spark_types(spark, features, tmp_path):
    path, x = features
    df = spark.read.parquet(path)
    model = _model(tmp_path)
    kinds = {}
    for kind in ("probabilities", "label", "top_k"):
        out = model.copy().setOutput(kind).setTopK(2).transform(df)
        kinds[kind] = dict(out.dtypes)["prediction"]
        first = out.orderBy("id").first()
        expected = _expected(x[:1])[0]
        if kind == "label":
            assert first["prediction"] == int(expected.argmax())
        elif kind == "top_k":
            assert first["prediction"]["indices"] == list(np.argsort(-expected)[:2])
        else:
            assert sum(first["prediction"]) == pytest.approx(1.0, abs=1e-5)
    assert kinds == {
        "probabilities": "array<float>",
        "label": "int",
        "top_k": "struct<indices:array<int>,scores:array<float>>",
    }


def _jpeg(seed: int) -> bytes:
    out = io.BytesIO()
    PILImage.fromarray(np.random.default_rng(seed).integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


class TinyCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 2, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.conv(image).mean(dim=(2, 3))


def test_poisoned_rows_get_nulls_and_reasons_with_null_and_one_clear_error_with_fail(spark, tmp_path):
    x = np.random.default_rng(3).standard_normal((400, 8)).astype(np.float32)
    x[11, 0] = 999  # the model raises
    x[222, 0] = 555  # the output is infinite
    values = [list(map(float, row)) for row in x]
    values[345] = values[345][:6]  # a wrong-length array
    df = spark.createDataFrame([(i, v) for i, v in enumerate(values)], "id long, features array<float>").repartition(3)
    model = _model(tmp_path).setOnError("null")
    rows = model.transform(df).orderBy("id").collect()
    bad = {r["id"]: r["prediction_error"] for r in rows if r["prediction_error"] is not None}
    assert sorted(bad) == [11, 222, 345], bad
    assert "feature 0 is 999" in bad[11] and "not finite" in bad[222] and "its input cannot be made" in bad[345]
    assert all(rows[i]["prediction"] is None for i in bad)
    good = [i for i in range(400) if i not in bad]
    got = np.array([rows[i]["prediction"] for i in good])
    np.testing.assert_allclose(got, _expected(x[good]), rtol=1e-5, atol=1e-6)

    with pytest.raises(Exception) as caught:
        _model(tmp_path).transform(df).collect()
    message = str(caught.value)
    assert "sparkdl could not score row" in message and "on_error='null'" in message, message[-2000:]

    images = [(i, _jpeg(i)) for i in range(60)]
    images[42] = (42, b"\x89PNG but not really")
    frame = spark.createDataFrame(images, "id long, image binary")
    cnn = sparkdl.TorchModel.from_state(
        TinyCNN().state_dict(), model=TinyCNN, inputs={"image": sparkdl.Image("image", size=(8, 8))}, output_shape=[2]
    )
    scored = cnn.setOnError("null").setBatchSize(16).transform(frame).orderBy("id").collect()
    assert [r["id"] for r in scored if r["prediction_error"]] == [42]
    assert "cannot decode an image" in scored[42]["prediction_error"]
    assert sum(r["prediction"] is not None for r in scored) == 59


def test_a_prediction_column_that_exists_is_refused_before_any_job(spark, features, tmp_path):
    path, _ = features
    df = spark.read.parquet(path).withColumnRenamed("id", "prediction")
    with pytest.raises(sparkdl.ConfigError, match=r"already has column\(s\) \['prediction'\]"):
        _model(tmp_path).transform(df)
    assert not _builds(tmp_path)  # nothing was built on an executor: no task ran
