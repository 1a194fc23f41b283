"""on_resize: its validation (one place, per strategy) and its arithmetic (accumulation, loss
scaling, the learning-rate factor)."""

from __future__ import annotations

import pytest
import torch

import sparkdl
from sparkdl._driver.settings import RunSettings
from sparkdl._runtime.resize import ResizePlan, accumulation_windows, on_resize_for, scale_learning_rate
from sparkdl._task.config import LaunchConfig
from sparkdl.errors import ConfigError


def test_an_unknown_on_resize_names_the_value_and_the_choices():
    with pytest.raises(
        ConfigError, match=r"on_resize='keep_batch' is not a choice: use one of 'keep_global_batch', 'scale_lr', 'none'"
    ):
        RunSettings.from_arguments({"num_workers": 2, "on_resize": "keep_batch"}, with_data=False)
    with pytest.raises(ConfigError, match="on_resize='shrink'"):
        LaunchConfig(num_workers=2, on_resize="shrink")


@pytest.mark.parametrize(
    "strategy, default",
    [
        (sparkdl.AllReduce(), "keep_global_batch"),
        (sparkdl.ShardedDataParallel(), "keep_global_batch"),
        (sparkdl.ModelAveraging(sync_every=4), "none"),
        (sparkdl.ModelAveraging(sync_every=4, outer_optimizer=sparkdl.OuterSGD()), "none"),
        (sparkdl.ElasticAveraging(sync_every=4), "none"),
        (sparkdl.ParameterServer(), "none"),
    ],
)
def test_each_strategy_has_its_default(strategy, default):
    settings = RunSettings.from_arguments({"num_workers": 2, "strategy": strategy}, with_data=False)
    assert settings.launch.on_resize == default


@pytest.mark.parametrize("choice", ["keep_global_batch", "scale_lr"])
@pytest.mark.parametrize(
    "strategy",
    [sparkdl.ModelAveraging(sync_every=4), sparkdl.ElasticAveraging(sync_every=4), sparkdl.ParameterServer()],
)
def test_strategies_without_a_global_batch_refuse_to_keep_or_scale_it(strategy, choice):
    with pytest.raises(
        ConfigError, match=rf"on_resize='{choice}' does not apply to {type(strategy).__name__}: .*use on_resize='none'"
    ):
        on_resize_for(choice, strategy)
    with pytest.raises(ConfigError, match=f"on_resize='{choice}'"):
        sparkdl.TorchEstimator(model=lambda: torch.nn.Linear(2, 2), strategy=strategy, on_resize=choice)


def test_the_planned_workers_survive_an_attempt_on_fewer():
    import dataclasses

    config = LaunchConfig(num_workers=4, min_workers=1, on_resize="keep_global_batch")
    attempt = dataclasses.replace(config, num_workers=3)
    plan = attempt.resize_plan(batch_size=8)
    assert (plan.planned_workers, plan.world_size, plan.accumulation_steps) == (4, 3, 2)


@pytest.mark.parametrize(
    "planned, world, steps, global_batch",
    [(4, 2, 2, 32), (2, 1, 2, 16), (4, 4, 1, 32), (3, 2, 2, 32), (5, 2, 3, 48), (2, 3, 1, 24)],
)
def test_keep_global_batch_accumulates_to_the_nearest_global_batch_at_or_above(planned, world, steps, global_batch):
    plan = ResizePlan("keep_global_batch", planned, world, batch_size=8)
    assert plan.accumulation_steps == steps
    assert plan.global_batch_size == global_batch
    assert plan.global_batch_size >= plan.planned_global_batch_size or world > planned
    assert (plan.warning() is not None) == (world < planned and planned % world != 0)


def test_the_other_choices_never_accumulate():
    for choice in ("scale_lr", "none"):
        assert ResizePlan(choice, 4, 1, batch_size=8).accumulation_steps == 1
    assert "global batch is 8 rows instead of 32" in ResizePlan("none", 4, 1, batch_size=8).warning()


def test_windows_scale_each_step_by_its_micro_batches_and_end_at_the_epoch():
    windows = list(accumulation_windows(range(5), 5, 2))
    assert [(scale, last) for _, scale, last in windows] == [
        (0.5, False),
        (0.5, True),
        (0.5, False),
        (0.5, True),
        (1.0, True),
    ]
    assert [last for _, _, last in accumulation_windows(range(3), 3, 1)] == [True, True, True]


def test_accumulated_scaled_gradients_are_the_mean_gradient_of_the_global_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    inputs, labels = torch.randn(12, 3), torch.randint(0, 2, (12,))
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    micro = list(zip(inputs.split(4), labels.split(4)))
    for (x, y), scale, _last in accumulation_windows(micro, len(micro), 3):
        (torch.nn.functional.cross_entropy(model(x), y) * scale).backward()
    for got, want in zip((p.grad for p in model.parameters()), whole):
        assert torch.allclose(got, want, atol=1e-6)


def test_scale_lr_multiplies_every_param_group_by_m_over_n():
    plan = ResizePlan("scale_lr", 4, 1, batch_size=8)
    assert plan.lr_factor(4) == 0.25 and plan.lr_factor(2) == 0.5 and plan.lr_factor(1) == 1.0
    assert ResizePlan("keep_global_batch", 4, 1).lr_factor(4) == 1.0
    weight, bias = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [weight], "lr": 0.1}, {"params": [bias], "lr": 0.02}])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)  # sets initial_lr
    scale_learning_rate(optimizer, plan.lr_factor(4))
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.005])
    assert [g["initial_lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.005])
    assert scheduler.base_lrs == pytest.approx([0.1, 0.02])  # built before: its base is the user's to scale
