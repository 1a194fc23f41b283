"""Driver-side checks before launch: what would fail every rank the same way is named at once."""

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sparkdl._driver.preflight import check_loss, check_optimizer
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.spec import DataSpec
from sparkdl.errors import ConfigError


@pytest.fixture()
def dataset(tmp_path):
    features = np.arange(80, dtype=np.float32).reshape(40, 2)
    pq.write_table(
        pa.table({"features": pa.array(list(features), type=pa.list_(pa.float32())), "label": np.arange(40) % 5}),
        tmp_path / "part-0.parquet",
    )
    return inspect_dataset(str(tmp_path), ["features"], "label")


def test_an_optimizer_factory_that_returns_something_else_is_named():
    def optimizer(params):
        return {"lr": 0.1}

    with pytest.raises(ConfigError, match="optimizer=.*optimizer returned dict, not a torch.optim.Optimizer"):
        check_optimizer(optimizer, torch.nn.Linear(2, 3))
    check_optimizer(lambda p: torch.optim.SGD(p, lr=0.1), torch.nn.Linear(2, 3))


def test_a_loss_that_does_not_fit_the_output_is_named_with_shapes_and_a_hint(dataset):
    # 3 outputs, labels 0..4: cross entropy's target is out of bounds on every rank.
    with pytest.raises(ConfigError) as info:
        check_loss(torch.nn.Linear(2, 3), torch.nn.functional.cross_entropy, dataset, DataSpec(batch_size=64))
    message = str(info.value)
    assert "loss(output [32, 3], label [32]) raised IndexError: Target" in message and "out of bounds" in message
    assert "does the model's output size match the number of classes?" in message
    check_loss(torch.nn.Linear(2, 5), torch.nn.functional.cross_entropy, dataset, DataSpec(batch_size=8))


def test_a_loss_that_is_not_a_scalar_is_refused(dataset):
    def per_row(output, label):
        return torch.nn.functional.cross_entropy(output, label, reduction="none")

    with pytest.raises(ConfigError, match="returned \\[8\\] for a batch of 8 rows; it must return one number"):
        check_loss(torch.nn.Linear(2, 5), per_row, dataset, DataSpec(batch_size=8))


def test_a_model_the_driver_cannot_run_is_left_to_the_executors(dataset, caplog):
    class GpuOnly(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("needs CUDA")

    with caplog.at_level(logging.INFO, logger="sparkdl.preflight"):
        check_loss(GpuOnly(), torch.nn.functional.cross_entropy, dataset, DataSpec(batch_size=8))
    assert "could not run the model on the driver's CPU" in caplog.text and "needs CUDA" in caplog.text


def test_the_probe_leaves_the_module_in_train_mode_and_its_weights_alone(dataset):
    module = torch.nn.Sequential(torch.nn.Linear(2, 5))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    check_loss(module, torch.nn.functional.cross_entropy, dataset, DataSpec(batch_size=8))
    assert module.training and all(torch.equal(before[k], v) for k, v in module.state_dict().items())
