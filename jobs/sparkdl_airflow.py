"""Airflow operators that run sparkdl jobs with spark-submit and hand their metrics to XCom.

Copy this file next to your DAG (Airflow puts the DAGs folder on ``sys.path``) and
``from sparkdl_airflow import SparkdlTrainOperator, SparkdlPredictOperator``. It imports only
Airflow and the standard library: the Airflow worker needs neither sparkdl nor torch nor pyspark,
only a ``spark-submit`` (on PATH, or ``spark_submit=``) that reaches the cluster, as in
production, where Airflow workers and Spark clusters are separate machines. See
``jobs/airflow_dag.py`` for a whole DAG and docs/deploy.md for the walk-through.

* The job's output (``metrics.json``: status, per-epoch history, per-rank throughput, run info)
  becomes the task's XCom ``return_value``.
* A failed job (non-zero exit) fails the task with the job's one-paragraph error. A metrics.json
  left in ``output_dir`` by an earlier try is deleted before each try starts.
* Killing the task (Airflow sends the task process SIGTERM: a timeout, "mark failed") stops
  spark-submit, its driver and their children: spark-submit runs in a session of its own, whose
  process group gets SIGTERM, then SIGKILL after ``kill_grace_seconds``.
* With ``checkpoint_dir`` templated per DAG run (e.g. ``.../ckpt/{{ run_id }}``), an Airflow
  retry of the task resumes from the last checkpoint, and re-running a finished run returns its
  model without training again (``from_finished_checkpoint``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import deque
from typing import Any, Dict, List, Optional, Sequence

from airflow.exceptions import AirflowException
from airflow.models import BaseOperator

HERE = os.path.dirname(os.path.abspath(__file__))


class _SparkdlSubmitOperator(BaseOperator):
    """spark-submit one sparkdl job (``application``) and return its metrics.json.

    ``output_dir`` is the job's ``--output`` (where metrics.json lands); ``arguments`` are the
    job's other options without dashes (``{"epochs": 5}`` -> ``--epochs 5``; True -> a bare flag).
    ``kill_grace_seconds``: how long a killed task waits for spark-submit to exit after SIGTERM
    before it SIGKILLs the process group (keep it under Airflow's ``killed_task_cleanup_time``, 60 s).
    """

    template_fields: Sequence[str] = ("master", "spark_submit", "application", "py_files", "conf", "env", "output_dir", "arguments")
    ui_color = "#f7c8a0"

    def __init__(
        self,
        *,
        output_dir: str,
        arguments: Optional[Dict[str, Any]] = None,
        master: str = "local[2]",
        spark_submit: str = "spark-submit",
        application: Optional[str] = None,
        py_files: Sequence[str] = (),
        conf: Optional[Dict[str, Any]] = None,
        env: Optional[Dict[str, str]] = None,
        kill_grace_seconds: float = 20.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.output_dir = output_dir
        self.arguments = dict(arguments or {})
        self.master = master
        self.spark_submit = spark_submit
        self.application = application
        self.py_files = list(py_files)
        self.conf = dict(conf or {})
        self.env = dict(env or {})
        self.kill_grace_seconds = float(kill_grace_seconds)
        self._process: Optional[subprocess.Popen] = None

    def command(self) -> List[str]:
        cmd = [self.spark_submit, "--master", self.master]
        for key, value in sorted(self.conf.items()):
            cmd += ["--conf", f"{key}={value}"]
        files = [f for f in self.py_files if f]
        if files:
            cmd += ["--py-files", ",".join(files)]
        cmd.append(self.application)
        for key, value in self.arguments.items():
            if value is None or value is False:
                continue
            flag = "--" + key.replace("_", "-")
            cmd += [flag] if value is True else [flag, str(value)]
        return cmd + ["--output", self.output_dir]

    def execute(self, context: Any) -> Dict[str, Any]:
        metrics_path = os.path.join(self.output_dir, "metrics.json")
        if os.path.exists(metrics_path):  # never report a previous try's metrics as this one's
            os.remove(metrics_path)
        cmd = self.command()
        self.log.info("Running: %s", " ".join(cmd))
        tail: deque = deque(maxlen=40)
        self._process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **self.env},
            start_new_session=True,
        )
        assert self._process.stdout is not None
        for line in self._process.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            self.log.info("%s", line)
        code = self._process.wait()
        metrics = _read_json(metrics_path)
        if code != 0:
            error = (metrics or {}).get("error") or "\n".join(tail)
            raise AirflowException(f"sparkdl job failed (spark-submit exit {code}): {error}")
        if metrics is None:
            raise AirflowException(f"spark-submit exited 0 but wrote no {metrics_path}")
        return self.summary(metrics)

    def summary(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        return {**metrics, "metrics_path": os.path.join(self.output_dir, "metrics.json")}

    def on_kill(self) -> None:
        """Airflow killing the task (timeout, mark failed) stops spark-submit and its driver: SIGTERM
        to spark-submit's process group, SIGKILL if it is still running after the grace period."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=self.kill_grace_seconds)
        except subprocess.TimeoutExpired:
            self.log.warning("spark-submit (pid %d) outlived SIGTERM by %.0f s; sending SIGKILL", process.pid, self.kill_grace_seconds)
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()


class SparkdlTrainOperator(_SparkdlSubmitOperator):
    """Trains with ``jobs/train.py`` (= ``sparkdl train``); XCom: a summary of metrics.json.

    ``arguments`` are the job's options without the dashes (``{"data": ..., "model":
    "models:make_model", "epochs": 5, "checkpoint_dir": ...}``); every value is templated.
    """

    def __init__(self, *, application: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(application=application or os.path.join(HERE, "train.py"), **kwargs)

    def summary(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        history = metrics.get("history") or []
        run = metrics.get("run") or {}
        return {
            "status": metrics.get("status"),
            "model": os.path.join(self.output_dir, "model"),
            "metrics_path": os.path.join(self.output_dir, "metrics.json"),
            "epochs": [r.get("epoch") for r in history],
            "final_loss": history[-1].get("loss") if history else None,
            "history": history,
            "throughput": metrics.get("throughput"),
            "resumed_at_step": (run.get("steps") or {}).get("resumed_at"),
            "from_finished_checkpoint": run.get("from_finished_checkpoint"),
            "attempts": len(run.get("attempts") or []),
            "tracking": run.get("tracking"),
            "wall_seconds": metrics.get("wall_seconds"),
        }


class SparkdlPredictOperator(_SparkdlSubmitOperator):
    """Predicts with ``jobs/predict.py`` (= ``sparkdl predict``); with a ``label`` argument the
    XCom holds the evaluation, and ``fail_below={"accuracy": 0.9}`` fails the task under it."""

    template_fields: Sequence[str] = (*_SparkdlSubmitOperator.template_fields, "fail_below")

    def __init__(self, *, application: Optional[str] = None, fail_below: Optional[Dict[str, float]] = None, **kwargs: Any) -> None:
        super().__init__(application=application or os.path.join(HERE, "predict.py"), **kwargs)
        self.fail_below = dict(fail_below or {})

    def summary(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        evaluation = metrics.get("evaluation") or {}
        for name, floor in self.fail_below.items():
            value = evaluation.get(name)
            if value is None or value < float(floor):
                raise AirflowException(f"{name} = {value} is below the required {floor} (predictions in {metrics.get('predictions')})")
        return {k: metrics.get(k) for k in ("status", "rows", "evaluation", "predictions", "model", "wall_seconds")}


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the whole group has exited already
        pass


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
