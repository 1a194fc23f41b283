"""jobs/airflow_dag.py end to end with real Airflow (``dag.test()``) driving the real spark-submit.

Airflow lives in its own virtualenv (.venv-airflow, made by scripts/bootstrap-airflow on first
use, pinned by scripts/airflow-constraints.txt), as an Airflow worker is apart from the Spark
cluster in production; its tasks run .venv's spark-submit against local[2]. The model's first
attempt dies after epoch 1 (its checkpoint written): the train task's first try fails, Airflow
retries it, and the retry resumes from that checkpoint instead of starting over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 1797 // (2 * 32)  # digits rows // (num_workers * batch_size)

FLAKY_MODEL = '''
"""The digits MLP, except that the first process to reach epoch 2 dies (once per marker file)."""
import os
import torch

MARKER = {marker!r}


class FlakyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > {steps} and not os.path.exists(MARKER):
            open(MARKER, "w").close()
            raise RuntimeError("injected failure in epoch 2")
        return self.net(x)


def make_model():
    return FlakyMLP()
'''

RUNNER = '''
import json, os, sys
sys.path.insert(0, os.path.join({repo!r}, "jobs"))
import airflow_dag

run = airflow_dag.dag.test(run_conf={conf!r})
tis = {{ti.task_id: ti for ti in run.get_task_instances()}}
result = {{
    "state": str(run.state),
    "tasks": {{k: {{"state": str(ti.state), "try_number": ti.try_number}} for k, ti in tis.items()}},
    "train": tis["train"].xcom_pull(task_ids="train"),
    "evaluate": tis["evaluate"].xcom_pull(task_ids="evaluate"),
}}
print("RESULT " + json.dumps(result, default=str))
'''


@pytest.fixture(scope="module")
def airflow_python():
    """.venv-airflow's interpreter (installed on first use, then cached by its stamp)."""
    result = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "bootstrap-airflow")], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_dag_trains_on_spark_retries_from_checkpoint_and_evaluates(tmp_path, airflow_python):
    home, root = tmp_path / "airflow-home", tmp_path / "root"
    home.mkdir()
    (tmp_path / "flaky.py").write_text(FLAKY_MODEL.format(marker=str(tmp_path / "failed-once"), steps=STEPS_PER_EPOCH))
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "AIRFLOW")) and k != "PYTEST_CURRENT_TEST"
    }
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=os.path.join(REPO_ROOT, "jobs"),
        SPARKDL_AIRFLOW_RETRY_DELAY_S="0",
        SPARK_LOCAL_IP="127.0.0.1",
    )
    airflow_bin = os.path.join(os.path.dirname(airflow_python), "airflow")
    migrate = subprocess.run([airflow_bin, "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stdout[-2000:] + migrate.stderr[-2000:]

    conf = {
        "root": str(root),
        "python": sys.executable,  # .venv: the interpreter with sparkdl that the driver and executors run
        "spark_submit": os.path.join(os.path.dirname(sys.executable), "spark-submit"),
        "master": "local[2]",
        "model_file": str(tmp_path / "flaky.py"),
        "model": "flaky:make_model",
        "epochs": 3,
        "min_accuracy": 0.8,
    }
    runner = tmp_path / "run_dag.py"
    runner.write_text(textwrap.dedent(RUNNER.format(repo=REPO_ROOT, conf=conf)))
    result = subprocess.run([airflow_python, str(runner)], env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    output = result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, output[-6000:]
    outcome = json.loads(lines[-1][len("RESULT "):])

    assert outcome["state"] == "success", outcome
    assert outcome["tasks"]["prepare_data"]["state"] == "success"
    # The injected failure failed the first try of `train` with the job's message...
    assert outcome["tasks"]["train"]["try_number"] == 2, outcome["tasks"]
    assert "Marking task as UP_FOR_RETRY. dag_id=sparkdl_digits, task_id=train" in output, output[-6000:]
    assert "sparkdl job failed (spark-submit exit 1)" in output and "injected failure in epoch 2" in output
    # ...and the retry resumed from the checkpoint written at the end of epoch 1.
    train = outcome["train"]
    assert train["status"] == "succeeded"
    assert train["epochs"] == [1, 2, 3]
    assert train["resumed_at_step"] == STEPS_PER_EPOCH
    assert train["from_finished_checkpoint"] is False
    assert len(train["throughput"]["rank_samples_per_sec_mean"]) == 2
    assert os.path.isfile(os.path.join(train["model"], "state_dict.pt"))
    metrics = json.load(open(train["metrics_path"]))
    assert metrics["run"]["steps"] == {"resumed_at": STEPS_PER_EPOCH, "run": 2 * STEPS_PER_EPOCH, "total": 3 * STEPS_PER_EPOCH}
    # evaluate: predictions written and scored; the XCom carries the accuracy.
    evaluate = outcome["evaluate"]
    assert outcome["tasks"]["evaluate"]["state"] == "success"
    assert evaluate["rows"] == 1797
    assert evaluate["evaluation"]["accuracy"] > 0.8, evaluate
    assert os.path.isdir(evaluate["predictions"])
