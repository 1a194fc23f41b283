"""Optional run tracking on the driver: MLflow and TensorBoard.

``TorchEstimator(mlflow_experiment="digits", tensorboard_dir="/runs/tb")`` (or the CLI's
``--mlflow-experiment`` / ``--tensorboard-dir``) records:

* MLflow: the run's parameters (estimator settings, strategy, dataset), every epoch's numeric
  metrics (``step`` = epoch) as they arrive from rank 0, the trained model as an **MLflow model**
  named ``model`` (:func:`log_model`: pyfunc with a signature, registered under
  ``mlflow_registered_model_name`` when given) and tags ``sparkdl.status``; a failed fit ends the
  MLflow run as FAILED. Where the run goes is MLflow's choice: ``MLFLOW_TRACKING_URI`` (a server
  ``http://...``, or a ``file:`` store, which MLflow 3.x only accepts with
  ``MLFLOW_ALLOW_FILE_STORE=true``), else MLflow's default.
* TensorBoard: one scalar per numeric epoch metric (``epoch/loss``, ``epoch/samples_per_sec``...;
  each rank's throughput as ``rank/<r>/samples_per_sec``), written with
  ``torch.utils.tensorboard`` into ``tensorboard_dir``.

A model trained elsewhere (``sparkdl.run``, ``sparkdl.launch``) is logged the same way:
``log_model(TorchModel.from_state(state, model=make_model, example=df))``.

Both run only on the driver: executors need neither package (``mlflow.pyfunc.spark_udf`` of a
logged model needs mlflow on the executors, as for any MLflow model). Install them with
``pip install 'sparkdl-torch[tracking]'`` (mlflow-skinny and tensorboard, checked against the pinned stack).
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import threading
from typing import Any, Callable, Dict, List, Optional

from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl")

_RANK_KEY = re.compile(r"rank(\d+)_(.+)")  # per-rank figures: rank0_samples_per_sec -> rank/0/samples_per_sec

INSTALL_HINT = "pip install 'sparkdl-torch[tracking]' (mlflow-skinny and tensorboard)"


def check_available(mlflow_experiment: Optional[str], tensorboard_dir: Optional[str]) -> None:
    """Fails at construction, not after training, when a requested tracker is not installed."""
    if mlflow_experiment is not None:
        if not isinstance(mlflow_experiment, str) or not mlflow_experiment.strip():
            raise ConfigError(f"mlflow_experiment={mlflow_experiment!r} must be a non-empty experiment name")
        try:
            import mlflow  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"mlflow_experiment is set but MLflow is not importable ({exc}): {INSTALL_HINT}") from exc
    if tensorboard_dir is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"tensorboard_dir is set but TensorBoard is not importable ({exc}): {INSTALL_HINT}"
            ) from exc


def numeric_metrics(record: Dict[str, Any]) -> Dict[str, float]:
    """The finite numeric values of an epoch record (not ``epoch`` itself, lists or strings)."""
    out = {}
    for key, value in record.items():
        if key == "epoch" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


class Tracker:
    """Fans a fit's events out to the configured backends; a no-op when none is configured.

    Epochs are logged live (from the progress channel) and again from the final history at
    :meth:`finish`, each epoch once: a run resumed from a checkpoint, or one that returns a
    finished run's stored model, still ends with every epoch logged.
    """

    def __init__(
        self,
        mlflow_experiment: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        registered_model_name: Optional[str] = None,
    ) -> None:
        self.mlflow_experiment = mlflow_experiment
        self.tensorboard_dir = tensorboard_dir
        self.registered_model_name = registered_model_name
        self._mlflow = None
        self._mlflow_run = None
        self._writer = None
        self._logged: set = set()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.mlflow_experiment is not None or self.tensorboard_dir is not None

    def start(self, params: Dict[str, Any]) -> None:
        if self.mlflow_experiment is not None:
            import mlflow

            try:
                # Not mlflow.set_experiment: that would leave the experiment active for the
                # caller's own later runs and models.
                experiment = mlflow.get_experiment_by_name(self.mlflow_experiment)
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else mlflow.create_experiment(self.mlflow_experiment)
                )
                self._mlflow_run = mlflow.start_run(experiment_id=experiment_id)
            except Exception as exc:  # noqa: BLE001 - an unusable store is a setting to fix, before training
                raise ConfigError(
                    f"MLflow tracking at {mlflow.get_tracking_uri()!r} failed: {type(exc).__name__}: {exc}. "
                    f"Set MLFLOW_TRACKING_URI to a server (http://host:5000), a database your MLflow supports, or "
                    f"a file: store with MLFLOW_ALLOW_FILE_STORE=true"
                ) from exc
            self._mlflow = mlflow
            flat = {k: _param(v) for k, v in _flatten(params).items()}
            for start in range(0, len(flat), 100):  # MLflow caps a batch at 100 params
                mlflow.log_params(dict(list(flat.items())[start : start + 100]))
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.tensorboard_dir)
            self._writer.add_text(
                "sparkdl/params", "\n".join(f"    {k}: {v}" for k, v in sorted(_flatten(params).items())), 0
            )

    def epoch(self, record: Dict[str, Any]) -> None:
        """One epoch record (safe to call from the progress channel's thread)."""
        epoch = record.get("epoch")
        if not isinstance(epoch, int):
            return
        with self._lock:
            if epoch in self._logged:
                return
            self._logged.add(epoch)
            values = numeric_metrics(record)
            if self._mlflow is not None:
                self._mlflow.log_metrics(values, step=epoch, run_id=self._mlflow_run.info.run_id)
            if self._writer is not None:
                for key, value in values.items():
                    match = _RANK_KEY.fullmatch(key)
                    tag = f"rank/{match.group(1)}/{match.group(2)}" if match else f"epoch/{key}"
                    self._writer.add_scalar(tag, value, epoch)
                self._writer.flush()

    def callback(self, user: Optional[Callable[[Dict[str, Any]], Any]]) -> Optional[Callable[[Dict[str, Any]], Any]]:
        """A progress callback that feeds the trackers and then ``user`` (if any)."""
        if not self.enabled:
            return user

        def on_record(record: Dict[str, Any]) -> None:
            if "epoch" in record and "rank" not in record:  # epoch records, not ctx.report(...) metrics
                try:
                    self.epoch(record)
                except Exception:  # noqa: BLE001 - tracking must not kill a run; finish() logs again
                    logger.exception("sparkdl: tracking an epoch failed")
            if user is not None:
                user(record)

        return on_record

    def finish(self, model: Any) -> Dict[str, Any]:
        """Logs what is still missing (epochs, the MLflow model), closes the run; returns ids
        for ``run_info["tracking"]``."""
        for record in model.history:
            self.epoch(record)
        info: Dict[str, Any] = {}
        if self._mlflow is not None:
            mlflow, run_id = self._mlflow, self._mlflow_run.info.run_id
            info.update(
                mlflow_run_id=run_id,
                mlflow_experiment_id=self._mlflow_run.info.experiment_id,
                mlflow_tracking_uri=mlflow.get_tracking_uri(),
            )
            try:
                logged = log_model(model, registered_model_name=self.registered_model_name, run_id=run_id)
                info.update(mlflow_model_uri=logged.model_uri)
                if self.registered_model_name is not None:
                    info["mlflow_registered_model"] = {
                        "name": self.registered_model_name,
                        "version": logged.registered_model_version,
                    }
                mlflow.set_tag("sparkdl.status", "succeeded")
            except Exception as exc:  # noqa: BLE001 - the trained model must reach the caller all the same
                logger.exception("sparkdl: logging the model to MLflow failed")
                info["mlflow_error"] = f"{type(exc).__name__}: {exc}"
            finally:
                self._mlflow = None
                try:
                    mlflow.end_run("FINISHED")
                except Exception:  # noqa: BLE001
                    logger.exception("sparkdl: closing the MLflow run failed")
        if self._writer is not None:
            self._writer.close()
            info["tensorboard_dir"] = self.tensorboard_dir
            self._writer = None
        return info

    def fail(self, exc: BaseException) -> None:
        """Ends the run as failed; never raises (the training error is what matters)."""
        try:
            if self._mlflow is not None:
                self._mlflow.set_tag("sparkdl.status", "failed")
                self._mlflow.set_tag("sparkdl.error", f"{type(exc).__name__}: {exc}"[:5000])
                self._mlflow.end_run("FAILED")
                self._mlflow = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        except Exception:  # noqa: BLE001
            logger.exception("sparkdl: closing the tracking run failed")


def log_model(
    model: Any,
    name: str = "model",
    registered_model_name: Optional[str] = None,
    run_id: Optional[str] = None,
    example: Any = None,
) -> Any:
    """Logs a ``TorchModel`` as an MLflow model: ``mlflow.pyfunc.load_model(uri).predict(df)``
    and ``mlflow.pyfunc.spark_udf(spark, uri)`` then predict as ``model.transform`` does (a
    ``double`` per row for one output, else ``array<double>``), and ``load_model(uri)`` gives the
    ``TorchModel`` back. The model's directory holds ``MLmodel``, the signature (the input
    columns' types as training saw them, and the prediction column) and ``torch_model/``, a
    :meth:`TorchModel.save` directory.

    Args:
        model: the ``TorchModel`` (fitted, loaded, or from ``TorchModel.from_state``).
        name: the logged model's name (MLflow 3; the artifact path under MLflow 2).
        registered_model_name: also register it in MLflow's model registry under this name
            (a new version each call; ``models:/<name>/<version>`` loads it).
        run_id: the run it belongs to; default: the active run, if any.
        example: a few input rows (Spark or pandas DataFrame), for a model that does not record
            its input columns' types (``TorchModel.from_state`` without ``example``).

    Returns:
        MLflow's ``ModelInfo``: ``model_uri``, ``registered_model_version``, ...

    Raises:
        ConfigError: the model's input columns are unknown (pass ``example``), or a column type
            has no MLflow signature type.
    """
    from sparkdl._persistence import mlflow_flavor

    return mlflow_flavor.log_model(
        model, name=name, registered_model_name=registered_model_name, run_id=run_id, example=example
    )


def load_model(model_uri: str) -> Any:
    """The ``TorchModel`` of a model :func:`log_model` logged (``models:/<name>/<version>``,
    ``models:/<model id>``, ``runs:/<run id>/model`` or a local path). Unpickles the model
    factory saved with it: load only models you trust."""
    from sparkdl._persistence import mlflow_flavor

    return mlflow_flavor.load_model(model_uri)


def _flatten(params: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _param(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    text = str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def describe_callable(fn: Any) -> str:
    """``module:qualname`` of a factory, or its type for other callables (for params)."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{name}" if module else str(name)


__all__: List[str] = ["Tracker", "check_available", "numeric_metrics", "describe_callable", "log_model", "load_model"]
