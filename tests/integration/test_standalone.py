"""Spark's real standalone deploy mode: scripts/standalone-cluster starts a master and two workers
from the pip-installed Spark (loopback only), jobs/train.py is submitted to spark://127.0.0.1:PORT
with the real spark-submit, and the cluster is stopped with no JVM left behind. Also validates
docker-compose.yml (the same topology in containers) against the Compose file schema."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import sparkdl
from examples.digits import write_split
from tests.conftest import REPO_ROOT
from tests.models import accuracy, digits_mlp, read_digits

SCRIPT = os.path.join(REPO_ROOT, "scripts", "standalone-cluster")
BIN = os.path.dirname(sys.executable)


def _cluster_module():
    loader = importlib.machinery.SourceFileLoader("standalone_cluster", SCRIPT)
    spec = importlib.util.spec_from_loader("standalone_cluster", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _cluster(command, state_dir, timeout=180):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    return subprocess.run(
        [sys.executable, SCRIPT, command, "--dir", str(state_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def standalone(tmp_path):
    """A running master + 2 workers (1 core, 1 GiB each); stopped after the test, pass or fail,
    and checked to leave no process behind."""
    state_dir = tmp_path / "cluster"
    started = _cluster("start", state_dir)
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        url = started.stdout.strip().splitlines()[-1]
        assert re.fullmatch(r"spark://127\.0\.0\.1:\d+", url), started.stdout
        yield url, state_dir
    finally:
        stopped = _cluster("stop", state_dir)
        left = _cluster_module().cluster_processes(str(state_dir))
        assert stopped.returncode == 0 and not left, f"stop: {stopped.stderr[-2000:]}; left running: {left}"


@pytest.mark.slow
def test_spark_submit_trains_on_a_standalone_cluster(standalone, tmp_path):
    url, state_dir = standalone
    status = _cluster("status", state_dir)
    assert status.returncode == 0 and "2/2 worker(s) alive" in status.stderr, status.stderr
    data, test = write_split(str(tmp_path / "digits"))  # 1,437 training rows, 360 held out
    output = str(tmp_path / "run")
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    command = [
        os.path.join(BIN, "spark-submit"),
        "--master",
        url,
        "--conf",
        "spark.driver.host=127.0.0.1",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.executor.memory=768m",
        # Standalone executors register one by one; this tells sparkdl's slot check to wait for
        # both instead of failing on the first (docs/deploy.md; sparkdl._driver.cluster._expected_executors).
        "--conf",
        "spark.executor.instances=2",
        "--conf",
        f"spark.sparkdl.cacheDir={tmp_path}/cache",
        "--driver-java-options",
        f"-Dlog4j.configurationFile=file:{REPO_ROOT}/jobs/log4j2.properties",
        "--py-files",
        os.path.join(REPO_ROOT, "tests", "models.py"),
        os.path.join(REPO_ROOT, "jobs", "train.py"),
        "--data",
        data,
        "--model",
        "models:digits_mlp",
        "--features",
        "features",
        "--label",
        "label",
        "--num-workers",
        "2",
        "--epochs",
        "3",
        "--batch-size",
        "32",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--output",
        output,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    assert metrics["status"] == "succeeded" and metrics["exit_code"] == 0
    assert metrics["spark"]["master"] == url  # the standalone master, not local mode
    assert metrics["spark"]["app_id"].startswith("app-")  # an application id issued by the standalone master
    assert [r["epoch"] for r in metrics["history"]] == [1, 2, 3]
    assert all(r["samples"] == (1437 // 64) * 64 for r in metrics["history"])  # the training split only
    # Each rank's throughput is recorded, and both ranks really trained.
    assert all(r["rank0_samples_per_sec"] > 0 and r["rank1_samples_per_sec"] > 0 for r in metrics["history"])
    assert len(metrics["throughput"]["rank_samples_per_sec_mean"]) == 2
    # The executors ran in the workers' work dirs: one application dir per worker.
    apps = [os.listdir(state_dir / f"work-{i}") for i in (1, 2)]
    assert apps[0] == apps[1] == [metrics["spark"]["app_id"]], apps
    model = sparkdl.TorchModel.load(os.path.join(output, "model"), model=digits_mlp)
    features, labels = read_digits(test)  # scored only on rows the job never read
    assert len(labels) == 360
    assert accuracy(model.module, features, labels) > 0.85


def test_stop_without_a_running_cluster_is_clean_and_status_says_down(tmp_path):
    stopped = _cluster("stop", tmp_path / "never-started")
    assert stopped.returncode == 0, stopped.stderr
    status = _cluster("status", tmp_path / "never-started")
    assert status.returncode == 3 and "not running" in status.stderr


# -- docker-compose.yml ------------------------------------------------------------------------


COMPOSE_VALIDATOR = """
import json, sys
import jsonschema, yaml
schema = json.load(open(sys.argv[1]))
document = yaml.safe_load(open(sys.argv[2]))  # YAML anchors and `<<` merge keys resolved
# docker-compose checks only formats of its own (ports, expose, subnet_ip_address: not reproduced
# here); jsonschema's generic ones would misread the spec's Go-style durations ("5s") as ISO 8601.
validator = jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker(formats=()))
errors = ["/".join(map(str, e.absolute_path)) + ": " + e.message for e in validator.iter_errors(document)]
print("\\n".join(errors), file=sys.stderr)
print(json.dumps(document))
sys.exit(1 if errors else 0)
"""


@pytest.fixture(scope="module")
def compose_validator():
    """Validates a Compose file against the Compose specification's JSON schema, the one
    docker-compose 1.29.2 validates with (its compose/config/compose_spec.json, applied as its
    validation.py does, with a Draft 4 validator), using the pinned jsonschema and PyYAML of
    .venv-airflow. scripts/bootstrap-airflow puts the schema there before pytest starts; nothing is
    installed here, and nothing outside the project. Not covered, unlike `docker-compose config`:
    ${VAR} interpolation (the file has none), docker-compose's own format checks of port strings,
    and its cross-service checks (the test checks depends_on and networks itself)."""
    result = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, "scripts", "bootstrap-airflow"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    python = result.stdout.strip().splitlines()[-1]
    schema = os.path.join(os.path.dirname(os.path.dirname(python)), "share", "sparkdl", "compose_spec.json")

    def validate(path):
        return subprocess.run(
            [python, "-c", COMPOSE_VALIDATOR, schema, str(path)], capture_output=True, text=True, timeout=120
        )

    return validate


def test_docker_compose_file_is_valid_and_describes_the_cluster(compose_validator, tmp_path):
    compose_file = os.path.join(REPO_ROOT, "docker-compose.yml")
    result = compose_validator(compose_file)
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert set(config) <= {"x-sparkdl", "services", "volumes", "networks"}, set(config)
    services = config["services"]
    assert set(services) == {"spark-master", "spark-worker-1", "spark-worker-2", "spark-connect", "client"}
    for name, service in services.items():
        assert service["image"] == "sparkdl:local" and service["build"]["dockerfile"] == "Dockerfile", name
        assert any(v.startswith("sparkdl-data:/data") for v in service["volumes"]), name  # shared storage
        assert set(service.get("depends_on", {})) <= set(services), name  # depends only on services of this file
        assert set(service["networks"]) <= set(config["networks"]), name
    assert "sparkdl-data" in config["volumes"]
    master = services["spark-master"]
    assert master["command"][:2] == ["spark-class", "org.apache.spark.deploy.master.Master"]
    assert all(str(p).startswith("127.0.0.1:") for p in master["ports"])  # published on loopback only
    for worker in ("spark-worker-1", "spark-worker-2"):
        command = services[worker]["command"]
        assert (
            command[:2] == ["spark-class", "org.apache.spark.deploy.worker.Worker"]
            and command[-1] == "spark://spark-master:7077"
        )
        assert services[worker]["depends_on"]["spark-master"]["condition"] == "service_healthy"
    connect = services["spark-connect"]
    assert connect["command"][:3] == [
        "spark-submit",
        "--class",
        "org.apache.spark.sql.connect.service.SparkConnectServer",
    ]
    assert "spark://spark-master:7077" in connect["command"] and all(
        str(p).startswith("127.0.0.1:") for p in connect["ports"]
    )
    # The schema really validates: a misspelled key and a malformed port are rejected.
    original = open(compose_file).read()
    for broken_text, complaint in (
        (original.replace("    hostname: client", "    hostnme: client"), "hostnme"),
        (original.replace('"127.0.0.1:7077:7077"', "{bogus: 7077}"), "services/spark-master/ports/0"),
    ):
        assert broken_text != original
        broken = tmp_path / "docker-compose.yml"
        broken.write_text(broken_text)
        rejected = compose_validator(broken)
        assert rejected.returncode != 0 and complaint in rejected.stderr, rejected.stderr


def test_dockerfile_installs_the_newest_tested_stack():
    dockerfile = open(os.path.join(REPO_ROOT, "Dockerfile")).read()
    stack = open(os.path.join(REPO_ROOT, "scripts", "stacks", "latest.txt")).read()
    torch_pin = re.search(r"^torch==(\S+)", stack, re.M).group(1)
    assert f"torch=={torch_pin} --index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert re.search(r"^FROM python:3\.11-", dockerfile, re.M)  # the Python the stacks are tested on
    assert "--constraint scripts/stacks/latest.txt" in dockerfile  # the versions CI tests
    ignored = open(os.path.join(REPO_ROOT, ".dockerignore")).read().split()
    assert ".venv" in ignored and ".git" in ignored
