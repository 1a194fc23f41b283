"""ShardedEmbedding through Spark, on the shared local-cluster session: a TorchEstimator fit whose
table lives on two ranks' parameter servers and comes back whole in the fitted TorchModel (whose
transform uses it), and a bad id that fails the run on the driver naming the table, the id, the
rank and its host; a checkpoint of two workers resumed on one (the rows re-sharded)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparkdl

pytestmark = pytest.mark.spark

ROWS = 1000


def _model_factory():
    """A model class built in a function, so that Spark ships it by value."""

    class ItemValue(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = sparkdl.ShardedEmbedding(ROWS, 1, optimizer="adagrad", lr=0.3, init_std=0.0)
            self.scale = torch.nn.Linear(1, 1, bias=False)
            torch.nn.init.ones_(self.scale.weight)

        def forward(self, item: torch.Tensor) -> torch.Tensor:
            return self.scale(self.items(item)).squeeze(-1)

    return ItemValue


def test_a_fit_trains_the_sharded_table_and_the_fitted_model_holds_all_of_it(spark):
    generator = np.random.default_rng(0)
    hidden = generator.normal(size=ROWS)
    items = np.minimum(generator.zipf(1.3, size=3000) - 1, ROWS - 1)  # skewed, like click logs
    df = spark.createDataFrame([(int(i), float(hidden[i])) for i in items], "item long, label double")
    model = sparkdl.TorchEstimator(
        model=_model_factory(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0),  # the table alone must learn
        loss=torch.nn.functional.mse_loss,
        inputs={"item": "item"},
        label_col="label",
        strategy=sparkdl.ParameterServer(max_staleness=0),
        num_workers=2,
        batch_size=64,
        epochs=2,
        progress=False,
    ).fit(df)
    table = model.module.items.weight
    assert table.shape == (ROWS, 1)
    seen, counts = np.unique(items, return_counts=True)
    unseen = np.setdiff1d(np.arange(ROWS), seen)
    frequent = seen[counts >= 10]  # a row seen once or twice is not learned in 2 epochs, by any optimizer
    error = np.abs(table[frequent, 0].numpy() - hidden[frequent]).mean()
    assert error < 0.1 * np.abs(hidden[frequent]).mean(), error  # it learned the values of the ids it saw
    assert np.all(table[unseen].numpy() == 0)  # init_std=0, never touched
    predictions = model.transform(df.limit(50)).select("item", "prediction").collect()
    np.testing.assert_allclose(
        [r["prediction"] for r in predictions], [float(table[r["item"], 0]) for r in predictions], rtol=1e-6
    )


def test_an_out_of_range_id_fails_the_run_naming_the_table_the_id_the_rank_and_its_host(spark):
    def train_fn(ctx):
        model = ctx.prepare_model(_model_factory()())
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ids = torch.tensor([3, ROWS + 7] if ctx.rank == 1 else [3, 4])
        optimizer.zero_grad()
        model(ids).sum().backward()
        optimizer.step()
        return ctx.final_module(model)

    with pytest.raises(sparkdl.DataError) as info:
        sparkdl.run(train_fn, num_workers=2, strategy=sparkdl.ParameterServer(max_staleness=0), progress=False)
    assert isinstance(info.value, sparkdl.TrainingError)
    failure = next(f for f in info.value.failures if f.category == "DataError")
    assert failure.rank == 1 and failure.host, failure
    assert f"ShardedEmbedding 'items' (table 0, {ROWS} rows): id {ROWS + 7} is out of range [0, {ROWS})" in str(
        info.value
    )
    assert failure.host.split(" ")[0] in str(info.value)  # the driver's message names where it ran


def test_a_checkpoint_of_two_workers_resumes_on_one_with_every_trained_row(spark, tmp_path):
    saved_rows = str(tmp_path / "rows.pt")

    def loop(ctx):
        model = ctx.prepare_model(_model_factory()())
        optimizer = ctx.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        if ctx.load_checkpoint() is not None:
            return {"rows": model.items.rows(torch.arange(ROWS)), "resumed_from": ctx.resumed_from}
        generator = torch.Generator().manual_seed(ctx.rank)
        for _ in range(4):
            ids = torch.randint(0, ROWS // 4, (16,), generator=generator)
            optimizer.zero_grad()
            (model(ids) - 1.0).pow(2).mean().backward()
            optimizer.step()
        ctx.save_checkpoint({"steps": 4}, step=4)
        rows = model.items.rows(torch.arange(ROWS))
        if ctx.rank == 0:
            torch.save(rows, saved_rows)
        torch.distributed.barrier()  # no server stops while the other rank still reads from it
        raise RuntimeError("stopped after the checkpoint, to resume it on one worker")

    def run(num_workers):
        return sparkdl.run(
            loop,
            num_workers=num_workers,
            strategy=sparkdl.ParameterServer(max_staleness=0),
            spark=spark,
            progress=False,
            checkpoint_dir=str(tmp_path / "ckpt"),
            checkpoint_async=False,
        )

    with pytest.raises(sparkdl.TrainingError, match="stopped after the checkpoint"):
        run(2)
    rows = torch.load(saved_rows)
    assert bool((rows[: ROWS // 4] != 0).any())  # init_std=0: the touched rows moved
    resumed = run(1)
    assert resumed["resumed_from"] == 2
    assert torch.equal(resumed["rows"], rows)  # every row, trained or not, exactly
