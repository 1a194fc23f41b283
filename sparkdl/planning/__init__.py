"""``sparkdl.plan``: how each strategy would scale from 2 to 1024 workers, predicted from a
one-minute calibration on the user's own cluster, model and data.

* :mod:`.calibration` — the short stage that times two tasks' steps and data paths together, the model's
  bytes and the link between two executors;
* :mod:`.models` — the cost models (ring allreduce, averaging every τ, parameter-server load,
  FSDP's gathers), no Spark; :mod:`.sparse_cost` — a sparse table's bytes per step and memory per
  rank, from the unique rows per step that :mod:`.sparse_calibration` counts on the user's batches;
* :mod:`.units` — ``10Gbit``, ``50us``, ``4g``;
* :mod:`.report` — :class:`Plan`: the table, ``plan.json``, the plot.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch

from sparkdl.errors import ConfigError
from sparkdl.planning.calibration import NetworkCalibration, measure_task, slowest
from sparkdl.planning.models import KINDS, Measured, StrategyShape, sweep
from sparkdl.planning.report import Plan
from sparkdl.planning.sparse_cost import SparseTable
from sparkdl.planning.units import bandwidth_bytes, latency_seconds, memory_bytes
from sparkdl.strategies import (
    AllReduce,
    ElasticAveraging,
    ModelAveraging,
    OuterSGD,
    ParameterServer,
    ShardedDataParallel,
)
from sparkdl.strategies.base import Strategy

__all__ = ["Plan", "plan", "DEFAULT_WORKERS"]

logger = logging.getLogger("sparkdl")

#: The worker counts a plan predicts for by default: powers of two from 2 to 1024.
DEFAULT_WORKERS = tuple(2**k for k in range(1, 11))


def default_strategies() -> Dict[str, Strategy]:
    return {
        "AllReduce": AllReduce(),
        "ModelAveraging(sync_every=8)": ModelAveraging(sync_every=8),
        "DiLoCo(sync_every=64)": ModelAveraging(
            sync_every=64, outer_optimizer=OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
        ),
        "ElasticAveraging(sync_every=4)": ElasticAveraging(sync_every=4),
        "ParameterServer": ParameterServer(),
        "ShardedDataParallel": ShardedDataParallel(),
    }


def shape_of(label: str, strategy: Strategy) -> StrategyShape:
    """The cost model of a strategy object: the one its class names (``Strategy.cost_model``),
    with its ``sync_every`` for the periodic ones."""
    kind = type(strategy).cost_model
    if kind not in KINDS:
        raise ConfigError(
            f"strategy {label} ({type(strategy).__name__}) has no cost model in sparkdl plan: set the class attribute "
            f"cost_model to the built-in strategy's whose communication it follows, one of {', '.join(KINDS)} "
            f"(it is {kind!r})"
        )
    periodic = kind in ("averaging", "elastic")
    return StrategyShape(kind, label, sync_every=int(getattr(strategy, "sync_every", 1)) if periodic else 1)


def plan(
    model: Callable[[], torch.nn.Module],
    data: Any,
    batch_size: int = 32,
    strategies: Any = None,
    workers: Sequence[int] = DEFAULT_WORKERS,
    bandwidth: Union[str, float, None] = None,
    latency: Union[str, float, None] = None,
    optimizer: Optional[Callable] = None,
    loss: Optional[Callable] = None,
    feature_cols: Optional[Sequence[str]] = None,
    label_col: Any = "label",
    inputs: Optional[Dict[str, Any]] = None,
    spark: Any = None,
    progress: bool = False,
    memory_budget: Union[str, int, None] = None,
) -> Plan:
    """Calibrates on this cluster (about a minute) and predicts each strategy on ``workers``.

    Args:
        model, data, batch_size, optimizer, loss, feature_cols, label_col, inputs: as for
            ``TorchEstimator`` (the same checks: a model that cannot be built or data that cannot
            be read fail as ``fit`` would).
        strategies: as for ``sparkdl.compare`` (objects, a mapping label -> strategy, or a text
            such as ``"allreduce,model_averaging:sync_every=16"``); default AllReduce,
            ModelAveraging τ=8, DiLoCo τ=64, ElasticAveraging τ=4, ParameterServer,
            ShardedDataParallel.
        workers: the worker counts to predict for (default 2, 4, ..., 1024).
        bandwidth: the link between hosts (``"10Gbit"``) instead of the measured one; needed
            when the calibration's two tasks share a host (loopback is not a network).
        latency: one message's cost (``"50us"``) instead of the measured one.
        memory_budget: the memory one rank may use (``"4g"`` or bytes); default: a task's share
            of ``spark.executor.pyspark.memory`` when the session sets it, else none (no
            prediction is checked against memory). A prediction over it says "does not fit".

    A model with ``ShardedEmbedding`` tables is predicted under ParameterServer only (the only
    strategy that trains them; the others are left out with a note): its tables' bytes per step
    are those of the unique rows the calibration's batches touched, its memory the rank's share
    of each table (docs/planning.md).

    Returns:
        :class:`Plan`: ``print(plan.table())``, ``plan.save(dir)`` writes plan.json and plan.png.
    """
    from sparkdl._driver.preflight import build_checked_model, check_loss, check_optimizer
    from sparkdl._driver.prepare_data import prepare_data
    from sparkdl._task.fit_loop import default_optimizer
    from sparkdl.comparison.strategies import labelled_strategies
    from sparkdl.custom_loop import run
    from sparkdl.estimator import TorchEstimator
    from sparkdl.strategies.parameter_server.embedding import sharded_embeddings

    labelled = labelled_strategies(strategies) if strategies is not None else tuple(default_strategies().items())
    shapes = [shape_of(label, strategy) for label, strategy in labelled]
    counts = _worker_counts(workers)
    stated_bandwidth, stated_latency = bandwidth_bytes(bandwidth), latency_seconds(latency)
    stated_budget = memory_bytes(memory_budget)
    optimizer = optimizer or default_optimizer  # fit's default: Adam, lr=1e-3
    loss = loss or torch.nn.functional.cross_entropy
    # The estimator's own checks, before anything launches: the model builds, the data reads.
    estimator = TorchEstimator(
        model=model,
        optimizer=optimizer,
        loss=loss,
        feature_cols=feature_cols,
        label_col=label_col,
        inputs=inputs,
        num_workers=1,
        batch_size=batch_size,
        epochs=1,
        progress=progress,
    )
    data_settings = estimator.settings.data
    # What fit checks before it launches, in the same order and words.
    module = build_checked_model(model, data_settings.plan)
    notes = []
    if sharded_embeddings(module):
        labelled, shapes, refused = _sparse_capable(labelled, shapes)
        if refused:
            notes.append(
                f"not predicted: {', '.join(refused)} (ShardedEmbedding tables train under ParameterServer only)"
            )
        if not shapes:
            raise ConfigError(
                f"{type(module).__name__} holds ShardedEmbedding tables, which train under ParameterServer only: "
                f"plan it with strategies=[sparkdl.ParameterServer()], not {', '.join(refused)}"
            )
    probe = stated_bandwidth is None or stated_latency is None
    tasks = 2 if probe else 1  # two tasks time their steps together, then the link between them
    # Prepared for the calibration's tasks: a DataFrame's copy, laid out for them, is the one run() reuses.
    info, spec, reader, _ = prepare_data(data, data_settings, tasks, spark)
    check_optimizer(optimizer, module)
    check_loss(module, loss, info, spec, reader)
    calibrated = run(
        # Each strategy's synchronization is timed only where there is a link to time it over.
        measure_task(model, optimizer, loss, batch_size, list(zip(shapes, (s for _, s in labelled))) if probe else ()),
        num_workers=tasks,
        data=data,
        feature_cols=data_settings.feature_cols,
        inputs=data_settings.inputs,
        label_col=data_settings.label_col,
        batch_size=batch_size,
        shuffle=True,
        spark=spark,
        progress=progress,
    )
    task = slowest(calibrated["tasks"])
    network = None
    budget, budget_source = _memory_budget(stated_budget, spark)
    if budget is not None:
        notes.append(f"memory budget per rank: {budget / 2**20:,.0f} MiB ({budget_source})")
    if probe:
        network = NetworkCalibration(**calibrated["network"])
        if network.loopback and stated_bandwidth is None:
            warning = (
                f"the network probe's two tasks ran on one host ({network.hosts[0]}): it measured loopback "
                f"({network.bandwidth * 8 / 1e9:.3g} Gbit/s), not a network between hosts; pass bandwidth= "
                f"(--bandwidth 10Gbit) for the cluster you plan for"
            )
            logger.warning("%s", warning)
            notes.append(warning)
    measured = Measured(
        batch_size=batch_size,
        local_step_s=task.local_step_s,
        compute_step_s=task.compute_step_s,
        data_rows_per_s=task.data_rows_per_s,
        param_bytes=task.param_bytes,
        grad_bytes=task.grad_bytes,
        optimizer_bytes=task.optimizer_bytes,
        largest_unit_bytes=task.largest_unit_bytes,
        bandwidth=stated_bandwidth if stated_bandwidth is not None else network.bandwidth,
        latency_s=stated_latency if stated_latency is not None else network.latency_s,
        backend="nccl" if task.device.startswith("cuda") else "gloo",
        sync_overhead_s=dict(task.sync_overhead_s),
        sparse_tables=tuple(SparseTable(**table) for table in task.sparse_tables),
        memory_budget_bytes=budget,
    )
    if stated_bandwidth is not None:
        notes.append(f"bandwidth stated: {stated_bandwidth * 8 / 1e9:.3g} Gbit/s per link")
    if stated_latency is not None:
        notes.append(f"latency stated: {stated_latency * 1e6:.0f} us per message")
    calibration = {
        "task": vars(task),
        "tasks": calibrated["tasks"],
        "network": None if network is None else {**vars(network)},
    }
    return Plan(measured, sweep(measured, shapes, counts), calibration, notes)


def _sparse_capable(labelled: Sequence, shapes: Sequence[StrategyShape]) -> tuple:
    """The strategies that train sparse tables (the parameter server's cost model), and the
    labels of the others."""
    keep = [i for i, shape in enumerate(shapes) if shape.kind == "parameter_server"]
    refused = [shape.label for shape in shapes if shape.kind != "parameter_server"]
    return [labelled[i] for i in keep], [shapes[i] for i in keep], refused


def _memory_budget(stated: Optional[int], spark: Any) -> tuple:
    """(bytes, where from) of one rank's memory budget: the stated one, else a task's share of
    ``spark.executor.pyspark.memory`` (Spark's limit on the Python workers) when set, else
    (None, None): the JVM's ``spark.executor.memory`` does not bound the training process."""
    if stated is not None:
        return stated, "stated"
    from sparkdl._driver.memory_check import session_conf
    from sparkdl.data.shard_cache import task_memory_bytes

    conf = session_conf(spark)  # the given session, else the active one; no key set without one
    if not conf("spark.executor.pyspark.memory"):
        return None, None
    return task_memory_bytes(conf)


def _worker_counts(workers: Sequence[int]) -> Sequence[int]:
    try:
        counts = sorted({int(n) for n in workers})
    except (TypeError, ValueError):
        raise ConfigError(f"workers={workers!r} must be worker counts such as [2, 4, 8]") from None
    if not counts or counts[0] < 1 or any(int(n) != n for n in workers):
        raise ConfigError(f"workers={workers!r} must be positive whole numbers such as [2, 4, 8]")
    return counts
