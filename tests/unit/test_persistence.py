"""Saving the estimator and model without Spark: Spark ML's stage line, the estimator's pickled
arguments, TorchModel.from_state, the MLflow flavor on a local MLflow file store (no Spark:
PipelineModel, CrossValidatorModel and spark_udf are in tests/integration/test_persistence.py and
test_tracking.py)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pandas as pd
import pytest
import torch

import sparkdl
from sparkdl._persistence.stage import METADATA_FILE, choose_url, restore_params, spark_resolved, stage_metadata
from sparkdl.tracking import load_model, log_model
from tests.models import digits_mlp


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _rows(n: int = 6, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"features": [rng.random(64).tolist() for _ in range(n)]})


def _model() -> sparkdl.TorchModel:
    torch.manual_seed(3)
    return sparkdl.TorchModel.from_state(digits_mlp().state_dict(), model=digits_mlp, example=_rows())


def test_the_stage_line_is_what_spark_ml_parses_and_restores_uid_and_params():
    estimator = sparkdl.TorchEstimator(model=digits_mlp, batch_size=16, progress=False).copy({})
    estimator._set(epochs=4)
    line = stage_metadata(estimator)
    assert "\n" not in line  # Spark reads the first line of metadata/part-00000
    document = json.loads(line)
    assert document["class"] == "sparkdl.estimator.TorchEstimator" and document["uid"] == estimator.uid
    assert document["paramMap"]["epochs"] == 4 and document["paramMap"]["featureCols"] == ["features"]
    other = sparkdl.TorchEstimator(model=digits_mlp, progress=False)
    document["paramMap"]["notAParamAnyMore"] = 1  # a param a later sparkdl dropped: skipped
    restore_params(other, document)
    assert other.uid == estimator.uid and other.getOrDefault(other.epochs) == 4
    assert other.getOrDefault(other.batchSize) == 16
    assert all(param.parent == estimator.uid for param in other.params)


def test_paths_spark_would_qualify_off_the_local_disk_go_there():
    assert choose_url("/models/x", None) == "/models/x"  # no SparkContext to ask
    assert choose_url("/models/x", "file:/models/x") == "/models/x"
    assert choose_url("/models/x", "hdfs://nn:8020/models/x") == "hdfs://nn:8020/models/x"
    assert spark_resolved("s3://bucket/x") == "s3://bucket/x"
    assert spark_resolved("relative/dir") == "relative/dir"  # no SparkContext in this process
    with pytest.raises(sparkdl.ConfigError, match="non-empty"):
        spark_resolved("")


def test_an_estimator_saves_and_loads_with_every_argument_and_param(tmp_path):
    smoothing = 0.1
    estimator = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=_sgd,
        loss=lambda out, y: torch.nn.functional.cross_entropy(out, y, label_smoothing=smoothing),
        strategy=sparkdl.ModelAveraging(sync_every=4),
        checkpoint_dir=str(tmp_path / "ckpt"),
        validation=0.2,
        metrics=["accuracy"],
        epochs=3,
        progress=False,
    ).copy({})
    estimator._set(batchSize=8)
    path = str(tmp_path / "estimator")
    estimator.save(path)
    assert {"estimator.pkl", "estimator.json", "metadata"} <= {p.name for p in (tmp_path / "estimator").iterdir()}
    loaded = sparkdl.TorchEstimator.load(path)
    assert loaded.uid == estimator.uid and loaded.getOrDefault(loaded.batchSize) == 8
    assert loaded.getOrDefault(loaded.epochs) == 3
    # The same functions: by reference, or by value once their module is registered for pickling by
    # value (the CLI registers a --model module found in the working directory: tests.models, in a suite).
    assert (loaded.model_fn.__qualname__, loaded.optimizer_fn.__qualname__) == ("digits_mlp", "_sgd")
    assert [p.shape for p in loaded.model_fn().parameters()] == [p.shape for p in digits_mlp().parameters()]
    assert loaded.optimizer_fn(torch.nn.Linear(1, 1).parameters()).defaults["lr"] == 0.05
    assert loaded.settings == estimator.settings  # strategy, checkpoints, validation, metrics...
    out, label = torch.randn(4, 10), torch.tensor([0, 1, 2, 3])
    assert torch.equal(loaded.loss_fn(out, label), estimator.loss_fn(out, label))  # the lambda, by value
    assert sparkdl.TorchEstimator.read().load(path).uid == estimator.uid

    with pytest.raises(FileExistsError, match=r"write\(\)\.overwrite\(\)"):
        estimator.write().save(path)
    (tmp_path / "estimator" / "stale").write_text("left by something else")
    estimator.copy({estimator.epochs: 5}).write().overwrite().save(path)
    assert not (tmp_path / "estimator" / "stale").exists()
    assert sparkdl.TorchEstimator.load(path).getOrDefault(estimator.epochs) == 5


def test_an_argument_that_cannot_be_saved_is_named(tmp_path):
    lock = threading.Lock()

    def transform(features, labels):  # holds a lock: nothing pickles it
        with lock:
            return features, labels

    estimator = sparkdl.TorchEstimator(model=digits_mlp, transform_fn=transform, progress=False)
    with pytest.raises(sparkdl.ConfigError, match="transform_fn="):
        estimator.save(str(tmp_path / "e"))
    with pytest.raises(FileNotFoundError, match="estimator.pkl"):
        sparkdl.TorchEstimator.load(str(tmp_path / "nothing"))


def test_from_state_saves_loads_and_predicts_as_the_module(tmp_path):
    model = _model()
    assert model.output_shape == [10] and model.getFeatureCols() == ["features"]
    assert model.input_columns == {"features": {"kind": "float", "shape": [None], "type": "array of float64"}}
    path = str(tmp_path / "model")
    model.save(path)
    assert (tmp_path / "model" / METADATA_FILE).is_file()
    loaded = sparkdl.TorchModel.load(path)
    assert loaded.uid == model.uid and loaded.input_columns == model.input_columns
    for name, tensor in model.module.state_dict().items():
        assert torch.equal(tensor, loaded.module.state_dict()[name]), name
    # A directory saved before sparkdl wrote Spark ML's line still loads, with a new uid.
    (tmp_path / "model" / METADATA_FILE).unlink()
    assert sparkdl.TorchModel.load(path).uid != model.uid
    with pytest.raises(FileExistsError):
        model.write().save(path)
    model.save(path)  # save() replaces, as it always did


def test_from_state_refuses_what_does_not_fit():
    state = digits_mlp().state_dict()
    with pytest.raises(sparkdl.ConfigError, match="output_shape= .* or example="):
        sparkdl.TorchModel.from_state(state, model=digits_mlp)
    wrapped = {f"module.{k}": v for k, v in state.items()}  # a DDP module's names
    with pytest.raises(sparkdl.ConfigError, match="does not fit model"):
        sparkdl.TorchModel.from_state(wrapped, model=digits_mlp, output_shape=[10])
    with pytest.raises(sparkdl.ConfigError, match="state_dict"):
        sparkdl.TorchModel.from_state([1, 2], model=digits_mlp, output_shape=[10])
    with pytest.raises(sparkdl.ConfigError, match="no column"):
        sparkdl.TorchModel.from_state(state, model=digits_mlp, example=pd.DataFrame({"x": [1.0]}))
    module = digits_mlp()
    built = sparkdl.TorchModel.from_state(module, model=digits_mlp, output_shape=[10])
    assert built.input_columns is None and built.output_size == 10


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    """A local MLflow file store (MLflow 3 accepts one only with the opt-in below)."""
    import mlflow

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("sparkdl-tests")  # in this store, whatever experiment was active before
    yield uri
    mlflow.set_tracking_uri(None)


def test_an_mlflow_model_predicts_as_the_module_and_registers(mlflow_uri):
    import mlflow

    model = _model()
    info = log_model(model, registered_model_name="digits-unit")
    assert info.registered_model_version is not None
    assert info.signature.inputs.input_names() == ["features"]
    assert info.signature.outputs.to_dict() == [
        {"type": "array", "items": {"type": "double"}, "name": "prediction", "required": True}
    ]
    rows = _rows(5, seed=1)
    expected = model.module(torch.tensor(np.stack(rows["features"]), dtype=torch.float32)).double().detach().numpy()
    for uri in (info.model_uri, f"models:/digits-unit/{info.registered_model_version}"):
        predicted = mlflow.pyfunc.load_model(uri).predict(rows)
        np.testing.assert_allclose(predicted, expected, rtol=1e-6, atol=1e-7)
    back = load_model("models:/digits-unit/1")
    assert back.uid == model.uid and back.output_shape == [10]


def _regressor() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_a_one_output_model_predicts_a_series_over_scalar_and_integer_columns(mlflow_uri):
    import mlflow

    rows = pd.DataFrame({"x": [0.5, 1.5, 2.5], "n": np.array([1, 2, 3], dtype=np.int64), "v": [[1.0], [2.0], [3.0]]})
    model = sparkdl.TorchModel.from_state(
        _regressor().state_dict(), model=_regressor, feature_cols=["x", "n", "v"], example=rows, prediction_col="y"
    )
    assert model.output_size == 1
    info = log_model(model)
    assert info.signature.inputs.to_dict() == [
        {"type": "double", "name": "x", "required": True},
        {"type": "long", "name": "n", "required": True},
        {"type": "array", "items": {"type": "double"}, "name": "v", "required": True},
    ]
    predicted = mlflow.pyfunc.load_model(info.model_uri).predict(rows)
    assert isinstance(predicted, pd.Series) and predicted.name == "y"
    features = torch.tensor(np.column_stack([rows["x"], rows["n"], np.stack(rows["v"])[:, 0]]), dtype=torch.float32)
    np.testing.assert_allclose(predicted.to_numpy(), model.module(features)[:, 0].double().detach().numpy(), rtol=1e-6)


def test_a_model_without_recorded_columns_needs_an_example(mlflow_uri):
    model = sparkdl.TorchModel.from_state(digits_mlp().state_dict(), model=digits_mlp, output_shape=[10])
    with pytest.raises(sparkdl.ConfigError, match="example="):
        log_model(model)
    info = log_model(model, example=_rows(2))
    assert info.signature.inputs.input_names() == ["features"]
    assert model.input_columns is None  # the example did not change the caller's model


def test_image_inputs_as_bytes_or_spark_image_structs_predict_through_mlflow(mlflow_uri):
    import mlflow

    from tests.models import DigitsCNN, png_bytes

    rng = np.random.default_rng(2)
    pixels = [rng.integers(0, 256, size=(8, 8), dtype=np.uint8) for _ in range(4)]
    expected_input = torch.tensor(np.stack(pixels)[:, None] / 255.0, dtype=torch.float32)
    state = DigitsCNN().state_dict()
    encoded = pd.DataFrame({"png": [png_bytes(p) for p in pixels]})
    structs = pd.DataFrame(
        {
            "img": [
                {"origin": f"mem:{i}", "height": 8, "width": 8, "nChannels": 1, "mode": 0, "data": p.tobytes()}
                for i, p in enumerate(pixels)
            ]
        }
    )
    for column, rows in (("png", encoded), ("img", structs)):
        model = sparkdl.TorchModel.from_state(
            state, model=DigitsCNN, inputs={"image": sparkdl.Image(column, size=(8, 8), channels=1)}, example=rows
        )
        info = log_model(model)
        kind = {"png": "binary", "img": "object"}[column]
        assert info.signature.inputs.to_dict()[0]["type"] == kind
        predicted = mlflow.pyfunc.load_model(info.model_uri).predict(rows)
        expected = model.module(image=expected_input).double().detach().numpy()
        np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-6)


def test_registering_needs_an_experiment_and_a_name():
    with pytest.raises(sparkdl.ConfigError, match="mlflow_registered_model_name=.*needs mlflow_experiment="):
        sparkdl.TorchEstimator(model=digits_mlp, mlflow_registered_model_name="digits")
    with pytest.raises(sparkdl.ConfigError, match="non-empty"):
        sparkdl.TorchEstimator(model=digits_mlp, mlflow_experiment="e", mlflow_registered_model_name="")
