"""Airflow 3 with the Apache Spark provider, driving the real spark-submit against local[2].

Airflow lives in its own virtualenv (.venv-airflow, built by scripts/bootstrap-airflow before
pytest starts, pinned by scripts/airflow-constraints.txt) with sparkdl's operators installed as a
slim worker installs them (``--no-deps``: no torch there), as an Airflow worker is apart from the
Spark cluster in production. Spark is configured the Airflow way, as the ``spark_default``
connection. The example DAG is deployed as docs/deploy.md says: its file, alone, in the DAGs
folder, and run with the real ``airflow dags test``. Its model's first attempt dies in epoch 2
(after the checkpoint of epoch 1): the train task's first try fails, Airflow retries it, and the
retry resumes from that checkpoint instead of starting over.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Optional

import pytest

from sparkdl_airflow.reaper import live_processes
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

TRAIN_ROWS, HELD_OUT_ROWS = 1437, 360  # prepare_data's split of the 1,797 digits (holdout 0.2)

FLAKY_MODEL = '''
"""The digits MLP, except that the first process to reach epoch 2 dies (once per marker file)."""
import os
import torch

MARKER = {marker!r}
STEPS_PER_EPOCH = {steps}


class FlakyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.calls = 0

    def forward(self, x):
        if self.training:  # validation passes do not count as steps
            self.calls += 1
            if self.calls > STEPS_PER_EPOCH and not os.path.exists(MARKER):
                open(MARKER, "w").close()
                raise RuntimeError("injected failure in epoch 2")
        return self.net(x)


def make_model():
    return FlakyMLP()
'''

# What the run left in Airflow's metadata DB: each task's state and tries, and the XComs.
RUN_RESULT = """
import json
from airflow.models import DagRun
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session

with create_session() as session:
    run = session.query(DagRun).filter(DagRun.dag_id == "sparkdl_digits").order_by(DagRun.id.desc()).first()
    tis = {ti.task_id: {"state": str(ti.state), "try_number": ti.try_number} for ti in run.get_task_instances(session=session)}

    def xcom(task_id):
        row = session.scalars(XComModel.get_many(run_id=run.run_id, dag_ids="sparkdl_digits", task_ids=task_id, key="return_value")).first()
        return XComModel.deserialize_value(row) if row is not None else None

    print("RESULT " + json.dumps({"run_id": run.run_id, "state": str(run.state), "tasks": tis, "train": xcom("train"), "evaluate": xcom("evaluate")}, default=str))
"""


def _live_processes():
    """pid -> (session id, command line) of every live (not zombie) process."""
    found = {}
    for pid, (_, session) in live_processes().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                found[pid] = (session, handle.read().replace(b"\0", b" ").decode(errors="replace").strip())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _session_processes(sid):
    """pid -> command line of every live process in session ``sid``."""
    return {pid: cmdline for pid, (session, cmdline) in _live_processes().items() if session == sid}


def _kill_everything_of(marker, sids=()):
    """SIGKILLs the sessions ``sids`` and those of every process whose command line names
    ``marker`` (a test's own directory): a failed test leaves nothing running."""
    live = _live_processes()
    doomed = set(sids) | {session for session, cmdline in live.values() if marker in cmdline}
    for pid, (session, _) in live.items():
        if session in doomed and session != os.getsid(0):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_exited(pids, timeout):
    """Waits on pidfds until every process in ``pids`` has exited; returns those still running."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    try:
        while fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(fds), [], [], deadline - time.monotonic())
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture(scope="module")
def airflow_python():
    """.venv-airflow's interpreter. scripts/test builds it with scripts/bootstrap-airflow before
    pytest starts; here it is only checked (``--check`` installs nothing)."""
    result = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, "scripts", "bootstrap-airflow"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory, airflow_python):
    """An Airflow worker's environment: a migrated SQLite metadata DB, a DAGs folder holding only
    the example DAG's file (as docs/deploy.md deploys it), Spark as the ``spark_default``
    connection, and .venv's spark-submit on PATH (where a worker has its Spark client)."""
    home = tmp_path_factory.mktemp("airflow-home")
    dags = home / "dags"
    dags.mkdir()
    shutil.copy(os.path.join(REPO_ROOT, "jobs", "airflow_dag.py"), dags / "airflow_dag.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "AIRFLOW", "PYSPARK")) and k != "PYTEST_CURRENT_TEST"
    }
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW_CONN_SPARK_DEFAULT=json.dumps({"conn_type": "spark", "host": "local[2]"}),
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        SPARKDL_PYTHON=sys.executable,  # .venv: the interpreter with sparkdl that the driver and executors run
        SPARKDL_EXAMPLES=os.path.join(REPO_ROOT, "examples"),
        SPARKDL_AIRFLOW_RETRY_DELAY_S="0",
        SPARK_LOCAL_IP="127.0.0.1",
    )
    airflow_bin = os.path.join(os.path.dirname(airflow_python), "airflow")
    migrate = subprocess.run([airflow_bin, "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stdout[-2000:] + migrate.stderr[-2000:]
    return env


def _airflow(airflow_python, airflow_env, *args, timeout=600):
    """The real ``airflow`` command of .venv-airflow; returns (exit code, stdout and stderr in order)."""
    airflow_bin = os.path.join(os.path.dirname(airflow_python), "airflow")
    done = subprocess.run(
        [airflow_bin, *args],
        env=airflow_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout


def _json_list(output):
    """The JSON list a ``--output json`` command printed (its log lines come around it)."""
    lines = [line for line in output.splitlines() if line.startswith("[{") or line.strip() == "[]"]
    assert lines, output[-3000:]
    return json.loads(lines[-1])


def _run(airflow_python, airflow_env, script, cwd, timeout=600):
    """Runs ``script`` in .venv-airflow; returns (its RESULT document or None, all its output)."""
    result = subprocess.run(
        [airflow_python, "-u", str(script)],
        env=airflow_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        cwd=str(cwd),
    )
    output = result.stdout  # stderr merged in (both unbuffered), so that the log keeps its order
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1][len("RESULT ") :]) if lines else None), output


