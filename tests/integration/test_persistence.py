"""Spark ML persistence on the shared local-cluster session, with Spark ML's own writers and
readers: a Pipeline (a Java stage and a TorchEstimator) saved unfitted, loaded and trained, its
PipelineModel saved and loaded; a CrossValidator over sparkdl Params, its CrossValidatorModel
saved and loaded; a model trained by sparkdl.run made a TorchModel by from_state. Every loaded
model predicts what the saved one did on the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparkdl
from sparkdl.tracking import log_model
from tests.models import digits_mlp

pytestmark = pytest.mark.spark


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _predictions(df) -> np.ndarray:
    column = df.select("prediction").toPandas()["prediction"]
    return np.stack(column.to_numpy()) if column.dtype == object else column.to_numpy(dtype=np.float64)


def _assert_same_predictions(before, after, rows) -> None:
    expected, got = _predictions(before.transform(rows)), _predictions(after.transform(rows))
    assert expected.shape == got.shape and len(expected) == rows.count()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_pipeline_and_its_model_save_load_and_predict_the_same(spark, digits_df, digits_test_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.feature import SQLTransformer

    scale = SQLTransformer(statement="SELECT *, transform(features, x -> x * 2.0) AS doubled FROM __THIS__")
    estimator = sparkdl.TorchEstimator(
        model=digits_mlp,
        optimizer=_sgd,
        feature_cols=["doubled"],
        strategy=sparkdl.ModelAveraging(sync_every=2),
        num_workers=2,
        batch_size=64,
        epochs=2,
        progress=False,
    )
    Pipeline(stages=[scale, estimator]).save(str(tmp_path / "pipeline"))
    loaded = Pipeline.load(str(tmp_path / "pipeline"))
    loaded_scale, loaded_estimator = loaded.getStages()
    assert loaded_scale.getStatement() == scale.getStatement()
    assert isinstance(loaded_estimator, sparkdl.TorchEstimator) and loaded_estimator.uid == estimator.uid
    assert loaded_estimator.getFeatureCols() == ["doubled"] and loaded_estimator.settings == estimator.settings

    # The loaded pipeline trains: its estimator kept the factory, the optimizer and the strategy.
    fitted = loaded.fit(digits_df)
    torch_model = fitted.stages[-1]
    assert torch_model.run_info["strategy"]["name"] == "model_averaging" and len(torch_model.history) == 2
    path = str(tmp_path / "pipeline_model")
    fitted.save(path)
    fitted.write().overwrite().save(path)
    back = PipelineModel.load(path)
    assert isinstance(back.stages[-1], sparkdl.TorchModel) and back.stages[-1].uid == torch_model.uid
    _assert_same_predictions(fitted, back, digits_test_df)
    accuracy = (_predictions(back.transform(digits_test_df)).argmax(1) == digits_test_df.toPandas()["label"]).mean()
    assert accuracy > 0.8

    # Each stage's directory is a TorchModel.save directory too.
    (stage_dir,) = [p for p in (tmp_path / "pipeline_model" / "stages").iterdir() if "TorchModel" in p.name]
    alone = sparkdl.TorchModel.load(str(stage_dir))
    assert alone.input_columns["doubled"]["kind"] == "float"
    _assert_same_predictions(torch_model, alone, scale.transform(digits_test_df))


def test_a_path_spark_resolves_off_the_local_disk_is_followed_there(spark, tmp_path):
    """Spark ML writes a Pipeline's own metadata against fs.defaultFS (HDFS on YARN, EMR,
    Dataproc); a stage's files follow it there, or the save stops, before writing, naming the
    URL, when Python cannot open it (here pyarrow has no HDFS client libraries)."""
    model = sparkdl.TorchModel.from_state(digits_mlp().state_dict(), model=digits_mlp, output_shape=[10])
    path = str(tmp_path / "model")
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    default_fs = conf.get("fs.defaultFS")
    conf.set("fs.defaultFS", "hdfs://127.0.0.1:9")  # qualified by Hadoop; nothing connects to it
    try:
        with pytest.raises(sparkdl.ConfigError, match=r"resolves .* to 'hdfs://127\.0\.0\.1:9/.*Python cannot open"):
            model.write().save(path)
    finally:
        conf.set("fs.defaultFS", default_fs)
    assert not (tmp_path / "model").exists()
    model.write().save(path)  # the local default again: written where it was asked
    assert sparkdl.TorchModel.load(path).uid == model.uid


def _regressor() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _mse(output, target):
    return torch.nn.functional.mse_loss(output[:, 0], target)


@pytest.mark.smoke  # a stack's basics: PySpark 3.5's and 4.x's Spark ML writers and readers alike
def test_a_cross_validator_over_sparkdl_params_trains_saves_and_loads(spark, digits_df, digits_test_df, tmp_path):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, CrossValidatorModel, ParamGridBuilder
    from pyspark.sql.functions import col

    data = digits_df.withColumn("target", col("label").cast("double"))
    test = digits_test_df.withColumn("target", col("label").cast("double"))
    estimator = sparkdl.TorchEstimator(
        model=_regressor, optimizer=_sgd, loss=_mse, label_col="target", num_workers=2, epochs=1, progress=False
    )
    grid = ParamGridBuilder().addGrid(estimator.batchSize, [32, 128]).build()
    evaluator = RegressionEvaluator(labelCol="target", metricName="rmse")
    cv = CrossValidator(estimator=estimator, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=7)
    cv.save(str(tmp_path / "cv"))
    assert CrossValidator.load(str(tmp_path / "cv")).getEstimator().uid == estimator.uid

    cv_model = cv.fit(data)
    assert len(cv_model.avgMetrics) == 2 and all(np.isfinite(cv_model.avgMetrics))
    best = cv_model.bestModel
    assert isinstance(best, sparkdl.TorchModel) and best.output_size == 1
    assert best.run_info["batch_size"] == grid[int(np.argmin(cv_model.avgMetrics))][estimator.batchSize]

    path = str(tmp_path / "cv_model")
    cv_model.save(path)
    back = CrossValidatorModel.load(path)
    assert back.avgMetrics == pytest.approx(cv_model.avgMetrics)
    assert [{p.name: v for p, v in m.items()} for m in back.getEstimatorParamMaps()] == [
        {"batchSize": 32},
        {"batchSize": 128},
    ]
    loaded_estimator = back.getEstimator()
    assert loaded_estimator.loss_fn is _mse and loaded_estimator.model_fn is _regressor
    _assert_same_predictions(cv_model, back, test)


def _train_fn(ctx):
    model = ctx.prepare_model(digits_mlp())
    optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for _ in range(2):
        for features, labels in ctx.epoch_batches():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(features), labels).backward()
            optimizer.step()
    return ctx.final_module(model).state_dict()


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


def test_a_model_trained_by_run_becomes_a_torch_model(
    spark, digits_df, digits_test_df, digits_split, tmp_path, mlflow_uri
):
    from pyspark.ml import PipelineModel

    state = sparkdl.run(
        _train_fn, num_workers=2, data=digits_df, feature_cols=["features"], label_col="label", batch_size=64
    )
    model = sparkdl.TorchModel.from_state(state, model=digits_mlp, example=digits_test_df)
    assert model.output_shape == [10] and model.input_columns["features"]["shape"] == [None]
    _, (test_x, test_y) = digits_split
    with torch.no_grad():
        expected = model.module(torch.from_numpy(test_x)).double().numpy()
    predicted = _predictions(model.transform(digits_test_df))
    np.testing.assert_allclose(predicted, expected, rtol=1e-6, atol=1e-6)
    assert (predicted.argmax(1) == test_y).mean() > 0.5  # trained: chance is 0.1

    model.save(str(tmp_path / "model"))
    _assert_same_predictions(model, sparkdl.TorchModel.load(str(tmp_path / "model")), digits_test_df)
    PipelineModel(stages=[model]).save(str(tmp_path / "pipeline_model"))
    _assert_same_predictions(model, PipelineModel.load(str(tmp_path / "pipeline_model")), digits_test_df)

    import mlflow

    info = log_model(model)
    rows = digits_test_df.toPandas()
    np.testing.assert_allclose(mlflow.pyfunc.load_model(info.model_uri).predict(rows), predicted, rtol=1e-6, atol=1e-6)
