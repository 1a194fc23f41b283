"""The scoring engine on real Arrow batches and real torch models, outside Spark (a task's
TaskContext is None here: the CPU, this process's threads): outputs, bad rows, bisection,
out-of-memory splits, the per-worker model cache."""

from __future__ import annotations

import io

import cloudpickle
import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image as PILImage

from sparkdl.data.columns import ColumnInfo
from sparkdl.data.inputs import Image
from sparkdl.data.plan import InputPlan
from sparkdl.errors import ConfigError, DataError
from sparkdl.inference import model_cache
from sparkdl.inference.api import inference_options
from sparkdl.inference.model_source import ModelRef, weights_bytes, weights_key
from sparkdl.inference.outputs import Head
from sparkdl.inference.scorer import Scorer, ScoringError

FEATURES = 8
CALLS = {"forward": 0, "built": 0}


class Poisoned(torch.nn.Module):
    """An MLP that raises on a row whose first feature is 999, gives infinity where it is 555,
    and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        CALLS["built"] += 1
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["forward"] += 1
        if (x[:, 0] == 999).any():
            raise ValueError("feature 0 is 999")
        out = self.net(x)
        return torch.where((x[:, :1] == 555), torch.full_like(out, float("inf")), out)


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Linear(FEATURES, 4)

    def forward(self, x: torch.Tensor):
        h = self.body(x)
        return {"score": h.sum(dim=1), "classes": h}


class FitsSixtyFourRows(torch.nn.Module):
    """A model whose 'device' holds at most 64 rows at once."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(FEATURES, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.lin(x)


class Pixels(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).mean(dim=(2, 3))


def _ref(factory, key: str = "") -> ModelRef:
    module = factory()
    state = weights_bytes(module)
    return ModelRef(key or weights_key(state) + factory.__name__, len(state), cloudpickle.dumps(factory), inline=state)


def _scorer(factory, heads, plan=None, infos=None, **options) -> Scorer:
    plan = plan or InputPlan.from_feature_cols(["features"], None).without_label()
    infos = infos or {"features": ColumnInfo("features", "float", (None,), type_name="array<float>")}
    return Scorer(_ref(factory), plan, infos, heads, inference_options(**options), "prediction", "the test rows")


def _rows(x: np.ndarray, ids=None) -> pa.RecordBatch:
    ids = np.arange(len(x)) if ids is None else ids
    return pa.RecordBatch.from_arrays(
        [pa.array(ids), pa.array([list(map(float, row)) for row in x], pa.list_(pa.float32()))],
        names=["id", "features"],
    )