def test_the_operators_need_neither_torch_nor_pyspark_and_airflow_lists_the_provider(airflow_python, airflow_env):
    probe = "import importlib.util, sys, sparkdl_airflow\nfrom sparkdl_airflow import SparkdlTrainOperator\nprint(importlib.util.find_spec('torch') is None, 'pyspark' in sys.modules)"
    done = subprocess.run([airflow_python, "-c", probe], env=airflow_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["True", "False"], done.stdout + done.stderr[-2000:]
    code, listed = _airflow(airflow_python, airflow_env, "providers", "list", "--output", "json")
    assert code == 0, listed[-2000:]
    providers = {p["package_name"]: p for p in _json_list(listed)}
    assert "sparkdl-torch" in providers and "apache-airflow-providers-apache-spark" in providers, sorted(providers)
    code, errors = _airflow(airflow_python, airflow_env, "dags", "list-import-errors", "--output", "json")
    assert code == 0 and _json_list(errors) == [], errors[-3000:]  # the DAG file alone parses


def test_the_dags_templates_need_only_what_every_run_has(airflow_python, airflow_env):
    """Runs started by ``airflow dags trigger`` have no logical date in Airflow 3: every template
    of the example DAG may use only what every run's context holds (``ds``, ``ts_nodash`` and the
    like would fail such runs with ``UndefinedError``)."""
    probe = """
import json, os
from jinja2 import Environment, meta
from airflow.dag_processing.dagbag import DagBag

dag = DagBag(os.environ["AIRFLOW__CORE__DAGS_FOLDER"]).get_dag("sparkdl_digits")
env, found = Environment(), set()

def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings(item)

for task in dag.tasks:
    for field in task.template_fields:
        for text in strings(getattr(task, field)):
            found |= meta.find_undeclared_variables(env.parse(text))
print("RESULT " + json.dumps(sorted(found)))
"""
    done = subprocess.run([airflow_python, "-c", probe], env=airflow_env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    assert set(json.loads(lines[-1][len("RESULT ") :])) == {"params", "run_id", "ti", "task"}


def test_airflow_dags_test_trains_on_spark_retries_from_the_checkpoint_and_evaluates_held_out_rows(
    tmp_path, airflow_python, airflow_env
):
    root = tmp_path / "root"
    import numpy as np

    from sparkdl.data.selection import holdout_mask

    validation_rows = int(
        holdout_mask(np.arange(TRAIN_ROWS), 0.1).sum()
    )  # the DAG's validation=0.1 of the training split
    steps_per_epoch = (TRAIN_ROWS - validation_rows) // (2 * 32)  # rows it trains on // (num_workers * batch_size)
    (tmp_path / "flaky.py").write_text(FLAKY_MODEL.format(marker=str(tmp_path / "failed-once"), steps=steps_per_epoch))
    conf = {
        "root": str(root),
        "model_file": str(tmp_path / "flaky.py"),
        "model": "flaky:make_model",
        "epochs": 3,
        "min_accuracy": 0.8,
    }
    code, output = _airflow(
        airflow_python, airflow_env, "dags", "test", "sparkdl_digits", "--conf", json.dumps(conf), timeout=900
    )
    assert code == 0, output[-6000:]
    (tmp_path / "result.py").write_text(RUN_RESULT)
    outcome, text = _run(airflow_python, airflow_env, tmp_path / "result.py", tmp_path)
    assert outcome is not None, text[-4000:]

    assert outcome["state"] == "success", outcome
    assert outcome["tasks"]["prepare_data"]["state"] == "success"
    # The injected failure failed the first try of `train` with the job's message...
    assert outcome["tasks"]["train"]["try_number"] == 2, outcome["tasks"]
    failure = re.search(r"AirflowException: sparkdl job failed \(exit 1\): ([^\n]*)", output)
    assert failure and "injected failure in epoch 2" in failure.group(1), output[-6000:]
    assert "Cannot execute" not in output  # the job's reason, not spark-submit's command line
    # ...and the retry resumed from the checkpoint written at the end of epoch 1.
    train = outcome["train"]
    assert train["status"] == "succeeded"
    assert train["epochs"] == [1, 2, 3]
    assert train["resumed_at_step"] == steps_per_epoch
    assert train["from_finished_checkpoint"] is False
    assert len(train["throughput"]["rank_samples_per_sec_mean"]) == 2
    assert os.path.isfile(os.path.join(train["model"], "state_dict.pt"))
    assert all(r["samples"] == steps_per_epoch * 64 and r["val_samples"] == validation_rows for r in train["history"])
    assert train["final_validation"]["val_accuracy"] > 0.8
    metrics = json.load(open(train["metrics_path"]))
    assert metrics["run"]["steps"] == {
        "resumed_at": steps_per_epoch,
        "run": 2 * steps_per_epoch,
        "total": 3 * steps_per_epoch,
    }
    # Keyed on the run id (no ':' or '+', which Spark's paths would misread).
    key = outcome["run_id"].replace(":", "-").replace("+", "-")
    assert train["model"] == str(root / "runs" / key / "model") and os.path.isdir(root / "ckpt" / key)
    # evaluate: predictions for the held-out rows only, written and scored; the XCom carries the accuracy.
    evaluate = outcome["evaluate"]
    assert outcome["tasks"]["evaluate"]["state"] == "success"
    assert evaluate["rows"] == HELD_OUT_ROWS
    assert evaluate["evaluation"]["accuracy"] > 0.8, evaluate
    assert os.path.isdir(evaluate["predictions"])


# -- the examples as printed: README's "From Airflow", docs/deploy.md's "4. Airflow" -----------

#: The deployment's own places that the printed examples name, and where the test puts them:
#: these literal strings, and nothing else, are replaced; the operator calls run as printed.
#: The HDFS URLs become file:// URLs (a URL still), the local paths folders of the test's own.
PRINTED_PLACES = {
    "/opt/models/models.py": "{root}/models.py",  # a copy of examples/digits.py: make_model
    "hdfs:///data/digits": "file://{root}/hdfs/data/digits",  # all 1,797 digits
    "hdfs:///ckpt/digits/": "file://{root}/hdfs/ckpt/digits/",
    "hdfs:///tmp/sparkdl": "file://{root}/hdfs/tmp/sparkdl",
    "/shared/runs/digits/": "{root}/shared/runs/digits/",
}

# The printed examples, each in a task group of its own in one DAG (Airflow and its DB start once
# for all), beside the README's example as it was before it named features and label (the job's
# usage error) and an output_dir whose scheme the worker cannot read. Run by dag.test() with no logical date, as `airflow dags trigger` runs are.
PRINTED_DAG = """
import json
import pendulum
from airflow.models.xcom import XComModel
from airflow.sdk import DAG, TaskGroup
from airflow.utils.session import create_session

with DAG("sparkdl_printed", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"), catchup=False) as dag:
    with TaskGroup("readme"):
{readme}
    with TaskGroup("deploy"):
{deploy}
    with TaskGroup("usage"):
        from sparkdl_airflow import SparkdlTrainOperator

        train = SparkdlTrainOperator(
            task_id="train", py_files={models!r}, output_dir={usage_output!r},
            arguments={{"data": {data!r}, "model": "models:make_model", "epochs": 10}},
            retries=2,
        )
    with TaskGroup("unreadable"):
        train = SparkdlTrainOperator(
            task_id="train", output_dir="nosuchfs://bucket/run",
            arguments={{"data": {data!r}, "model": "models:make_model", "features": "features", "label": "label"}},
            retries=2,
        )

if __name__ == "__main__":
    run = dag.test(logical_date=None)
    with create_session() as session:
        tasks = {{}}
        for ti in run.get_task_instances(session=session):
            row = session.scalars(XComModel.get_many(run_id=run.run_id, dag_ids=dag.dag_id, task_ids=ti.task_id, key="return_value")).first()
            xcom = XComModel.deserialize_value(row) if row is not None else None
            tasks[ti.task_id] = {{"state": str(ti.state), "try_number": ti.try_number, "xcom": xcom}}
    print("RESULT " + json.dumps({{"run_id": run.run_id, "tasks": tasks}}, default=str), flush=True)
"""


def _printed_example(relpath: str, heading: str) -> str:
    """The first ```python block of the section ``heading`` (a whole heading line) of ``relpath``."""
    with open(os.path.join(REPO_ROOT, relpath)) as handle:
        lines = handle.read().splitlines()
    assert heading in lines, f"{relpath} has no heading {heading!r}"
    level, block, in_fence = heading.split(" ")[0], None, False
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("```"):
            if block is not None and in_fence:
                return "\n".join(block) + "\n"
            in_fence = not in_fence
            if line == "```python" and block is None:
                block = []
            continue
        marks = line.split(" ")[0]
        if not in_fence and marks and set(marks) == {"#"} and len(marks) <= len(level):
            break  # the section ended
        if block is not None and in_fence:
            block.append(line)
    raise AssertionError(f"{relpath}'s section {heading!r} has no ```python block")


def _placed(code: str, root) -> str:
    """``code`` with each of PRINTED_PLACES' literal strings replaced, in one pass."""
    places = {literal: target.format(root=root) for literal, target in PRINTED_PLACES.items()}
    return re.sub("|".join(map(re.escape, places)), lambda found: places[found.group(0)], code)


@pytest.fixture(scope="module")
def printed_run(tmp_path_factory, airflow_python, airflow_env):
    """README's and docs/deploy.md's examples and the usage error, run by one ``dag.test()``
    against the real job on spark-submit ``local[2]``; returns (its RESULT, its output, root)."""
    from examples.digits import write_dataset

    root = tmp_path_factory.mktemp("printed")
    printed = {
        "readme": _printed_example("README.md", "### From Airflow"),
        "deploy": _printed_example(os.path.join("docs", "deploy.md"), "## 4. Airflow"),
    }
    for literal in PRINTED_PLACES:  # every substitution is used: none outlives a change of the docs
        assert any(literal in code for code in printed.values()), f"no printed example names {literal!r}"
    # Each example in places of its own: they name the same ones, and the second would find the
    # first's finished checkpoint and return its model without training.
    placed = {group: _placed(code, root / group) for group, code in printed.items()}
    assert not re.search(r"[\"'](hdfs://|/opt/|/shared/)", "".join(placed.values())), placed  # no place left out
    for group in printed:
        (root / group).mkdir()
        shutil.copy(os.path.join(REPO_ROOT, "examples", "digits.py"), root / group / "models.py")
        write_dataset(str(root / group / "hdfs" / "data" / "digits"))
    path = os.path.join(airflow_env["AIRFLOW__CORE__DAGS_FOLDER"], "sparkdl_printed.py")
    with open(path, "w") as handle:
        handle.write(
            PRINTED_DAG.format(
                readme=textwrap.indent(placed["readme"], " " * 8),
                deploy=textwrap.indent(placed["deploy"], " " * 8),
                models=str(root / "readme" / "models.py"),
                data=str(root / "readme" / "hdfs" / "data" / "digits"),
                usage_output=f"file://{root}/usage",
            )
        )
    # The worker's environment: the interpreter with sparkdl for the driver and executors (the
    # examples set no env_vars), and retries at once (the examples keep Airflow's default delay).
    env = {
        **airflow_env,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "AIRFLOW__CORE__DEFAULT_TASK_RETRY_DELAY": "0",
    }
    outcome, output = _run(airflow_python, env, path, root, timeout=900)
    (root / "dag-test.log").write_text(output)  # the whole log, for a failure's reader
    assert outcome is not None, output[-6000:]
    return outcome, output, root


def _run_key(run_id: str) -> str:
    return run_id.replace(":", "-").replace("+", "-")


@pytest.mark.parametrize("group", ["readme", "deploy"])
def test_the_printed_airflow_examples_train_as_printed(printed_run, group):
    outcome, output, root = printed_run
    task = outcome["tasks"][f"{group}.train"]
    assert task["state"] == "success" and task["try_number"] == 1, (task, output[-6000:])
    train = task["xcom"]
    assert train["status"] == "succeeded" and train["epochs"] == list(range(1, 11)), train
    # Keyed on the run id without its ':' and '+' (HDFS refuses ':' in a name), which every try shares.
    key = _run_key(outcome["run_id"])
    assert key != outcome["run_id"]  # the run id had them: the example's replace() is needed
    assert train["model"] == f"{root}/{group}/shared/runs/digits/{key}/model", train["model"]
    assert os.path.isfile(os.path.join(train["model"], "state_dict.pt"))
    assert os.listdir(root / group / "hdfs" / "ckpt" / "digits" / key)  # the checkpoints, where the example put them
    assert train["from_finished_checkpoint"] is False and train["resumed_at_step"] == 0, train
    if group == "deploy":  # it asks for validation accuracy on 10% of the rows
        assert train["final_validation"]["val_accuracy"] > 0.8, train["final_validation"]


def test_a_usage_error_fails_the_task_without_retry_with_the_jobs_reason(printed_run):
    """The README's example as it was (no features, no label): the job's argparse refuses it,
    writes metrics.json (to a file:// URL, read back through fsspec) with the reason, and the task
    fails once, not retried, saying that reason, not spark-submit's command line."""
    outcome, output, root = printed_run
    assert outcome["tasks"]["usage.train"] == {"state": "failed", "try_number": 1, "xcom": None}, outcome["tasks"]
    metrics = json.load(open(root / "usage" / "metrics.json"))
    assert metrics["status"] == "failed" and metrics["exit_code"] == 2 and metrics["error_kind"] == "usage", metrics
    assert "--label" in metrics["error"], metrics
    expected = f"AirflowFailException: sparkdl job failed (exit 2, a usage error: not retried): {metrics['error'].splitlines()[0]}"
    assert expected in output, output[-6000:]
    failure = output[output.index(expected) :].split("\n", 1)[0]
    assert "spark-submit" not in failure and "Cannot execute" not in output, output[-6000:]


def test_an_output_dir_the_worker_cannot_read_fails_the_task_before_spark_submit(printed_run):
    """The operator reads the job's metrics.json from output_dir: a scheme with no fsspec
    implementation on the worker fails the task at once, not retried, naming the scheme."""
    outcome, output, _ = printed_run
    assert outcome["tasks"]["unreadable.train"] == {"state": "failed", "try_number": 1, "xcom": None}
    assert (
        "AirflowFailException: output_dir 'nosuchfs://bucket/run': the Airflow worker reads the job's metrics.json "
        "from there, but fsspec cannot open nosuchfs:// URLs on this worker"
    ) in output, output[-6000:]
    assert "--output nosuchfs://" not in output  # nothing was submitted


# -- the operators alone: killing a task, a stale metrics.json, fail_below ------------------------

SPARK = dict(  # the connection (spark_default, from the environment) says where; these say how
    conf={
        "spark.ui.enabled": "false",
        "spark.driver.extraJavaOptions": f"-Dlog4j.configurationFile=file:{REPO_ROOT}/jobs/log4j2.properties",
    },
    env_vars={"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable},
)

# A one-task DAG run by dag.test() with no logical date (as `airflow dags trigger` runs are). It
# lives in the DAGs folder (Airflow 3 runs only DAGs it has parsed and serialized from there).
ONE_TASK_DAG = """
import json
import pendulum
from datetime import timedelta
from airflow.sdk import DAG
from sparkdl_airflow import SparkdlPredictOperator, SparkdlTrainOperator

{preamble}
with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"), catchup=False) as dag:
    task = {operator}(task_id="job", retry_delay=timedelta(seconds=0), {extra}**{kwargs!r})

if __name__ == "__main__":
    import faulthandler, signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks for the stacks
    run = dag.test(logical_date=None)
    ti = run.get_task_instances()[0]
    print("RESULT " + json.dumps({{"state": str(ti.state), "try_number": ti.try_number}}), flush=True)
"""


def _one_task_dag(airflow_env, dag_id, operator, preamble="", extra="", **kwargs):
    """The DAG file; ``preamble`` is code before the DAG, ``extra`` operator arguments as code
    (``"pre_execute=wait, "``: what a repr cannot carry)."""
    path = os.path.join(airflow_env["AIRFLOW__CORE__DAGS_FOLDER"], f"{dag_id}.py")
    with open(path, "w") as handle:
        handle.write(
            ONE_TASK_DAG.format(
                dag_id=dag_id, operator=operator, preamble=preamble, extra=extra, kwargs={**SPARK, **kwargs}
            )
        )
    return path


BLOCKING_JOB = """
import json, os, socket, sys, threading
from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]


def block(_):
    import os, socket, threading
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(str(os.getpid()).encode())
    threading.Event().wait()  # a task that never ends: only killing the job stops it


threading.Thread(target=lambda: spark.sparkContext.parallelize(range(2), 2).foreach(block), daemon=True).start()
workers = []
for _ in range(2):  # both Python workers are running a task
    conn, _ = server.accept()
    with conn:
        workers.append(int(conn.makefile().read()))
print("BLOCKING " + json.dumps({"driver": os.getpid(), "sid": os.getsid(0), "workers": workers}), flush=True)
"""
# What the driver does once both workers are blocked, until it is killed.
SILENT = "threading.Event().wait()\n"  # prints nothing more: Airflow's main thread waits for a line
# Prints without a pause: Airflow's main thread is nearly always logging a line, inside structlog's
# per-file lock, when the SIGTERM handler interrupts it (an on_kill that logged deadlocked there).
CHATTY = "line = 0\nwhile True:\n    line += 1\n    print('still training', line, flush=True)\n"


def _signal_a_thread_other_than_main(pid: int, signum: int) -> None:
    """Sends ``signum`` to one thread of process ``pid`` other than its main thread (tgkill)."""
    others = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid)
    assert others, f"process {pid} has no thread but its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, others[0], signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {others[0]}, {signum})")


def _drain(lines: "queue.Queue[Optional[str]]") -> list:
    drained = []
    while not lines.empty():
        drained.append(lines.get() or "")
    return drained


class _BlockingTask:
    """The one-task DAG of a job whose driver blocks with both Python workers busy, run by
    ``dag.test()`` in a process (and session) of its own; its output read by a thread."""

    def __init__(
        self,
        tmp_path,
        airflow_python,
        airflow_env,
        job: str,
        preamble="",
        extra="",
        operator="SparkdlTrainOperator",
        **operator_kwargs,
    ):
        (tmp_path / "blocking.py").write_text(job)
        runner = _one_task_dag(
            airflow_env,
            "sparkdl_kill",
            operator,
            preamble=preamble,
            extra=extra,
            application=str(tmp_path / "blocking.py"),
            output_dir=str(tmp_path / "out"),
            **operator_kwargs,
        )
        self.tmp_path, self.output, self.info = tmp_path, [], None
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.process = subprocess.Popen(
            [airflow_python, str(runner)],
            env=airflow_env,
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output: the task process has exited

    def wait_for_line(self, marker: str, what: str) -> str:
        """Waits for the first line of output containing ``marker``; fails saying ``what`` never happened."""
        deadline = time.monotonic() + 240  # Airflow's start-up plus a spark-submit on a busy 2-core machine
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            assert line is not None, f"{what}:\n" + "".join(self.output)[-4000:]
            self.output.append(line)
            if marker in line:
                return line

    def wait_until_blocking(self) -> dict:
        """Waits for the driver's BLOCKING line; returns its pids: driver, sid, workers."""
        line = self.wait_for_line("BLOCKING ", "the job never reported both workers busy")
        # The task log appends its fields after the JSON.
        self.info = json.JSONDecoder().raw_decode(line.split("BLOCKING ", 1)[1])[0]
        assert self.info["sid"] != os.getsid(
            self.process.pid
        )  # the operator started spark-submit in a session of its own
        running = _session_processes(self.info["sid"])
        assert self.info["driver"] in running and all(w in running for w in self.info["workers"]), running
        assert any("org.apache.spark.deploy.SparkSubmit" in c for c in running.values()), running
        return running

    def text(self) -> str:
        self.reader.join(timeout=30)
        return "".join(self.output + _drain(self.lines))

    def stacks_after(self, seconds: float) -> Optional[str]:
        """None once the task's process has exited within ``seconds``; else its threads' stacks."""
        try:
            self.process.wait(timeout=seconds)
            return None
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGUSR1)  # the runner's faulthandler prints every thread's stack
            self.reader.join(timeout=10)
            text = "".join(self.output + _drain(self.lines))
            dump = text.find("Thread 0x")  # faulthandler's first thread
            return text[dump : dump + 8000] if dump >= 0 else text[-6000:]

    def clean_up(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        _kill_everything_of(str(self.tmp_path), [self.info["sid"]] if self.info else [])


@pytest.mark.parametrize("driver_then", [SILENT, CHATTY], ids=["silent", "chatty"])
def test_killing_the_task_stops_spark_submit_its_driver_and_python_workers(
    tmp_path, airflow_python, airflow_env, driver_then
):
    """Airflow kills a task by sending its process SIGTERM; the task runner's handler calls the
    operator's on_kill. Every process of spark-submit's session (the SparkSubmit JVM, the Python
    driver, the PySpark daemon and its task workers) must be gone afterwards, whether the job is
    silent or printing when the kill comes."""
    task = _BlockingTask(tmp_path, airflow_python, airflow_env, BLOCKING_JOB + driver_then)
    try:
        running = task.wait_until_blocking()
        # Airflow's supervisor kills a task with SIGTERM to the task's process, which the kernel
        # hands to any of its threads not blocking it; the hard case is a thread other than the
        # main one (Python runs signal handlers on the main thread only), so it is delivered there.
        _signal_a_thread_other_than_main(task.process.pid, signal.SIGTERM)
        stacks = task.stacks_after(120)
        # pytrace=False: the message alone, so that the stacks are what a CI summary shows first.
        if stacks is not None:
            pytest.fail("the task outlived SIGTERM by 120 s; its threads' stacks:\n" + stacks, pytrace=False)
        text = task.text()
        killed = re.search(
            r"the task was killed; stopped spark-submit \(pid \d+\) and the processes of its group: (SIGTERM[^\n]*)",
            text,
        )
        assert killed and "exited with" in killed.group(1), text[-4000:]
        assert 'RESULT {"state": "failed", "try_number": 1}' in text, text[-4000:]
        # JVM shutdown hooks and the PySpark daemon's exit take seconds on a loaded machine: a
        # generous bound, waited on with pidfds, not slept.
        left = _wait_exited(list(running), timeout=90)
        sid = task.info["sid"]
        assert not left and not _session_processes(sid), (
            f"still running after the task was killed: {_session_processes(sid)}"
        )
    finally:
        task.clean_up()


# A driver that ignores SIGTERM: one slow to stop (a long shutdown hook), at its worst.
IGNORES_SIGTERM = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"


def test_a_driver_that_outlives_sigterm_is_killed_after_the_grace_period_though_airflow_killed_the_task(
    tmp_path, airflow_python, airflow_env
):
    """Airflow 3's supervisor SIGKILLs a task's process 5 s after its SIGTERM, so the SIGKILL after
    ``kill_grace_seconds`` cannot come from there: the reaper process that on_kill starts sends it."""
    task = _BlockingTask(
        tmp_path, airflow_python, airflow_env, IGNORES_SIGTERM + BLOCKING_JOB + SILENT, kill_grace_seconds=3
    )
    try:
        running = task.wait_until_blocking()
        jvm = [pid for pid, cmdline in running.items() if "org.apache.spark.deploy.SparkSubmit" in cmdline]
        _signal_a_thread_other_than_main(task.process.pid, signal.SIGTERM)
        # on_kill starts the reaper, then sends spark-submit's group SIGTERM, which ends the JVM.
        assert not _wait_exited(jvm, timeout=90), "on_kill's SIGTERM never stopped the SparkSubmit JVM"
        os.kill(task.process.pid, signal.SIGKILL)  # as Airflow's supervisor does while the driver runs on
        task.process.wait(timeout=30)
        left = _wait_exited(list(running), timeout=90)
        sid = task.info["sid"]
        assert not left and not _session_processes(sid), (
            f"still running after the task was killed: {_session_processes(sid)}"
        )
        reapers = [
            pid for pid, (_, cmdline) in _live_processes().items() if f"sparkdl_airflow.reaper {jvm[0]} " in cmdline
        ]
        assert not _wait_exited(reapers, timeout=30)  # and the reaper ended itself
    finally:
        task.clean_up()


# A pre_execute that holds the task until Airflow's SIGTERM handler (which calls on_kill) has run:
# the kill lands before spark-submit starts, every time.
HOLDS_UNTIL_KILLED = """
def hold_until_killed(context):
    import signal, threading
    handled = threading.Event()
    airflow_handler = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        airflow_handler(signum, frame)
        handled.set()

    signal.signal(signal.SIGTERM, handler)
    print("HOLDING UNTIL KILLED", flush=True)
    # Python runs a handler when the main thread runs bytecode, and the signal lands on another
    # thread: an untimed wait would never return to let it run.
    while not handled.wait(0.1):
        pass
"""


def test_a_kill_before_spark_submit_starts_submits_nothing(tmp_path, airflow_python, airflow_env):
    """Airflow 3's handler only calls on_kill and the task goes on: a kill that found nothing to
    stop must keep spark-submit from starting afterwards, else the job would train on in a session
    that the supervisor's SIGKILL of the task does not reach."""
    started = tmp_path / "the job started"
    job = f"open({str(started)!r}, 'w').close()\n" + BLOCKING_JOB + SILENT
    task = _BlockingTask(
        tmp_path, airflow_python, airflow_env, job, preamble=HOLDS_UNTIL_KILLED, extra="pre_execute=hold_until_killed, "
    )
    try:
        task.wait_for_line("HOLDING UNTIL KILLED", "the task never reached its pre_execute")
        _signal_a_thread_other_than_main(task.process.pid, signal.SIGTERM)
        stacks = task.stacks_after(120)
        if stacks is not None:
            pytest.fail("the task outlived SIGTERM by 120 s; its threads' stacks:\n" + stacks, pytrace=False)
        text = task.text()
        assert "the task was killed before spark-submit started; nothing was submitted" in text, text[-4000:]
        assert 'RESULT {"state": "failed", "try_number": 1}' in text, text[-4000:]
        # No process of the job's was ever started: spark-submit names the application on its command line.
        application = str(tmp_path / "blocking.py")
        assert not [cmd for _, cmd in _live_processes().values() if application in cmd], _live_processes()
        assert not started.exists()
    finally:
        task.clean_up()


# The kill lands while spark-submit is starting: just after submit() looked for one, before the hook
# knows the process. The operator's own record of the kill reads False once, then True.
KILLED_WHILE_STARTING = """
class KilledWhileStarting(SparkdlTrainOperator):
    looked = 0

    def _was_killed(self):
        type(self).looked += 1
        return type(self).looked > 1
"""


def test_a_kill_while_spark_submit_starts_stops_its_session(tmp_path, airflow_python, airflow_env):
    """The narrow window after submit()'s check: on_kill found no process, so the output loop,
    the first code that knows spark-submit's, stops its session; the task reports it and fails."""
    task = _BlockingTask(
        tmp_path,
        airflow_python,
        airflow_env,
        BLOCKING_JOB + SILENT,
        preamble=KILLED_WHILE_STARTING,
        operator="KilledWhileStarting",
    )
    try:
        stacks = task.stacks_after(120)
        if stacks is not None:
            pytest.fail("the task did not end within 120 s; its threads' stacks:\n" + stacks, pytrace=False)
        text = task.text()
        assert re.search(
            r"the task was killed; stopped spark-submit \(pid \d+\) and the processes of its group", text
        ), text[-4000:]
        assert 'RESULT {"state": "failed", "try_number": 1}' in text, text[-4000:]
        application = str(tmp_path / "blocking.py")
        left = [pid for pid, (_, cmd) in _live_processes().items() if application in cmd]
        assert not _wait_exited(left, timeout=90), _live_processes()
        assert "BLOCKING " not in text  # the job was stopped before its workers were busy
    finally:
        task.clean_up()


STALE_JOB = """
import json, os, sys
output = sys.argv[sys.argv.index("--output") + 1]
if not os.path.exists({marker!r}):  # try 1 fails after writing its metrics.json
    open({marker!r}, "w").close()
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "metrics.json"), "w") as handle:
        json.dump({{"status": "failed", "error": "the error of try 1"}}, handle)
    sys.exit(1)
print("try 2 died before writing metrics.json", flush=True)  # as a driver killed by the OOM killer would
sys.exit(1)
"""


def test_a_retry_that_dies_before_writing_metrics_does_not_report_the_previous_trys(
    tmp_path, airflow_python, airflow_env
):
    output = tmp_path / "out"
    (tmp_path / "stale.py").write_text(STALE_JOB.format(marker=str(tmp_path / "try-1-ran")))
    runner = _one_task_dag(
        airflow_env,
        "sparkdl_stale",
        "SparkdlTrainOperator",
        application=str(tmp_path / "stale.py"),
        output_dir=str(output),
        retries=1,
    )
    outcome, text = _run(airflow_python, airflow_env, runner, tmp_path, timeout=300)
    assert outcome == {"state": "failed", "try_number": 2}, text[-4000:]
    # Try 1 fails with the error its metrics.json holds; try 2 fails with its own spark-submit
    # output and never with try 1's error.
    _, first, second = text.split("[DAG TEST] running task <TaskInstance: sparkdl_stale.job")
    assert "AirflowException: sparkdl job failed (exit 1): the error of try 1\n" in first, first[-4000:]
    assert "the error of try 1" not in second, second[-4000:]
    # The message's lines: up to the next log record (which starts with its timestamp).
    found = re.search(
        r"AirflowException: sparkdl job failed \(spark-submit exit 1\) before writing (\S+)metrics.json; "
        r"spark-submit's last lines:\n((?:(?!\d{4}-\d\d-\d\dT).*\n)*)",
        second,
    )
    assert found and found.group(1) == f"{output}/", second[-4000:]
    assert "try 2 died before writing metrics.json" in found.group(2), found.group(2)
    assert "Cannot execute" not in text  # spark-submit's output, not its command line
    assert not (output / "metrics.json").exists()  # removed before try 2, which wrote none


def test_fail_below_fails_the_task_naming_the_metric_its_value_and_the_threshold(tmp_path, airflow_python, airflow_env):
    import torch

    import sparkdl
    from examples.digits import write_split
    from tests.models import accuracy, digits_mlp, read_digits

    _, test = write_split(str(tmp_path / "digits"))
    torch.manual_seed(0)
    module = digits_mlp()  # untrained: about 10% accuracy
    sparkdl.TorchModel(module, [], feature_cols=["features"], output_shape=[10], model_fn=digits_mlp).save(
        str(tmp_path / "model")
    )
    expected = accuracy(module, *read_digits(test))
    floor = round(expected + 0.05, 3)
    runner = _one_task_dag(
        airflow_env,
        "sparkdl_fail_below",
        "SparkdlPredictOperator",
        output_dir=str(tmp_path / "eval"),
        py_files=os.path.join(REPO_ROOT, "tests", "models.py"),
        arguments={
            "model": str(tmp_path / "model"),
            "model_factory": "models:digits_mlp",
            "data": test,
            "label": "label",
        },
        fail_below={"accuracy": floor},
        retries=1,
    )
    outcome, text = _run(airflow_python, airflow_env, runner, tmp_path, timeout=300)
    assert outcome == {"state": "failed", "try_number": 1}, text[-4000:]  # not retried: it would score the same
    found = re.search(
        r"AirflowFailException: accuracy = ([0-9.]+) is below the required ([0-9.]+) \(predictions in (\S+)\)", text
    )
    assert found, text[-4000:]
    assert abs(float(found.group(1)) - expected) < 5e-5 and float(found.group(2)) == floor
    assert (
        abs(json.load(open(tmp_path / "eval" / "metrics.json"))["evaluation"]["accuracy"] - float(found.group(1)))
        < 5e-5
    )
