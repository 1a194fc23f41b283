"""SparkdlTrainOperator and SparkdlPredictOperator: the Apache Spark provider's
``SparkSubmitOperator`` running ``sparkdl train`` / ``sparkdl predict``.

Spark is configured as Airflow users configure it for every Spark job: an Airflow connection
(``conn_id``, default ``spark_default``: master, deploy mode, queue, spark-binary), with templated
``conf``, ``py_files``, ``env_vars`` and the provider's YARN / Kubernetes application tracking and
kill. What these operators add:

* the job's options as a dict (``arguments={"data": ..., "epochs": 5}`` -> ``--data ... --epochs 5``;
  ``True`` -> a bare flag), every value templated, and ``output_dir`` (the job's ``--output``);
* the job's ``metrics.json`` (status, per-epoch history, per-rank throughput, run info) as the
  task's XCom, summarized; a metrics.json left in ``output_dir`` by an earlier try is deleted
  before each try, so a try cannot report another's figures;
* a failed job fails the task with the job's own reason from its metrics.json (its first
  lines), not spark-submit's command line; a usage error (the job's exit 2, ``error_kind``
  "usage"), an ``output_dir`` the worker cannot read, or an evaluation under ``fail_below`` fails
  it without retries (``AirflowFailException``), since a retry would fail the same way; a
  spark-submit that failed before the job wrote its metrics.json fails it with the last lines
  of spark-submit's output;
* killing the task (a timeout, "mark failed": Airflow calls ``on_kill``) stops spark-submit, its
  driver and their children: spark-submit runs in a session of its own whose process group gets
  SIGTERM, then SIGKILL after ``kill_grace_seconds`` (from a reaper process, as Airflow 3 SIGKILLs
  the task's own process 5 s after its SIGTERM); the provider's own kill (YARN application,
  Kubernetes driver pod, standalone cluster driver) follows. This holds when Airflow's SIGTERM
  lands on a thread other than the task's main thread, when the job prints nothing more, when
  its handler interrupts the logging of a line, and when the kill comes before spark-submit has
  started, which then never starts (session_hook.py says how).

``output_dir`` must be readable by the Airflow worker for the XCom: a local path (client mode),
shared storage mounted on the worker, or a URL read through fsspec (metrics_file.py); with
``checkpoint_dir`` templated per DAG run (``.../ckpt/{{ run_id }}``, its ':' and '+' replaced), an
Airflow retry resumes from the last checkpoint.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from sparkdl_airflow import metrics_file
from sparkdl_airflow.entry import PREDICT, TRAIN
from sparkdl_airflow.session_hook import NotSubmitted, SessionSparkSubmitHook

USAGE_ERROR = 2  # sparkdl train/predict: bad options; retrying cannot help
#: How much of a failure the task's error shows: the job's reason, or spark-submit's output.
ERROR_LINES = 20
OUTPUT_TAIL_LINES = 25


class _SparkdlJobOperator(SparkSubmitOperator):
    """spark-submit one sparkdl job and return a summary of its metrics.json."""

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "output_dir", "arguments")
    template_fields_renderers = {"arguments": "json", "conf": "json"}
    ui_color = "#f7c8a0"
    default_application = ""

    def __init__(
        self,
        *,
        output_dir: str,
        arguments: Optional[Dict[str, Any]] = None,
        application: Optional[str] = None,
        kill_grace_seconds: float = 20.0,
        **kwargs: Any,
    ) -> None:
        if "application_args" in kwargs:
            raise ValueError(
                f"{type(self).__name__} takes the job's options as arguments={{...}}, not application_args"
            )
        kwargs.setdefault("name", "sparkdl-{{ task.task_id }}")
        super().__init__(application=application or self.default_application, **kwargs)
        self.output_dir = output_dir
        self.arguments = dict(arguments or {})
        self.kill_grace_seconds = float(kill_grace_seconds)

    def job_arguments(self) -> List[str]:
        """The job's command line after the application: ``arguments`` as flags, then ``--output``."""
        args: List[str] = []
        for key, value in self.arguments.items():
            if value is None or value is False:
                continue
            flag = "--" + key.replace("_", "-")
            if value is True:
                args.append(flag)
            elif isinstance(value, (list, tuple)):  # a repeatable option: --metric a --metric b
                for item in value:
                    args += [flag, str(item)]
            else:
                args += [flag, str(value)]
        return args + ["--output", self.output_dir]

    def _get_hook(self) -> SparkSubmitHook:
        hook = super()._get_hook()
        hook.__class__ = SessionSparkSubmitHook  # the same hook, with spark-submit in a session of its own
        hook.kill_grace_seconds = self.kill_grace_seconds
        hook.task_killed = self._was_killed
        return hook

    def on_kill(self) -> None:
        # Airflow's SIGTERM handler calls this and lets the task go on: the kill is recorded first,
        # so that a spark-submit not started yet never starts (session_hook.py). Without a hook
        # nothing was submitted, and building one here would fetch the connection inside the handler.
        self._killed = True
        if self._hook is not None:
            super().on_kill()

    def _was_killed(self) -> bool:
        return getattr(self, "_killed", False)

    @property
    def metrics_path(self) -> str:
        return metrics_file.join(self.output_dir, "metrics.json")

    def execute(self, context: Any) -> Dict[str, Any]:
        try:
            metrics_file.check_readable(self.output_dir)
        except ValueError as exc:  # bad configuration: a retry would fail the same way
            raise AirflowFailException(str(exc)) from None
        metrics_file.remove(self.metrics_path)  # never report a previous try's metrics as this one's
        self.application_args = self.job_arguments()
        self._hook = None  # built afresh per try, from the rendered fields
        try:
            super().execute(context)
        except NotSubmitted:
            raise  # no job ran: neither metrics nor an exit status to report
        except AirflowException:
            # from None: the provider's exception says only spark-submit's command line (logged
            # when it started) and exit code; the job's own reason is what the task shows.
            raise self._failure(metrics_file.read(self.metrics_path)) from None
        metrics = metrics_file.read(self.metrics_path)
        if metrics is None:
            raise AirflowException(
                f"spark-submit exited 0 but wrote no {self.metrics_path} (is output_dir readable by the Airflow worker?)"
            )
        if metrics.get("status") == "failed":  # cluster deploy mode: spark-submit may exit 0 for a failed driver
            raise self._failure(metrics)
        return self.summary(metrics)

    def _failure(self, metrics: Optional[Dict[str, Any]]) -> AirflowException:
        """The exception that fails this try: the job's reason from its metrics.json, or, when
        the job wrote none (spark-submit failed before it ran, or the driver was killed), the tail
        of spark-submit's output. A usage error (bad arguments) is not retried."""
        code = getattr(getattr(self._hook, "_submit_sp", None), "returncode", None)
        if metrics is None or not metrics.get("error"):
            tail = "\n".join(list(getattr(self._hook, "_last_submit_log_lines", None) or [])[-OUTPUT_TAIL_LINES:])
            usage = code == USAGE_ERROR  # client mode: spark-submit exits with the driver's code
            failure = AirflowFailException if usage else AirflowException
            what = ", a usage error: not retried" if usage else ""
            return failure(
                f"sparkdl job failed (spark-submit exit {code}{what}) before writing {self.metrics_path}; "
                f"spark-submit's last lines:\n{tail or '(none)'}"
            )
        exit_code = metrics.get("exit_code", code)
        reason = _first_lines(str(metrics["error"]), self.metrics_path)
        if metrics.get("error_kind") == "usage" or exit_code == USAGE_ERROR:
            return AirflowFailException(f"sparkdl job failed (exit {exit_code}, a usage error: not retried): {reason}")
        return AirflowException(f"sparkdl job failed (exit {exit_code}): {reason}")

    def summary(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        return {**metrics, "metrics_path": self.metrics_path}


class SparkdlTrainOperator(_SparkdlJobOperator):
    """Trains with ``sparkdl train``; XCom: the final figures, the model's path, the history,
    per-rank throughput, and where the run resumed.

    ``arguments`` are ``sparkdl train``'s options without the dashes (``{"data": ..., "model":
    "models:make_model", "epochs": 5, "validation": 0.2, "metric": ["accuracy"], "checkpoint_dir":
    ...}``); ``py_files`` ships the model's module to the executors.
    """

    default_application = TRAIN

    def summary(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        history = metrics.get("history") or []
        run = metrics.get("run") or {}
        last = history[-1] if history else {}
        return {
            "status": metrics.get("status"),
            "model": metrics_file.join(self.output_dir, "model"),
            "metrics_path": self.metrics_path,
            "epochs": [r.get("epoch") for r in history],
            "final_loss": last.get("loss"),
            "final_validation": {k: v for k, v in last.items() if k.startswith("val_") and k != "val_samples"},
            "history": history,
            "throughput": metrics.get("throughput"),
            "resumed_at_step": (run.get("steps") or {}).get("resumed_at"),
            "from_finished_checkpoint": run.get("from_finished_checkpoint"),
            "attempts": len(run.get("attempts") or []),
            "tracking": run.get("tracking"),
            "wall_seconds": metrics.get("wall_seconds"),
        }


class SparkdlPredictOperator(_SparkdlJobOperator):
    """Predicts with ``sparkdl predict``; with a ``label`` argument the XCom holds the evaluation,
    and ``fail_below={"accuracy": 0.9}`` fails the task (without retries) under it."""

    template_fields: Sequence[str] = (*_SparkdlJobOperator.template_fields, "fail_below")
    default_application = PREDICT

    def __init__(self, *, fail_below: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_below = dict(fail_below or {})

    def summary(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        evaluation = metrics.get("evaluation") or {}
        for name, floor in self.fail_below.items():
            value = evaluation.get(name)
            if value is None:
                raise AirflowFailException(
                    f"fail_below names {name!r}, but the evaluation has only {sorted(evaluation)} (is label set?)"
                )
            if value < float(floor):
                raise AirflowFailException(
                    f"{name} = {value:.4f} is below the required {float(floor)} (predictions in {metrics.get('predictions')})"
                )
        return {k: metrics.get(k) for k in ("status", "rows", "evaluation", "predictions", "model", "wall_seconds")}


def _first_lines(error: str, metrics_path: str) -> str:
    """The first ERROR_LINES lines of the job's error; where the rest is, when it is longer."""
    lines = error.strip().splitlines()
    if len(lines) <= ERROR_LINES:
        return "\n".join(lines)
    return "\n".join(lines[:ERROR_LINES] + [f"... ({len(lines) - ERROR_LINES} more lines: 'error' in {metrics_path})"])
