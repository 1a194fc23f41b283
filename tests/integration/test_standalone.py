"""Spark's real standalone deploy mode: scripts/standalone-cluster starts a master and two workers
from the pip-installed Spark (loopback only), jobs/train.py is submitted to spark://127.0.0.1:PORT
with the real spark-submit, and the cluster is stopped with no JVM left behind. Also validates
docker-compose.yml (the same topology in containers) with a real Compose parser."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

import sparkdl
from examples.digits import write_dataset
from tests.conftest import REPO_ROOT
from tests.models import accuracy, digits_mlp

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
    return subprocess.run([sys.executable, SCRIPT, command, "--dir", str(state_dir)], env=env, capture_output=True, text=True, timeout=timeout)


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
def test_spark_submit_trains_on_a_standalone_cluster(standalone, tmp_path, digits):
    url, state_dir = standalone
    status = _cluster("status", state_dir)
    assert status.returncode == 0 and "2/2 worker(s) alive" in status.stderr, status.stderr
    data = write_dataset(str(tmp_path / "digits"))
    output = str(tmp_path / "run")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    command = [
        os.path.join(BIN, "spark-submit"), "--master", url,
        "--conf", "spark.driver.host=127.0.0.1",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.executor.memory=768m",
        # Standalone executors register one by one; this tells sparkdl's slot check to wait for
        # both instead of failing on the first (docs/deploy.md; _launcher._expected_executors).
        "--conf", "spark.executor.instances=2",
        "--conf", f"spark.sparkdl.cacheDir={tmp_path}/cache",
        "--driver-java-options", f"-Dlog4j.configurationFile=file:{REPO_ROOT}/jobs/log4j2.properties",
        "--py-files", os.path.join(REPO_ROOT, "tests", "models.py"),
        os.path.join(REPO_ROOT, "jobs", "train.py"),
        "--data", data, "--model", "models:digits_mlp", "--features", "features", "--label", "label",
        "--num-workers", "2", "--epochs", "3", "--batch-size", "32", "--optimizer", "sgd", "--lr", "0.05",
        "--output", output,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=str(tmp_path))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    metrics = json.load(open(os.path.join(output, "metrics.json")))
    assert metrics["status"] == "succeeded" and metrics["exit_code"] == 0
    assert metrics["spark"]["master"] == url  # the standalone master, not local mode
    assert metrics["spark"]["app_id"].startswith("app-")  # an application id issued by the standalone master
    assert [r["epoch"] for r in metrics["history"]] == [1, 2, 3]
    # Each rank's throughput is recorded, and both ranks really trained.
    assert all(r["rank0_samples_per_sec"] > 0 and r["rank1_samples_per_sec"] > 0 for r in metrics["history"])
    assert len(metrics["throughput"]["rank_samples_per_sec_mean"]) == 2
    # The executors ran in the workers' work dirs: one application dir per worker.
    apps = [os.listdir(state_dir / f"work-{i}") for i in (1, 2)]
    assert apps[0] == apps[1] == [metrics["spark"]["app_id"]], apps
    model = sparkdl.TorchModel.load(os.path.join(output, "model"), model=digits_mlp)
    features, labels = digits
    assert accuracy(model.module, features, labels) > 0.85


def test_stop_without_a_running_cluster_is_clean_and_status_says_down(tmp_path):
    stopped = _cluster("stop", tmp_path / "never-started")
    assert stopped.returncode == 0, stopped.stderr
    status = _cluster("status", tmp_path / "never-started")
    assert status.returncode == 3 and "not running" in status.stderr


# -- docker-compose.yml ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docker_compose():
    """Debian's docker-compose (1.29): `config` parses, interpolates and validates a Compose file
    against the Compose schema without a Docker engine. Installed with apt on first use."""
    found = shutil.which("docker-compose")
    if found is None:
        install = subprocess.run(
            "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 docker-compose",
            shell=True, capture_output=True, text=True, timeout=900,
        )
        found = shutil.which("docker-compose")
        assert found, f"cannot install docker-compose with apt-get (needs root and Debian's archive): {install.stderr[-2000:]}"
    return found


def test_docker_compose_file_is_valid_and_describes_the_cluster(docker_compose, tmp_path):
    compose_file = os.path.join(REPO_ROOT, "docker-compose.yml")
    result = subprocess.run([docker_compose, "-f", compose_file, "config"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert set(services) == {"spark-master", "spark-worker-1", "spark-worker-2", "spark-connect", "client"}
    for name, service in services.items():
        assert service["image"] == "sparkdl:local" and service["build"]["dockerfile"] == "Dockerfile", name
        assert any(v.startswith("sparkdl-data:/data") for v in service["volumes"]), name  # shared storage
    master = services["spark-master"]
    assert master["command"][:2] == ["spark-class", "org.apache.spark.deploy.master.Master"]
    assert all(str(p).startswith("127.0.0.1:") for p in master["ports"])  # published on loopback only
    for worker in ("spark-worker-1", "spark-worker-2"):
        command = services[worker]["command"]
        assert command[:2] == ["spark-class", "org.apache.spark.deploy.worker.Worker"] and command[-1] == "spark://spark-master:7077"
        assert services[worker]["depends_on"]["spark-master"]["condition"] == "service_healthy"
    connect = services["spark-connect"]
    assert connect["command"][:3] == ["spark-submit", "--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    assert "spark://spark-master:7077" in connect["command"] and all(str(p).startswith("127.0.0.1:") for p in connect["ports"])
    # The parser really validates: a misspelled key is rejected.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(open(compose_file).read().replace("    hostname: client", "    hostnme: client"))
    rejected = subprocess.run([docker_compose, "-f", str(broken), "config", "--quiet"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert rejected.returncode != 0 and "hostnme" in rejected.stderr


def test_dockerfile_installs_the_newest_tested_stack():
    dockerfile = open(os.path.join(REPO_ROOT, "Dockerfile")).read()
    stack = open(os.path.join(REPO_ROOT, "scripts", "stacks", "latest.txt")).read()
    torch_pin = re.search(r"^torch==(\S+)", stack, re.M).group(1)
    assert f"torch=={torch_pin} --index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert re.search(r"^FROM python:3\.11-", dockerfile, re.M)  # the Python the stacks are tested on
    assert "--constraint scripts/stacks/latest.txt" in dockerfile  # the versions CI tests
    ignored = open(os.path.join(REPO_ROOT, ".dockerignore")).read().split()
    assert ".venv" in ignored and ".git" in ignored
