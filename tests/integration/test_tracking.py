"""MLflow and TensorBoard tracking of a real fit, read back from a local MLflow file store and from
TensorBoard's event files; the logged MLflow model loaded back as a pyfunc, from the model registry
and as a Spark UDF, each predicting what ``transform`` does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparkdl
from sparkdl.tracking import Tracker
from tests.models import digits_mlp

EPOCHS = 3


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local MLflow file store (MLflow 3 accepts file stores only with the opt-in below)."""
    import mlflow

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)
    yield mlflow.MlflowClient(uri)
    mlflow.set_tracking_uri(None)


@pytest.mark.spark
def test_fit_logs_params_metrics_model_to_mlflow_and_scalars_to_tensorboard(
    spark, digits_df, digits_test_df, tmp_path, mlflow_store
):
    est = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        num_workers=2,
        batch_size=32,
        epochs=EPOCHS,
        progress=False,
        mlflow_experiment="digits-tracking",
        mlflow_registered_model_name="digits-registered",
        tensorboard_dir=str(tmp_path / "tb"),
    )
    model = est.fit(digits_df)

    tracking = model.run_info["tracking"]
    run = mlflow_store.get_run(tracking["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert mlflow_store.get_experiment(run.info.experiment_id).name == "digits-tracking"
    params = run.data.params
    assert params["num_workers"] == "2" and params["epochs"] == str(EPOCHS) and params["batch_size"] == "32"
    assert params["strategy.name"] == "allreduce"
    assert params["model"] == "tests.models:digits_mlp"
    assert run.data.tags["sparkdl.status"] == "succeeded"
    losses = mlflow_store.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in losses) == [(r["epoch"], pytest.approx(r["loss"])) for r in model.history]
    for rank in (0, 1):
        assert [m.step for m in mlflow_store.get_metric_history(run.info.run_id, f"rank{rank}_samples_per_sec")] == [
            1,
            2,
            3,
        ]
    # The model is an MLflow model: its TorchModel directory loads back to the same weights...
    from sparkdl.tracking import load_model

    uri = tracking["mlflow_model_uri"]
    loaded = load_model(uri)
    for name, tensor in model.module.state_dict().items():
        assert torch.equal(tensor, loaded.module.state_dict()[name]), name
    assert loaded.input_columns == model.input_columns
    assert {k: model.input_columns["features"][k] for k in ("kind", "shape")} == {"kind": "float", "shape": [None]}
    # ... a pyfunc with a signature, and a registered version, predicting what transform does.
    import mlflow

    expected = np.stack(model.transform(digits_test_df).select("prediction").toPandas()["prediction"])
    assert tracking["mlflow_registered_model"] == {"name": "digits-registered", "version": 1}
    rows = digits_test_df.toPandas()
    for model_uri in (uri, "models:/digits-registered/1"):
        pyfunc = mlflow.pyfunc.load_model(model_uri)
        assert pyfunc.metadata.signature.inputs.input_names() == ["features"]
        np.testing.assert_allclose(pyfunc.predict(rows), expected, rtol=1e-6, atol=1e-6)
    # ... and a Spark UDF, called with the signature's columns.
    udf = mlflow.pyfunc.spark_udf(spark, "models:/digits-registered/1")
    scored = model.transform(digits_test_df).withColumn("mlflow", udf()).select("prediction", "mlflow").toPandas()
    assert len(scored) == len(rows)
    np.testing.assert_allclose(np.stack(scored["mlflow"]), np.stack(scored["prediction"]), rtol=1e-6, atol=1e-6)

    scalars = _scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["epoch/loss"]] == [1, 2, 3]
    assert [value for _, value in scalars["epoch/loss"]] == pytest.approx([r["loss"] for r in model.history], rel=1e-6)
    assert [step for step, _ in scalars["rank/1/samples_per_sec"]] == [1, 2, 3]
    assert tracking["tensorboard_dir"] == str(tmp_path / "tb")


class _Exploding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x):
        raise ValueError("boom in forward")


@pytest.mark.spark
def test_failed_fit_ends_the_mlflow_run_as_failed(spark, digits_df, mlflow_store):
    est = sparkdl.TorchEstimator(
        model=_Exploding, num_workers=2, batch_size=32, epochs=1, progress=False, mlflow_experiment="digits-failing"
    )
    with pytest.raises(sparkdl.TrainingError, match="boom in forward"):
        est.fit(digits_df)
    experiment = mlflow_store.get_experiment_by_name("digits-failing")
    (run,) = mlflow_store.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["sparkdl.status"] == "failed" and "boom in forward" in run.data.tags["sparkdl.error"]


def test_tracker_logs_each_epoch_once_and_catches_up_from_history(tmp_path):
    """A resumed run may report an epoch twice, and a run returned from a finished checkpoint
    reports none live: the logged scalars are still exactly one per epoch."""
    tracker = Tracker(tensorboard_dir=str(tmp_path / "tb"))
    tracker.start({"epochs": 3, "strategy": {"name": "allreduce"}})
    on_record = tracker.callback(None)
    on_record({"epoch": 1, "loss": 2.0, "rank0_samples_per_sec": 10.0})
    on_record({"epoch": 1, "loss": 2.5})  # a re-reported epoch after a relaunch: ignored
    on_record({"rank": 0, "epoch": 1, "custom": 1.0})  # ctx.report(...) metrics: not an epoch record

    class Finished:
        history = [
            {"epoch": 1, "loss": 2.0},
            {"epoch": 2, "loss": 1.0, "note": "text"},
            {"epoch": 3, "loss": float("nan")},
        ]

    info = tracker.finish(Finished())
    assert info == {"tensorboard_dir": str(tmp_path / "tb")}
    scalars = _scalars(tmp_path / "tb")
    assert scalars["epoch/loss"] == [(1, 2.0), (2, 1.0)]  # NaN is not logged
    assert scalars["rank/0/samples_per_sec"] == [(1, 10.0)]
    assert "epoch/custom" not in scalars and "epoch/note" not in scalars


def test_missing_tracking_package_fails_at_construction(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(sparkdl.ConfigError, match=r"sparkdl-torch\[tracking\]"):
        sparkdl.TorchEstimator(model=digits_mlp, mlflow_experiment="x")
    with pytest.raises(sparkdl.ConfigError, match="non-empty"):
        sparkdl.TorchEstimator(model=digits_mlp, mlflow_experiment=" ")
