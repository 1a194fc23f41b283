"""Fitted ShardedEmbedding tables written sharded (``ParameterServer(tables_dir=...)``) through
Spark, on the shared local-cluster session: the fit writes each rank's rows, the fitted model
scores a DataFrame on the executors from those files, saves them into its directory and loads
from there (the run's files deleted first); a table too large to return whole is refused
before launch, naming the setting."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import sparkdl
from sparkdl.errors import ConfigError

pytestmark = pytest.mark.spark

ROWS = 1000


def _model_factory(rows: int = ROWS):
    """A model class built in a function, so that Spark ships it by value."""

    class ItemValue(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = sparkdl.ShardedEmbedding(rows, 1, optimizer="adagrad", lr=0.3, init_std=0.0)
            self.scale = torch.nn.Linear(1, 1, bias=False)
            torch.nn.init.ones_(self.scale.weight)

        def forward(self, item: torch.Tensor) -> torch.Tensor:
            return self.scale(self.items(item)).squeeze(-1)

    return ItemValue


def _estimator(strategy, rows: int = ROWS) -> sparkdl.TorchEstimator:
    return sparkdl.TorchEstimator(
        model=_model_factory(rows),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),  # the table alone must learn
        loss=torch.nn.functional.mse_loss,
        inputs={"item": "item"},
        label_col="label",
        strategy=strategy,
        num_workers=2,
        batch_size=64,
        epochs=2,
        progress=False,
    )


def _predictions(model, df):
    rows = model.transform(df).select("item", "prediction").orderBy("item").collect()
    return np.array([r["item"] for r in rows]), np.array([r["prediction"] for r in rows])


def test_a_fit_writes_its_table_sharded_and_the_model_scores_saves_and_loads_from_the_files(spark, tmp_path):
    generator = np.random.default_rng(0)
    hidden = generator.normal(size=ROWS)
    items = np.minimum(generator.zipf(1.3, size=3000) - 1, ROWS - 1)
    df = spark.createDataFrame([(int(i), float(hidden[i])) for i in items], "item long, label double")
    tables_dir = tmp_path / "tables"
    model = _estimator(sparkdl.ParameterServer(max_staleness=0, tables_dir=str(tables_dir))).fit(df)

    table = model.module.items
    assert "weight" not in table._buffers and table.table_files is not None  # no table on the driver
    (run,) = os.listdir(tables_dir)
    table_dir = tables_dir / run / "table-0"
    assert sorted(os.listdir(table_dir)) == [
        "manifest.json",
        "part-00000.ids.npy",
        "part-00000.values.npy",
        "part-00001.ids.npy",
        "part-00001.values.npy",
    ]
    seen, counts = np.unique(items, return_counts=True)
    stored = np.concatenate([np.load(table_dir / f"part-0000{r}.ids.npy") for r in (0, 1)])
    assert np.array_equal(np.sort(stored), seen)  # the touched rows, each in one part
    model.module.eval()
    with torch.no_grad():
        values = table(torch.arange(ROWS)).squeeze(1).numpy()
    frequent = seen[counts >= 10]
    assert np.abs(values[frequent] - hidden[frequent]).mean() < 0.1 * np.abs(hidden[frequent]).mean()
    assert np.all(values[np.setdiff1d(np.arange(ROWS), seen)] == 0)  # init_std=0, never touched

    probe = spark.createDataFrame([(i,) for i in range(0, ROWS, 7)], "item long").repartition(2)
    ids, predicted = _predictions(model, probe)  # scored on the executors, from the files
    np.testing.assert_allclose(predicted, values[ids], rtol=1e-6)

    saved = tmp_path / "model"
    model.save(str(saved))
    assert sorted(os.listdir(saved / "tables" / "table-0")) == sorted(os.listdir(table_dir))
    shutil.rmtree(tables_dir)  # the saved model holds its table: the run's files may go
    loaded = sparkdl.TorchModel.load(str(saved))
    assert loaded.module.items.table_files.url.endswith("/model/tables/table-0")
    loaded_ids, loaded_predictions = _predictions(loaded, probe)
    assert np.array_equal(loaded_ids, ids) and np.array_equal(loaded_predictions, predicted)


def test_a_table_too_large_to_return_whole_is_refused_before_launch(spark):
    df = spark.createDataFrame([(i, 1.0) for i in range(256)], "item long, label double").repartition(2)
    rows = 50_000_000  # 200 MB of float32 rows: over an eighth of the shared session's 1 GB heaps
    with pytest.raises(ConfigError) as info:
        _estimator(sparkdl.ParameterServer(), rows).fit(df)
    message = str(info.value)
    assert "'items' (50,000,000 x 1)" in message and "ParameterServer(tables_dir=" in message
    assert "spark.driver.memory=" in message or "spark.executor.memory=" in message, message
