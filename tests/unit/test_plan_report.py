"""``Plan.stops_scaling`` / ``Plan.of`` take a strategy as the plan labels it, or a name that
names exactly one of its strategies; anything else is a ``ConfigError`` listing the labels, never
a silent "never" (no Spark: the plan is built from the cost models)."""

from __future__ import annotations

import pytest

from sparkdl.errors import ConfigError
from sparkdl.planning import DEFAULT_WORKERS, default_strategies, shape_of
from sparkdl.planning.models import Measured, stops_scaling, sweep
from sparkdl.planning.report import Plan

#: The default plan's strategies on a 10 Gbit/s, 50 us link, a 5 MB model stepping in 5 ms.
MEASURED = Measured(
    batch_size=32,
    local_step_s=0.005,
    compute_step_s=0.004,
    data_rows_per_s=200_000,
    param_bytes=5 * 10**6,
    grad_bytes=5 * 10**6,
    optimizer_bytes=10 * 10**6,
    largest_unit_bytes=2 * 10**6,
    bandwidth=1.25e9,
    latency_s=50e-6,
)


@pytest.fixture(scope="module")
def plan() -> Plan:
    shapes = [shape_of(label, strategy) for label, strategy in default_strategies().items()]
    return Plan(measured=MEASURED, predictions=sweep(MEASURED, shapes, DEFAULT_WORKERS), calibration={})


def test_the_default_plan_labels_its_strategies_as_the_docs_name_them(plan):
    assert plan.strategies == [
        "AllReduce",
        "ModelAveraging(sync_every=8)",
        "DiLoCo(sync_every=64)",
        "ElasticAveraging(sync_every=4)",
        "ParameterServer",
        "ShardedDataParallel",
    ]


def test_a_family_or_registered_name_that_names_one_strategy_is_that_strategy(plan):
    averaging = plan.stops_scaling("ModelAveraging(sync_every=8)")
    assert averaging is not None  # a 5 MB average every 8 steps stops paying off within 1024 workers
    for name in ("ModelAveraging", "model_averaging", "modelaveraging", "Model-Averaging"):
        assert plan.stops_scaling(name) == averaging
    assert plan.label("diloco") == "DiLoCo(sync_every=64)"
    assert plan.label("sharded") == "ShardedDataParallel"
    assert plan.label("parameter_server") == "ParameterServer"
    assert plan.of("elastic") == plan.of("ElasticAveraging(sync_every=4)")
    # The exact label wins, and the answer is the cost model's own.
    assert plan.stops_scaling("AllReduce") == stops_scaling(plan.of("AllReduce"), 0.8)


def test_an_unknown_strategy_is_an_error_listing_the_plans_labels_not_never(plan):
    for unknown in ("ModelAveraging(τ=8)", "ring", "", "AllReduce(bucket_cap_mb=5)"):
        with pytest.raises(
            ConfigError, match=r"is not in this plan; its strategies: 'AllReduce', 'ModelAveraging\(sync_every=8\)'"
        ):
            plan.stops_scaling(unknown)
    with pytest.raises(ConfigError, match="DiLoCo"):
        plan.of("ModelAveraging(τ=8)")


def test_a_name_that_fits_several_strategies_asks_for_the_whole_label():
    shapes = [
        shape_of("ModelAveraging(sync_every=4)", default_strategies()["ModelAveraging(sync_every=8)"]),
        shape_of("ModelAveraging(sync_every=16)", default_strategies()["ModelAveraging(sync_every=8)"]),
    ]
    two = Plan(measured=MEASURED, predictions=sweep(MEASURED, shapes, (2, 4)), calibration={})
    with pytest.raises(
        ConfigError,
        match=r"'ModelAveraging' names several .*'ModelAveraging\(sync_every=4\)'.*'ModelAveraging\(sync_every=16\)'",
    ):
        two.stops_scaling("ModelAveraging")
    assert two.of("ModelAveraging(sync_every=16)")[0].workers == 2


def test_a_users_strategy_is_planned_with_the_cost_model_its_class_names_and_refused_without_one():
    """``shape_of`` asks the strategy (``Strategy.cost_model``), so a strategy sparkdl does not
    know is planned like the built-in one it says it communicates like."""
    import dataclasses

    from sparkdl.strategies.base import Strategy

    @dataclasses.dataclass(frozen=True)
    class CompressedAveraging(Strategy):
        name = "test_compressed_averaging"
        cost_model = "averaging"
        sync_every: int = 32

        def create_runtime(self, env):  # never launched here
            raise NotImplementedError

    @dataclasses.dataclass(frozen=True)
    class Unplannable(Strategy):
        name = "test_unplannable"

        def create_runtime(self, env):
            raise NotImplementedError

    shape = shape_of("mine", CompressedAveraging())
    assert (shape.kind, shape.sync_every) == ("averaging", 32)
    assert [p.workers for p in sweep(MEASURED, [shape], (2, 4))] == [2, 4]
    with pytest.raises(
        ConfigError, match=r"Unplannable\) has no cost model in sparkdl plan: set the class attribute cost_model"
    ):
        shape_of("theirs", Unplannable())