def _expected(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return Poisoned().net(torch.from_numpy(x.astype(np.float32))).numpy()


def test_raw_probabilities_label_and_top_k_match_the_module():
    x = np.random.default_rng(0).standard_normal((300, FEATURES)).astype(np.float32)
    expected = _expected(x)
    for kind, check in (
        ("raw", lambda col: np.testing.assert_allclose(np.array(col.to_pylist()), expected, rtol=1e-5, atol=1e-6)),
        (
            "probabilities",
            lambda col: np.testing.assert_allclose(
                np.array(col.to_pylist()), torch.softmax(torch.from_numpy(expected), 1).numpy(), rtol=1e-5, atol=1e-6
            ),
        ),
        ("label", lambda col: np.testing.assert_array_equal(col.to_numpy(), expected.argmax(1))),
        (
            "top_k",
            lambda col: np.testing.assert_array_equal(
                np.array([r["indices"] for r in col.to_pylist()]), np.argsort(-expected, 1)[:, :2]
            ),
        ),
    ):
        scorer = _scorer(Poisoned, [Head("", "prediction", 3, kind)], output=kind, top_k=2, batch_size=64)
        out = list(scorer(iter([_rows(x[:150]), _rows(x[150:], np.arange(150, 300))])))
        table = pa.Table.from_batches(out)
        assert table.column("id").to_pylist() == list(range(300))
        assert table.schema.field("prediction").type == Head("", "prediction", 3, kind).arrow_type(2)
        check(table.column("prediction").combine_chunks())


def test_bad_rows_get_nulls_and_reasons_found_by_bisection_and_good_rows_their_outputs():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1024, FEATURES)).astype(np.float32)
    x[100, 0] = 999  # makes the model raise
    x[700, 0] = 555  # a non-finite output
    x[800, 3] = np.nan  # a NaN input
    features = [list(map(float, row)) for row in x]
    features[400] = features[400][:5]  # a wrong-length array
    batch = pa.RecordBatch.from_arrays(
        [pa.array(np.arange(1024)), pa.array(features, pa.list_(pa.float32()))], names=["id", "features"]
    )
    # optimize="off": what is counted below is the bisection's calls, not a graph's checks and timing.
    scorer = _scorer(Poisoned, [Head("", "prediction", 3, "raw")], on_error="null", batch_size=1024, optimize="off")
    CALLS["forward"] = 0
    table = pa.Table.from_batches(list(scorer(iter([batch]))))
    errors = table.column("prediction_error").to_pylist()
    bad = [i for i, e in enumerate(errors) if e is not None]
    assert bad == [100, 400, 700, 800]
    assert "the model raised ValueError: feature 0 is 999" in errors[100]
    assert "the model raised" in errors[400] and "its input cannot be made" in errors[400], errors[400]
    assert "features" in errors[400]
    assert "not finite" in errors[700]
    assert "its input cannot be made" in errors[800] and "NaN" in errors[800]
    predictions = table.column("prediction").to_pylist()
    assert [predictions[i] for i in bad] == [None] * 4
    good = [i for i in range(1024) if i not in bad]
    np.testing.assert_allclose(np.array([predictions[i] for i in good]), _expected(x[good]), rtol=1e-5, atol=1e-6)
    # Bisection: a few calls per bad row (log2(1024) levels), not one per row.
    assert CALLS["forward"] <= 4 * 2 * 10 + 4, CALLS["forward"]


def test_on_error_fail_names_the_row_and_the_way_out():
    x = np.random.default_rng(2).standard_normal((200, FEATURES)).astype(np.float32)
    x[137, 0] = 999
    scorer = _scorer(Poisoned, [Head("", "prediction", 3, "raw")], batch_size=64)
    with pytest.raises(ScoringError) as caught:
        list(scorer(iter([_rows(x[:100]), _rows(x[100:])])))
    message = str(caught.value)
    assert "row 137 (counting from 0) of partition 0 of the test rows" in message
    assert "feature 0 is 999" in message and "on_error='null'" in message


def test_a_model_that_fails_every_row_the_same_way_fails_the_task_even_with_null():
    x = np.full((32, FEATURES), 999.0, dtype=np.float32)
    scorer = _scorer(Poisoned, [Head("", "prediction", 3, "raw")], on_error="null")
    with pytest.raises(DataError, match="every row of a batch of 32 .* makes the model fail the same way"):
        list(scorer(iter([_rows(x)])))


def test_a_batch_that_runs_out_of_memory_is_split_and_every_row_scored():
    x = np.random.default_rng(3).standard_normal((1000, FEATURES)).astype(np.float32)
    scorer = _scorer(FitsSixtyFourRows, [Head("", "prediction", 2, "raw")], batch_size=512)
    table = pa.Table.from_batches(list(scorer(iter([_rows(x)]))))
    module = scorer.ref.build()
    with torch.inference_mode():
        want = module.lin(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.array(table.column("prediction").to_pylist()), want, rtol=1e-5, atol=1e-6)


def test_one_row_that_does_not_fit_is_a_config_error_not_a_null():
    class NeverFits(FitsSixtyFourRows):
        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory")

    scorer = _scorer(NeverFits, [Head("", "prediction", 2, "raw")], on_error="null", batch_size=4)
    with pytest.raises(ConfigError, match="one row does not fit in the memory of cpu"):
        list(scorer(iter([_rows(np.zeros((4, FEATURES), np.float32))])))


