"""``sparkdl.compare``: the strategies' trade-offs on the user's own model, data and cluster.

Each strategy trains the same model from the same seed on the same data with the same optimizer
for the same number of epochs (equal samples: the fair budget, since every strategy then sees
every row equally often), one real ``TorchEstimator.fit`` after another, and the result holds
what each one gave: steady-state samples/s, model-sync bytes per sample, the loss (and
validation figures) after the budget, the training time until a target loss, and the loss curve
against training time. There is no time budget: the training loop has no time limit, and
stopping a fit from outside would measure the stopping, not the strategy.

``slow_rank=r`` makes rank r sleep ``slow_s`` seconds before every training step, a simulated
straggler: synchronous strategies wait for it at every step, asynchronous ones do not.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import Any, Callable, Dict, Mapping, Optional

from sparkdl._version import versions
from sparkdl.comparison.result import Comparison, ComparisonRow, check_plotting
from sparkdl.comparison.strategies import Labelled, SlowedModel, labelled_strategies
from sparkdl.errors import ConfigError
from sparkdl.estimator import TorchEstimator
from sparkdl.filesystem import check_output
from sparkdl.tracking import describe_callable

#: The straggler's default sleep per training step.
DEFAULT_SLOW_S = 0.05
#: TorchEstimator arguments compare sets itself or refuses: each strategy trains from scratch, and
#: a shared checkpoint directory would make one resume from another's checkpoint.
_REFUSED = ("strategy", "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "checkpoint_async", "resume")


@dataclasses.dataclass(frozen=True)
class CompareSettings:
    """What a comparison varies and measures, checked before anything trains.

    Args:
        strategies: see :func:`compare`; normalized to (label, strategy) pairs.
        epochs: the budget: epochs every strategy trains.
        num_workers: ranks of every fit.
        target_loss: the training loss "time to target" waits for (None: no such column).
        slow_rank: the rank to slow down (None: none).
        slow_s: that rank's extra seconds per training step.
    """

    strategies: Any = None
    epochs: int = 3
    num_workers: int = 2
    target_loss: Optional[float] = None
    slow_rank: Optional[int] = None
    slow_s: float = DEFAULT_SLOW_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategies", labelled_strategies(self.strategies))
        if not _is_int(self.epochs) or self.epochs < 1:
            raise ConfigError(
                f"epochs={self.epochs!r} must be a positive integer (the budget: epochs every strategy trains)"
            )
        if not _is_int(self.num_workers) or self.num_workers < 1:
            raise ConfigError(f"num_workers={self.num_workers!r} must be a positive integer")
        t = self.target_loss
        if t is not None and (not _is_real(t) or not math.isfinite(t)):
            raise ConfigError(f"target_loss={t!r} must be a finite number (the training loss to reach) or None")
        r = self.slow_rank
        if r is not None and (not _is_int(r) or not 0 <= r < self.num_workers):
            raise ConfigError(
                f"slow_rank={r!r} must be a rank of the run: an integer from 0 to {self.num_workers - 1} "
                f"(num_workers={self.num_workers}), or None for no slowed worker"
            )
        s = self.slow_s
        if not _is_real(s) or not math.isfinite(s) or s < 0:
            raise ConfigError(
                f"slow_s={s!r} must be a number of seconds >= 0 (the slowed rank's sleep per training step)"
            )

    @property
    def slowed(self) -> Optional[Dict[str, Any]]:
        """The straggler as the JSON and the table state it (None when off)."""
        return None if self.slow_rank is None else {"rank": self.slow_rank, "seconds_per_step": float(self.slow_s)}


def compare(
    model: Callable[[], Any],
    data: Any,
    *,
    strategies: Any = None,
    epochs: int = 3,
    num_workers: int = 2,
    target_loss: Optional[float] = None,
    slow_rank: Optional[int] = None,
    slow_s: float = DEFAULT_SLOW_S,
    output_dir: Optional[str] = None,
    plot: bool = True,
    progress: Any = False,
    optimizer: Optional[Callable[[Any], Any]] = None,
    loss: Optional[Callable[[Any, Any], Any]] = None,
    feature_cols: Optional[Any] = None,
    inputs: Optional[Mapping[str, Any]] = None,
    label_col: Any = "label",
    batch_size: int = 32,
    seed: int = 0,
    validation: Any = None,
    metrics: Optional[Mapping[str, Callable[[Any, Any], Any]]] = None,
    **options: Any,
) -> Comparison:
    """Trains ``model`` on ``data`` with each strategy in turn and compares what they gave.

    Every fit is a real :class:`~sparkdl.TorchEstimator` fit with the same model factory,
    optimizer, loss, data, seed, batch size and epochs; only the strategy changes. A fit that
    fails becomes a row marked failed, with the error; the others still run.

    Args:
        model: zero-argument callable returning the ``torch.nn.Module`` (as for TorchEstimator).
        data: a DataFrame, a Parquet URL or a connector source (materialized once, reused).
        strategies: None for the default list (AllReduce, ModelAveraging at sync_every 4 and 16,
            ElasticAveraging, ParameterServer unbounded and with max_staleness=2); a list of
            strategy objects; a mapping ``label -> strategy``; or a text
            ``"allreduce,model_averaging:sync_every=4"``.
        epochs: the budget: epochs each strategy trains (equal samples for all).
        num_workers: ranks of every fit.
        target_loss: adds "time to target": the training seconds until the epoch whose training
            loss first reached it.
        slow_rank: slow this rank down by ``slow_s`` seconds per training step (simulated
            straggler; the table and JSON say it was on).
        slow_s: the slowed rank's sleep per step.
        output_dir: write ``compare.json`` and (with ``plot``) ``compare.png`` there: a path or
            a URL (``s3://``, ``gs://``, any fsspec URL), checked writable before anything trains.
        plot: draw ``compare.png`` into ``output_dir`` (needs matplotlib: ``sparkdl-torch[plot]``).
        progress: True prints a line per strategy and the fits' epoch lines; a callable receives
            every epoch record (as TorchEstimator's ``progress``).
        optimizer, loss, feature_cols, inputs, label_col, batch_size, seed, validation, metrics,
            **options: as for :class:`~sparkdl.TorchEstimator` (``options``: ``reader``,
            ``filters``, ``precision``, ``timeout_s``...). ``strategy`` and checkpointing are
            refused: compare sets the strategy and trains each from scratch.

    Returns:
        The :class:`Comparison`: ``.rows``, ``.table()``, ``.to_json()``, ``.plot(path)``.

    Raises:
        ConfigError: a bad setting (named), found before anything trains; also an
            ``output_dir`` whose scheme has no filesystem here or that cannot be written.
        DataError: data every strategy would fail on (a path that does not exist, a missing
            column, an empty shard), found once before anything trains.
    """
    settings = CompareSettings(
        strategies=strategies,
        epochs=epochs,
        num_workers=num_workers,
        target_loss=target_loss,
        slow_rank=slow_rank,
        slow_s=slow_s,
    )
    refused = [name for name in _REFUSED if name in options]
    if refused:
        raise ConfigError(
            f"compare does not take {', '.join(f'{n}=' for n in refused)}: it sets each fit's strategy itself (strategies=) "
            f"and trains every strategy from scratch"
        )
    if output_dir is not None:  # now, not after every strategy has trained
        check_output(output_dir, "output_dir")
        if plot:
            check_plotting()
    factory = model if settings.slow_rank is None else SlowedModel(model, settings.slow_rank, float(settings.slow_s))
    shared = dict(
        optimizer=optimizer,
        loss=loss,
        feature_cols=feature_cols,
        inputs=inputs,
        label_col=label_col,
        num_workers=num_workers,
        batch_size=batch_size,
        epochs=epochs,
        seed=seed,
        validation=validation,
        metrics=metrics,
        progress=progress,
        **options,
    )
    # Every estimator is built (and its settings checked) before the first one trains.
    estimators = [
        (label, strategy, TorchEstimator(model=factory, strategy=strategy, **shared))
        for label, strategy in settings.strategies
    ]
    check_data(data, estimators[0][2])
    _warm(data, num_workers)
    rows, dataset = [], None
    for index, (label, strategy, estimator) in enumerate(estimators, 1):
        if progress is True:
            print(f"[sparkdl compare] {index}/{len(estimators)} {label}", flush=True)
        started = time.time()
        try:
            fitted = estimator.fit(data)
        except Exception as exc:  # noqa: BLE001 - one strategy's failure is its row, the others still run
            rows.append(ComparisonRow.failed(label, strategy.describe(), exc, time.time() - started))
            if progress is True:
                print(f"[sparkdl compare] {label} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        run_info = fitted.run_info
        dataset = dataset or {**run_info["dataset"], "steps_per_epoch": run_info["steps_per_epoch"]}
        rows.append(
            ComparisonRow.from_history(
                label,
                strategy.describe(),
                fitted.history,
                num_workers=num_workers,
                target_loss=settings.target_loss,
                train_seconds=run_info.get("train_seconds"),
                fit_seconds=time.time() - started,
            )
        )
    comparison = Comparison(
        rows=rows, settings=_settings_document(settings, model, shared, data, dataset), versions=_versions()
    )
    if output_dir is not None:
        comparison.save(output_dir, plot=plot)
    return comparison


def check_data(data: Any, estimator: TorchEstimator) -> None:
    """The checks every fit makes of ``data`` before it launches (the path, the columns, the
    shards; a DataFrame materialized, which each fit then reuses), made once: every strategy
    reads the same data, so what fails one fails all, and should fail the comparison at once.

    Raises:
        DataError, ConfigError: as ``estimator.fit(data)`` would, before launching.
    """
    from sparkdl._driver.prepare_data import prepare_data

    prepare_data(
        data,
        estimator._data_settings(),
        estimator.getOrDefault(estimator.numWorkers),
        getattr(data, "sparkSession", None),
        task_cpus=estimator.settings.launch.task_cpus,
    )


def _warm(data: Any, num_workers: int) -> None:
    """The executors' Python workers started and torch imported before the first fit, so the
    first strategy's times do not include them (the later ones' never do)."""
    from sparkdl._driver.warmup import warm_up

    spark = getattr(data, "sparkSession", None)
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    if spark is not None:
        warm_up(spark, num_workers, wait=True)


def _settings_document(
    settings: CompareSettings, model: Any, shared: Mapping[str, Any], data: Any, dataset: Optional[Mapping[str, Any]]
) -> Dict[str, Any]:
    validation = shared["validation"]
    return {
        "model": describe_callable(model),
        "optimizer": describe_callable(shared["optimizer"]) if shared["optimizer"] else "default (Adam, lr=1e-3)",
        "loss": describe_callable(shared["loss"]) if shared["loss"] else "default (cross_entropy)",
        "data": data if isinstance(data, str) else type(data).__name__,
        "dataset": dict(dataset) if dataset else None,
        "feature_cols": list(shared["feature_cols"]) if shared["feature_cols"] else None,
        "inputs": sorted(shared["inputs"]) if shared["inputs"] else None,
        "label_col": str(shared["label_col"]),
        "num_workers": settings.num_workers,
        "batch_size": shared["batch_size"],
        "epochs": settings.epochs,
        "budget": f"equal samples: every strategy trains {settings.epochs} epoch(s) of the same data",
        "seed": shared["seed"],
        "validation": validation if validation is None or isinstance(validation, float) else "separate data",
        "metrics": sorted(shared["metrics"] or {}),
        "target_loss": settings.target_loss,
        "slowed": settings.slowed,
        "strategies": [{"label": label, **strategy.describe()} for label, strategy in settings.strategies],
        "definitions": {
            "samples_per_sec": "samples over seconds of the steady epochs (all but the first; the only one for 1 epoch)",
            "comm_bytes_per_sample": "model-sync bytes all ranks sent over the budget, per training sample",
            "time": "training seconds: the sum of the epochs' seconds on rank 0 (no start-up, no validation passes)",
            "time_to_target_s": "training seconds at the end of the first epoch whose training loss <= target_loss",
            "train_seconds": "rank 0's training loop, start to end; fit_seconds: the whole fit call",
        },
    }


def _versions() -> Dict[str, str]:
    import pyspark

    return versions(pyspark.__version__)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


__all__ = ["CompareSettings", "Comparison", "ComparisonRow", "Labelled", "check_data", "compare"]
