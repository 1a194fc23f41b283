"""Every setting of a run, validated once: the one place the configs are built.

``TorchEstimator`` (flat Spark ML Params, the Spark ML convention that ``ParamGridBuilder`` needs),
``sparkdl.run`` and the CLI (through the estimator) take the same keyword arguments; their
public signatures are the only list of those names. :meth:`RunSettings.from_arguments` turns
them into validated frozen configs — :class:`~sparkdl._driver.LaunchConfig`, the strategy,
:class:`~sparkdl.checkpoint.CheckpointConfig` and :class:`DataSettings` — so each check is
written, and runs, in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from sparkdl._runtime.resize import on_resize_for
from sparkdl._runtime.validation import named_metrics
from sparkdl._task.config import LaunchConfig
from sparkdl.checkpoint import CheckpointConfig
from sparkdl.data.dataset import Filters
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers import reader_from_name
from sparkdl.data.readers.base import DEFAULT_READER, DataReader
from sparkdl.data.reshard import check_reader
from sparkdl.data.shard_cache import check_setting as check_shard_cache
from sparkdl.data.spec import DataSpec, MetricFn, TransformFn
from sparkdl.errors import ConfigError
from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.base import Strategy


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What ``data=`` is read with: the model inputs, the batching, the reader and validation.

    The arguments are those of ``TorchEstimator`` / ``sparkdl.run`` of the same names.
    """

    feature_cols: Optional[Sequence[str]] = None
    inputs: Optional[Mapping[str, Any]] = None
    label_col: Any = None
    batch_size: int = 32
    shuffle: bool = True
    seed: int = 0
    reader: str = DEFAULT_READER
    filters: Filters = None
    transform_fn: Optional[TransformFn] = None
    validation: Any = None
    metrics: Optional[Mapping[str, MetricFn]] = None
    cache_dir: Optional[str] = None
    decode_threads: Optional[int] = None
    shard_cache: str = "auto"
    #: Derived, checked in ``__post_init__`` (``dataclasses.replace`` derives them again).
    plan: InputPlan = dataclasses.field(init=False, compare=False)
    spec: DataSpec = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", InputPlan.build(self.feature_cols, self.inputs, self.label_col))
        reader_from_name(self.reader)  # an unknown name fails now, not at fit
        check_shard_cache(self.shard_cache)
        object.__setattr__(self, "metrics", named_metrics(self.metrics))  # ["accuracy"], as the CLI's --metric
        metrics, validation = self.metrics, self.validation
        if metrics is not None and (not isinstance(metrics, Mapping) or not all(callable(f) for f in metrics.values())):
            raise ConfigError(f"metrics={metrics!r} must map names to functions fn(output, label) -> scalar")
        if validation is None and metrics:
            raise ConfigError("metrics= are computed on validation data: pass validation= as well")
        if isinstance(validation, (bool, int)):
            raise ConfigError(f"validation={validation!r} must be a fraction in (0, 1) or validation data")
        if isinstance(validation, float) and not 0.0 < validation < 1.0:
            raise ConfigError(f"validation={validation!r}: a fraction of the rows must be in (0, 1)")
        spec = DataSpec(
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            filters=self.filters,
            transform_fn=self.transform_fn,
            holdout=self.holdout,
            decode_threads=self.decode_threads,
        )
        object.__setattr__(self, "spec", spec)

    @property
    def holdout(self) -> float:
        """The fraction of the training rows held out for validation (0 without one)."""
        return self.validation if isinstance(self.validation, float) else 0.0

    @property
    def validation_data(self) -> Any:
        """Separate validation data (a URL, DataFrame or source), or None."""
        return None if self.validation is None or isinstance(self.validation, float) else self.validation

    def data_reader(self) -> DataReader:
        return reader_from_name(self.reader)


_LAUNCH = (
    "num_workers",
    "use_gpu",
    "timeout_s",
    "precision",
    "max_failures",
    "watchdog_timeout_s",
    "min_workers",
    "on_resize",
    "slot_wait_s",
    "resources",
)
_DATA = tuple(f.name for f in dataclasses.fields(DataSettings) if f.init)
#: Arguments that only make sense with data.
_NEED_DATA = ("inputs", "validation", "filters", "transform_fn", "metrics")


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The validated configs of one run."""

    launch: LaunchConfig
    strategy: Strategy
    checkpoint: Optional[CheckpointConfig] = None
    data: Optional[DataSettings] = None

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], with_data: bool) -> "RunSettings":
        """Builds every config from the keyword arguments of ``TorchEstimator`` or ``sparkdl.run``
        (names they do not share with these configs, such as ``model``, are not read).

        Raises:
            ConfigError: naming the argument, its value and what would be valid.
        """
        strategy = arguments.get("strategy")
        strategy = AllReduce() if strategy is None else strategy
        if not isinstance(strategy, Strategy):
            raise ConfigError(f"strategy={strategy!r} is not a sparkdl strategy (e.g. sparkdl.AllReduce())")
        launch = LaunchConfig(
            progress=bool(arguments.get("progress", True)), **{k: arguments[k] for k in _LAUNCH if k in arguments}
        )
        # The strategy's default, or a ConfigError for a choice it refuses (sparkdl._runtime.resize).
        launch = dataclasses.replace(launch, on_resize=on_resize_for(launch.on_resize, strategy))
        checkpoint_dir, every = arguments.get("checkpoint_dir"), arguments.get("checkpoint_every")
        if every is not None and checkpoint_dir is None:
            raise ConfigError("checkpoint_every is set but checkpoint_dir is not: name a directory for the checkpoints")
        checkpoint = None
        if checkpoint_dir is not None:
            checkpoint = CheckpointConfig(
                checkpoint_dir,
                every_steps=every,
                keep=arguments.get("keep_checkpoints", 3),
                resume=arguments.get("resume", True),
                async_write=arguments.get("checkpoint_async", True),
            )
        data = None
        if with_data:
            data = DataSettings(**{k: arguments[k] for k in _DATA if k in arguments})
            if checkpoint is not None and launch.min_workers is not None and launch.min_workers < launch.num_workers:
                # A relaunch on fewer workers resumes the checkpoint elastically: refused now, not after a failure.
                check_reader(
                    data.reader,
                    f" (min_workers={launch.min_workers} < num_workers={launch.num_workers} with checkpoint_dir: a "
                    f"relaunch on fewer workers resumes the newest checkpoint on them)",
                )
        else:
            given = [k for k in _NEED_DATA if arguments.get(k) is not None]
            if given:
                raise ConfigError(f"{', '.join(f'{k}=' for k in given)} need data=")
        return cls(launch, strategy, checkpoint, data)
