"""Settings in one place: the estimator and ``sparkdl.run`` build the same validated configs.

No Spark: ``TorchEstimator.__init__`` and ``RunSettings.from_arguments`` run on the driver alone,
and ``sparkdl.run`` fails on its arguments before it looks for a SparkSession.
"""

import dataclasses

import pytest
import torch

import sparkdl
from sparkdl._driver.settings import DataSettings, RunSettings
from sparkdl.errors import ConfigError

COMMON = dict(
    num_workers=3,
    batch_size=16,
    shuffle=False,
    seed=7,
    reader="arrow",
    validation=0.25,
    timeout_s=42.0,
    precision="bf16-mixed",
    max_failures=2,
    watchdog_timeout_s=30.0,
    checkpoint_dir="/tmp/sparkdl-settings",
    keep_checkpoints=5,
    checkpoint_async=False,
    resume=False,
    decode_threads=2,
    feature_cols=["a", "b"],
    label_col="y",
    slot_wait_s=120.0,
)


def _model():
    return torch.nn.Linear(2, 2)


def test_estimator_and_run_build_the_same_configs_from_the_same_arguments():
    estimator = sparkdl.TorchEstimator(model=_model, strategy=sparkdl.ModelAveraging(sync_every=4), **COMMON)
    direct = RunSettings.from_arguments({**COMMON, "strategy": sparkdl.ModelAveraging(sync_every=4)}, with_data=True)
    assert estimator.settings == direct
    assert (
        direct.launch.num_workers == 3 and direct.launch.precision == "bf16-mixed" and direct.launch.max_failures == 2
    )
    assert direct.launch.slot_wait_s == 120.0
    assert (direct.checkpoint.keep, direct.checkpoint.resume, direct.checkpoint.every_steps) == (5, False, None)
    assert direct.checkpoint.async_write is False
    assert (
        direct.data.spec.holdout == 0.25 and direct.data.spec.batch_size == 16 and direct.data.spec.decode_threads == 2
    )
    assert direct.data.plan.columns == ["a", "b", "y"]


def test_default_strategy_is_allreduce():
    assert isinstance(RunSettings.from_arguments({"num_workers": 1}, with_data=False).strategy, sparkdl.AllReduce)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"strategy": "allreduce"}, "strategy='allreduce' is not a sparkdl strategy"),
        ({"num_workers": 0}, "num_workers=0 must be a positive integer"),
        ({"keep_checkpoints": 0, "checkpoint_dir": "/tmp/x"}, "keep_checkpoints=0 must be a positive integer"),
        ({"checkpoint_async": "no", "checkpoint_dir": "/tmp/x"}, "checkpoint_async='no' must be True or False"),
        ({"reader": "parquet-magic"}, "reader='parquet-magic' is unknown; valid: .*arrow"),
        ({"metrics": {"acc": len}}, "metrics= are computed on validation data"),
        ({"validation": 1.5}, "validation=1.5: a fraction of the rows must be in \\(0, 1\\)"),
        ({"validation": True}, "validation=True must be a fraction in \\(0, 1\\) or validation data"),
        ({"batch_size": 0}, "batch_size=0 must be a positive integer"),
        ({"slot_wait_s": -1}, "slot_wait_s=-1 must be >= 0 seconds"),
        ({"feature_cols": ["a"], "inputs": {"x": "b"}}, "give feature_cols= or inputs=, not both"),
    ],
)
def test_each_bad_setting_is_named_the_same_way_by_the_estimator_and_run(arguments, message):
    with pytest.raises(ConfigError, match=message):
        sparkdl.TorchEstimator(model=_model, **{"feature_cols": ["a"], **arguments})
    with pytest.raises(ConfigError, match=message):
        sparkdl.run(lambda ctx: None, data="/nonexistent", **{"num_workers": 1, "feature_cols": ["a"], **arguments})


def test_checkpoint_every_needs_a_checkpoint_dir():
    with pytest.raises(ConfigError, match="checkpoint_every is set but checkpoint_dir is not"):
        sparkdl.TorchEstimator(model=_model, checkpoint_every=5)


def test_data_arguments_without_data_are_refused():
    with pytest.raises(ConfigError, match="inputs=, filters= need data="):
        sparkdl.run(lambda ctx: None, num_workers=1, inputs={"x": "a"}, filters=[("a", ">", 1)])


def test_replacing_a_data_setting_checks_it_again():
    settings = DataSettings(feature_cols=["a"], label_col="y", batch_size=8)
    assert dataclasses.replace(settings, batch_size=4).spec.batch_size == 4
    assert dataclasses.replace(settings, feature_cols=["a", "b"]).plan.columns == ["a", "b", "y"]
    with pytest.raises(ConfigError, match="batch_size=-1 must be a positive integer"):
        dataclasses.replace(settings, batch_size=-1)


def test_estimator_params_changed_by_copy_reach_the_data_settings():
    estimator = sparkdl.TorchEstimator(model=_model, feature_cols=["a"], label_col="y", batch_size=8, seed=1)
    copied = estimator.copy({estimator.batchSize: 64, estimator.featureCols: ["a", "b"], estimator.seed: 9})
    data = copied._data_settings()
    assert (data.batch_size, data.seed, data.plan.columns) == (64, 9, ["a", "b", "y"])
    assert estimator._data_settings().batch_size == 8


def test_a_sequence_label_survives_param_resolution():
    label = sparkdl.Sequence("tags", max_length=8, pad_value=-100)
    estimator = sparkdl.TorchEstimator(
        model=_model, inputs={"tokens": sparkdl.Sequence("tokens", max_length=8)}, label_col=label
    )
    assert estimator._data_settings().plan.label == label
    renamed = estimator.copy({estimator.labelCol: "other"})._data_settings()
    assert renamed.plan.label_column == "other" and renamed.plan.label != label


def test_a_relaunch_on_fewer_workers_with_a_reader_that_cannot_reshard_is_refused_before_launch():
    """Elastic resume replays the interrupted epoch through the Arrow reader's code: a reader of
    a user's that subclasses it can, one of its own cannot (nor Petastorm's) — refused when the
    settings are built, not after a failure has already relaunched on fewer workers."""
    from sparkdl.data.readers.arrow import ArrowReader
    from sparkdl.data.readers.base import DataReader
    from sparkdl.data.readers.petastorm import PetastormReader

    class ColumnsRenamed(ArrowReader):  # same rows, same order: reshardable by inheritance
        name = "test_columns_renamed"

    class OwnOrder(DataReader):
        name = "test_own_order"

        def read_pass(self, *args, **kwargs):  # never read here
            raise NotImplementedError

    elastic = {"num_workers": 2, "min_workers": 1, "checkpoint_dir": "/tmp/unused-ckpt", "feature_cols": ["x"]}
    assert RunSettings.from_arguments({**elastic, "reader": "test_columns_renamed"}, with_data=True).data is not None
    with pytest.raises(
        ConfigError,
        match=r"reader='test_own_order' cannot resume a checkpoint on a different number of workers \(min_workers=1 < num_workers=2",
    ):
        RunSettings.from_arguments({**elastic, "reader": "test_own_order"}, with_data=True)
    # Without min_workers (or without checkpoints) nothing resumes on another count: accepted.
    plain = {"num_workers": 2, "reader": "test_own_order", "feature_cols": ["x"]}
    assert RunSettings.from_arguments(plain, with_data=True).data.reader == "test_own_order"
    assert ColumnsRenamed.reshardable and not OwnOrder.reshardable
    assert not PetastormReader.reshardable  # its own row order (refused the same way where it is installed)
