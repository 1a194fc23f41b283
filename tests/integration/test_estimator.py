"""TorchEstimator / TorchModel on a real local-cluster: accuracy, progress, transform, persistence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparkdl
from sparkdl.data import cache
from tests.models import accuracy, digits_mlp

pytestmark = pytest.mark.spark


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def fitted(spark, digits_df):
    """One 10-epoch fit shared by the tests below; records what the progress channel delivered."""
    seen = []

    def on_progress(record):
        # Recorded with the number of Spark jobs still running: proves it arrived live.
        seen.append((record, list(spark.sparkContext.statusTracker().getActiveJobsIds())))

    estimator = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=_sgd,
        loss=torch.nn.functional.cross_entropy,
        feature_cols=["features"],
        label_col="label",
        strategy=sparkdl.AllReduce(),
        num_workers=2,
        batch_size=32,
        epochs=10,
        progress=on_progress,
    )
    model = estimator.fit(digits_df)
    return estimator, model, seen


@pytest.mark.smoke  # scripts/test runs it on every stack
def test_fit_reaches_good_accuracy(fitted, digits_split):
    _, model, _ = fitted
    _, (test_x, test_y) = digits_split
    assert accuracy(model.module, test_x, test_y) >= 0.93


def test_history_has_one_record_per_epoch_with_global_counts(fitted):
    _, model, _ = fitted
    history = model.history
    assert [r["epoch"] for r in history] == list(range(1, 11))
    steps = model.run_info["steps_per_epoch"]
    assert steps == 1437 // (2 * 32)
    for record in history:
        assert record["samples"] == steps * 2 * 32
        assert record["seconds"] > 0 and record["samples_per_sec"] > 0
        # DDP allreduces every gradient every step: comm bytes = steps * parameter bytes.
        params = sum(p.numel() for p in model.module.parameters())
        assert record["comm_bytes"] == steps * params * 4
    assert history[-1]["loss"] < history[0]["loss"] / 3


def test_run_info_splits_the_start_up_into_its_phases(fitted):
    _, model, _ = fitted
    info = model.run_info
    phases = info["startup"]
    assert set(phases) == {"prepare", "schedule", "worker_imports", "rendezvous", "first_step"}
    assert phases["prepare"] == info["prepare_seconds"]
    measured = {name: value for name, value in phases.items() if value is not None}
    assert all(value >= 0 for value in measured.values()), phases
    # The phases are the whole start-up, fit called to rank 0's first batch.
    assert sum(measured.values()) == pytest.approx(info["prepare_seconds"] + info["startup_seconds"], abs=1e-6)


def test_progress_arrives_live_while_the_job_runs(fitted):
    _, model, seen = fitted
    assert [r["epoch"] for r, _ in seen] == [r["epoch"] for r in model.history]
    assert all(active for _, active in seen), "an epoch record arrived after the Spark job had ended"
    assert [r["loss"] for r, _ in seen] == pytest.approx([r["loss"] for r in model.history])


@pytest.mark.smoke  # scripts/test runs it on every stack
def test_transform_adds_predictions_computed_on_executors(fitted, digits_test_df, digits_split):
    _, model, _ = fitted
    _, (test_x, test_y) = digits_split
    out = model.transform(digits_test_df)
    assert dict(out.dtypes)["prediction"] == "array<float>"
    rows = out.select("prediction", "label").toPandas()
    predictions = np.stack(rows["prediction"].to_numpy())
    assert predictions.shape == (len(test_y), 10)
    with torch.no_grad():
        expected = model.module(torch.as_tensor(test_x)).double().numpy()
    # Row order of toPandas on this small, single-stage frame follows the input.
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-5)


def test_scalar_output_gives_a_float_column(spark):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], dtype=np.float32)
    df = spark.createDataFrame(
        [(float(a), float(b), float(c), float(t)) for (a, b, c), t in zip(x, y)],
        "a double, b double, c double, y double",
    )

    def regression_loss(output, label):
        return torch.nn.functional.mse_loss(output.squeeze(-1), label)

    model = sparkdl.TorchEstimator(
        model=lambda: torch.nn.Linear(3, 1),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss=regression_loss,
        feature_cols=["a", "b", "c"],  # numeric columns concatenated in order
        label_col="y",
        num_workers=2,
        batch_size=16,
        epochs=15,
        progress=False,
    ).fit(df)
    weights = model.module.weight.detach().numpy().ravel()
    np.testing.assert_allclose(weights, [1.0, -2.0, 0.5], atol=0.05)
    out = model.transform(df)
    assert dict(out.dtypes)["prediction"] == "float"
    pdf = out.toPandas()
    np.testing.assert_allclose(pdf["prediction"], pdf["y"], atol=0.2)


def test_save_load_round_trip(fitted, digits_test_df, tmp_path):
    _, model, _ = fitted
    path = str(tmp_path / "model")
    model.save(path)
    loaded = sparkdl.TorchModel.load(path)
    for key, value in model.module.state_dict().items():
        assert torch.equal(value, loaded.module.state_dict()[key])
    assert loaded.history == model.history
    assert loaded.getFeatureCols() == ["features"]
    a = np.stack(model.transform(digits_test_df).toPandas()["prediction"])
    b = np.stack(loaded.transform(digits_test_df).toPandas()["prediction"])
    np.testing.assert_array_equal(a, b)
    # With the factory given, the pickle is not read at all.
    trusted = sparkdl.TorchModel.load(path, model=digits_mlp)
    assert torch.equal(trusted.module[0].weight, model.module[0].weight)


def test_load_of_missing_model_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no sparkdl model"):
        sparkdl.TorchModel.load(str(tmp_path / "nothing"))


def test_same_dataframe_is_materialized_once(fitted, digits_df):
    estimator, _, _ = fitted
    before = cache.cached_urls()
    again = estimator.copy({estimator.epochs: 1}).fit(digits_df)
    assert cache.cached_urls() == before, "fitting the same DataFrame again wrote a new copy"
    assert again.run_info["dataset"]["url"] in before
    assert len(again.history) == 1


def test_estimator_in_a_pipeline(spark, digits_df, digits_test_df):
    from pyspark.ml import Pipeline, PipelineModel

    estimator = sparkdl.TorchEstimator(
        model=digits_mlp, optimizer=_sgd, num_workers=2, batch_size=64, epochs=3, progress=False
    )
    pipeline_model = Pipeline(stages=[estimator]).fit(digits_df)
    assert isinstance(pipeline_model, PipelineModel)
    out = pipeline_model.transform(digits_test_df).select("prediction", "label").toPandas()
    predicted = np.stack(out["prediction"]).argmax(1)
    assert (predicted == out["label"].to_numpy()).mean() > 0.8


def test_notebook_style_closures_travel_by_value(spark, digits_df, digits_split):
    # A class and a loss defined inside a function are not importable on the executors, exactly
    # like classes in a notebook or __main__: Spark must ship them by value.
    hidden = 48

    class NotebookNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10))

        def forward(self, x):
            return self.body(x)

    smoothing = 0.05

    def smoothed_loss(output, label):
        return torch.nn.functional.cross_entropy(output, label, label_smoothing=smoothing)

    model = sparkdl.TorchEstimator(
        model=NotebookNet, optimizer=_sgd, loss=smoothed_loss, num_workers=2, batch_size=32, epochs=6, progress=False
    ).fit(digits_df)
    _, (test_x, test_y) = digits_split
    assert isinstance(model.module, NotebookNet)
    assert accuracy(model.module, test_x, test_y) >= 0.9


@pytest.mark.parametrize(
    "strategy",
    [sparkdl.AllReduce(), sparkdl.ModelAveraging(sync_every=2), sparkdl.ParameterServer()],
    ids=lambda s: type(s).__name__,
)
def test_a_lone_rank_sends_nothing_and_metrics_are_named_as_on_the_command_line(spark, digits_df, strategy):
    # One worker (what a shrinking relaunch can leave): no peer, so no model-sync bytes. And
    # metrics=["accuracy"] is the CLI's --metric accuracy (one vocabulary).
    model = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=_sgd,
        strategy=strategy,
        num_workers=1,
        batch_size=32,
        epochs=1,
        progress=False,
        validation=0.2,
        metrics=["accuracy"],
    ).fit(digits_df)
    record = model.history[-1]
    assert record["comm_bytes"] == 0 and record["samples"] > 0
    assert 0.0 <= record["val_accuracy"] <= 1.0 and record["val_samples"] > 0
