"""``sparkdl.launch``: an existing training script or function, unchanged, on barrier tasks.

TorchDistributor's model: each task runs the target in a child process with the environment
``torchrun`` sets (:mod:`sparkdl._task.environment`), so a plain DDP script's
``dist.init_process_group()`` works; unlike torch's ``env://`` it rendezvouses through sparkdl's
authenticated store. The data still streams: ``sparkdl.shard_dataset()`` in the child is this
rank's shard of ``data=``. docs/launch.md has the whole story.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from sparkdl._driver import launch as _launch_stage
from sparkdl._driver.prepare_data import DataSource, prepare_data
from sparkdl._driver.progress import ProgressCallback, ProgressDisplay
from sparkdl._driver.session_checks import check_session
from sparkdl._driver.settings import RunSettings
from sparkdl._driver.warmup import warm_up
from sparkdl._task.script import LaunchTarget, ScriptResult
from sparkdl.data.batching import TransformFn
from sparkdl.data.dataset import Filters
from sparkdl.data.readers.base import DEFAULT_READER
from sparkdl.errors import ConfigError
from sparkdl.resources import Resources

__all__ = ["ScriptResult", "launch"]


def launch(
    target: Union[str, "os.PathLike[str]", Callable[..., Any]],
    *args: Any,
    num_workers: int,
    data: Optional[DataSource] = None,
    feature_cols: Sequence[str] = (),
    inputs: Optional[Mapping[str, Any]] = None,
    label_col: Any = None,
    batch_size: int = 32,
    shuffle: bool = True,
    seed: int = 0,
    reader: str = DEFAULT_READER,
    filters: Filters = None,
    transform_fn: Optional[TransformFn] = None,
    decode_threads: Optional[int] = None,
    cache_dir: Optional[str] = None,
    shard_cache: str = "auto",
    spark: Any = None,
    use_gpu: Optional[bool] = None,
    resources: Optional[Resources] = None,
    timeout_s: float = 600.0,
    progress: Union[bool, ProgressCallback] = True,
    max_failures: int = 0,
    watchdog_timeout_s: Optional[float] = 600.0,
    slot_wait_s: float = 30.0,
) -> Any:
    """Runs a script or a function on ``num_workers`` barrier tasks, each in a child process
    with torchrun's environment; returns rank 0's outcome.

    Args:
        target: a Python script's path (run as ``python script.py *args``; every executor must
            see it: docs/launch.md) or a callable (called as ``target(*args)``, shipped by value
            like ``sparkdl.run``'s function; it gets no ``ctx``).
        *args: the script's arguments (strings or numbers, passed as strings) or the callable's.
        num_workers: number of ranks (barrier tasks, one child process each).
        data, feature_cols, inputs, label_col, batch_size, shuffle, seed, reader, filters,
            transform_fn, decode_threads, cache_dir, shard_cache: the data ``sparkdl.shard_dataset()`` streams
            in the child, as for ``sparkdl.run``.
        spark: the SparkSession; default the active one.
        use_gpu: as for ``sparkdl.run``; the child sees only the task's GPUs
            (``CUDA_VISIBLE_DEVICES``), so ``cuda:0`` / ``LOCAL_RANK=0`` is the task's GPU.
        resources: the training stage's own task resources, e.g. ``sparkdl.Resources(cpus=4,
            gpus=1)``: only the barrier stage runs with a Spark resource profile of them, so ETL
            in the same application keeps ``spark.task.cpus`` (docs/resources.md). None: the
            application's ``spark.task.*`` settings.
        timeout_s: bound on sparkdl's own rendezvous rounds and each store call.
        progress: print the children's output (prefixed with the rank) and their
            ``sparkdl.report`` metrics on the driver; a callable also receives each report;
            False keeps the output in the executors' logs only.
        max_failures: relaunch every rank up to this many times after a failure.
        watchdog_timeout_s: fail a rank whose child prints, reports and reads nothing for this long.
        slot_wait_s: how long to wait for enough free task slots before failing, as for
            ``sparkdl.run``.

    Returns:
        a script: rank 0's :class:`ScriptResult` (exit status 0, last lines of output); a
        callable: rank 0's return value.

    Raises:
        TrainingError: a rank's child exited non-zero or raised (named with its exit status and
            last lines, or its exception and traceback), a script the executor cannot see, ...
        ConfigError, DataError: bad arguments or data, before anything launches.
    """
    launch_target = _target(target, args, max_failures)
    settings = RunSettings.from_arguments(
        {name: value for name, value in locals().items() if name not in ("target", "args", "launch_target")},
        with_data=data is not None,
    )
    # The session's settings that rule the launch out (dynamic allocation...), in under a second.
    check_session(spark or getattr(data, "sparkSession", None))
    if getattr(data, "sparkSession", None) is not None:
        warm_up(data.sparkSession, num_workers)
    dataset = spec = data_reader = steps = None
    if settings.data is not None:
        dataset, spec, data_reader, steps = prepare_data(
            data, settings.data, num_workers, spark, task_cpus=settings.launch.task_cpus
        )
    display = ProgressDisplay(enabled=bool(progress), callback=progress if callable(progress) else None)
    outcome = _launch_stage(
        launch_target,
        settings.launch,
        settings.strategy,
        spark=spark,
        dataset=dataset,
        data_spec=spec,
        reader=data_reader,
        steps_per_epoch=steps,
        display=display,
    )
    return outcome.value


def _target(target: Any, args: Sequence[Any], max_failures: Any) -> LaunchTarget:
    run_id = f"sparkdl-{uuid.uuid4().hex[:12]}"
    restarts = max_failures if isinstance(max_failures, int) else 0
    if isinstance(target, (str, os.PathLike)):
        path = os.fspath(target)
        if not path.endswith(".py"):
            raise ConfigError(f"target={path!r}: sparkdl.launch runs a Python script (a .py path) or a callable")
        bad = [a for a in args if not isinstance(a, (str, int, float)) or isinstance(a, bool)]
        if bad:
            raise ConfigError(f"script arguments must be strings or numbers (they become its argv); got {bad!r}")
        local = os.path.abspath(path) if os.path.isfile(path) else None
        return LaunchTarget(
            "script",
            path,
            run_id,
            script=path,
            script_abspath=local,
            args=tuple(str(a) for a in args),
            max_restarts=restarts,
        )
    if callable(target):
        import cloudpickle

        name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
        try:
            pickled = cloudpickle.dumps((target, tuple(args)))
        except Exception as exc:  # noqa: BLE001 - named in the user's terms
            raise ConfigError(f"sparkdl.launch cannot pickle the function {name} or its arguments: {exc}") from exc
        return LaunchTarget("callable", name, run_id, pickled=pickled, max_restarts=restarts)
    raise ConfigError(f"target={target!r} must be a path to a Python script or a callable")