def test_several_heads_get_a_column_each():
    x = np.random.default_rng(4).standard_normal((50, FEATURES)).astype(np.float32)
    heads = [Head("score", "prediction_score", 1, "raw"), Head("classes", "prediction_classes", 4, "label")]
    table = pa.Table.from_batches(list(_scorer(TwoHeads, heads, output={"classes": "label"})(iter([_rows(x)]))))
    with torch.inference_mode():
        h = TwoHeads().body(torch.from_numpy(x)).numpy()
    assert table.schema.field("prediction_score").type == pa.float32()
    np.testing.assert_allclose(table.column("prediction_score").to_numpy(), h.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(table.column("prediction_classes").to_numpy(), h.argmax(1))


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (12, 12, 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def test_undecodable_image_bytes_get_a_null_and_the_decoder_reason():
    images = [_jpeg(i) for i in range(40)]
    images[17] = b"not an image"
    plan = InputPlan.from_inputs({"x": Image(column="image", size=(12, 12))}, None).without_label()
    infos = {"image": ColumnInfo("image", "binary", (), type_name="binary")}
    scorer = _scorer(Pixels, [Head("", "prediction", 2, "raw")], plan, infos, on_error="null", batch_size=16)
    batch = pa.RecordBatch.from_arrays([pa.array(images, pa.binary())], names=["image"])
    table = pa.Table.from_batches(list(scorer(iter([batch]))))
    errors = table.column("prediction_error").to_pylist()
    assert [i for i, e in enumerate(errors) if e] == [17]
    assert "cannot decode an image" in errors[17]
    assert table.column("prediction").null_count == 1


def test_a_worker_builds_a_model_once_per_identity_and_never_serves_changed_weights(monkeypatch):
    monkeypatch.setattr(model_cache, "_models", type(model_cache._models)())
    x = np.random.default_rng(5).standard_normal((20, FEATURES)).astype(np.float32)
    CALLS["built"] = 0
    first = _scorer(Poisoned, [Head("", "prediction", 3, "raw")])
    for _ in range(3):  # three tasks of the same model in this worker
        list(first(iter([_rows(x)])))
    assert CALLS["built"] == 2  # the ref's own build in _ref, then one in the cache

    changed = Poisoned()
    with torch.no_grad():
        changed.net[0].bias.add_(1.0)
    state = weights_bytes(changed)
    ref = ModelRef(weights_key(state), len(state), cloudpickle.dumps(Poisoned), inline=state)
    second = Scorer(ref, first.plan, first.infos, first.heads, first.options, "prediction", "rows")
    out = pa.Table.from_batches(list(second(iter([_rows(x)]))))
    with torch.inference_mode():
        want = changed.net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.array(out.column("prediction").to_pylist()), want, rtol=1e-5, atol=1e-6)
    assert len(model_cache.cached_keys()) == 2


def test_the_cache_keeps_within_its_budget_and_always_the_model_in_use(monkeypatch):
    monkeypatch.setattr(model_cache, "_models", type(model_cache._models)())
    monkeypatch.setenv("SPARKDL_INFERENCE_CACHE_MB", "0.001")
    for key in ("a", "b", "c"):
        model_cache.cached_model(key, torch.device("cpu"), Poisoned)
    assert model_cache.cached_keys() == (("c", "cpu"),)


def test_bad_options_are_refused_naming_the_argument():
    with pytest.raises(ConfigError, match="batch_size=0"):
        inference_options(batch_size=0)
    with pytest.raises(ConfigError, match="output='logits'"):
        inference_options(output="logits")
    with pytest.raises(ConfigError, match="on_error='skip'"):
        inference_options(on_error="skip")
    with pytest.raises(ConfigError, match="unknown scoring option"):
        inference_options(batchsize=4)
    with pytest.raises(ConfigError, match="precision='fp8'"):
        inference_options(precision="fp8")
