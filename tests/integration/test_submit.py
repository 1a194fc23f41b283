"""``sparkdl submit`` as a pip user runs it: the wheel built from this tree, installed into a fresh
virtualenv (no editable install, no checkout on the path), submitting the job that ships inside
the package to a three-host namespace cluster (scripts/netcluster: the master on h0, a 2-core
worker on h1 and on h2; every host shares this machine's filesystem, as an NFS mount would).

One cluster for the module: client deploy mode (the driver on h0, where sparkdl submit runs),
cluster deploy mode (Spark picks a worker host for the driver; outputs go to a shared URL), and a
signal in each mode (nothing of the submission is left running). Needs root, as test_multihost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import venv
import zipfile

import pytest

from examples.digits import write_dataset
from tests.conftest import REPO_ROOT
from tests.integration.test_multihost import SCRIPT, cluster_up

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

MODEL_MODULE = """import torch


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
"""
#: Each worker host's cluster address (h1, h2); the master and sparkdl submit are on h0.
WORKER_ADDRESSES = ("198.18.0.2", "198.18.0.3")


def _source_tree(destination: str) -> str:
    """This tree as a release would build it: the files git tracks or would track (no build/,
    no egg-info, nothing ignored), so that nothing stale in the checkout reaches the wheel."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = os.path.join(REPO_ROOT, name)
        if os.path.isfile(source):  # a file deleted in the tree but not yet in git's index is skipped
            os.makedirs(os.path.join(destination, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(source, os.path.join(destination, name))
    return destination


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """``pip wheel --no-deps`` of the tree (setuptools, the build backend, from .venv)."""
    source = _source_tree(str(tmp_path_factory.mktemp("source")))
    out = str(tmp_path_factory.mktemp("wheel"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", out, source],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (name,) = os.listdir(out)
    return os.path.join(out, name)


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory):
    """A new virtualenv with the wheel installed as a user would (the newest stack's constraints,
    so torch is the CPU build); returns its bin/ folder."""
    root = str(tmp_path_factory.mktemp("fresh-venv"))
    started = time.monotonic()
    venv.EnvBuilder(with_pip=True).create(root)
    python = os.path.join(root, "bin", "python")
    constraints = os.path.join(REPO_ROOT, "scripts", "stacks", "latest.txt")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-compile", "--constraint", constraints, wheel],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    print(f"\nfresh virtualenv with the wheel installed in {time.monotonic() - started:.1f}s", file=sys.stderr)
    where = subprocess.run(
        [python, "-c", "import sparkdl, sparkdl.cli.jobs as jobs; print(sparkdl.__file__); print(jobs.TRAIN)"],
        capture_output=True,
        text=True,
        cwd=root,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert path.startswith(os.path.join(root, "lib")), where.stdout  # the installed copy, not the checkout
    return os.path.join(root, "bin")


@pytest.fixture(scope="module")
def netcluster(tmp_path_factory):
    """Three hosts; 2 cores and 2 GiB per worker: room for a driver in cluster mode beside two
    1-core executors."""
    state_dir = str(tmp_path_factory.mktemp("netcluster"))
    with cluster_up("sds", state_dir, "--hosts", "3", "--cores", "2", "--memory", "2g") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("data") / "digits"))


def _user_dir(tmp_path) -> str:
    """Where the user runs sparkdl submit: their model module, nothing of this repository."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "digits_model.py").write_text(MODEL_MODULE)
    return str(user)


def _submit_command(bin_dir: str, *options: str, job_args=()) -> list:
    """``sparkdl submit train`` of the fresh virtualenv, run on h0."""
    return [SCRIPT, "exec", "h0", "--", os.path.join(bin_dir, "sparkdl"), "submit", "train", *options, "--", *job_args]


def _env(cluster_env: dict, bin_dir: str) -> dict:
    env = {k: v for k, v in cluster_env.items() if k not in ("PYTHONPATH", "SPARK_HOME", "PYSPARK_DRIVER_PYTHON")}
    env["PYSPARK_PYTHON"] = os.path.join(bin_dir, "python")  # the executors' (and the client driver's) Python
    return env


def _spark_options(state: dict, *extra: str) -> list:
    options = ["--master", state["master_url"], "--executor-memory", "512m"]
    for setting in (
        "spark.ui.enabled=false",
        "spark.executor.cores=1",
        "spark.cores.max=2",
        "spark.executor.instances=2",
    ):
        options += ["--conf", setting]
    return options + list(extra)


def _job_args(data: str, output_url: str, epochs: int = 2) -> list:
    return [
        *("--data", data, "--model", "digits_model:make_model", "--features", "features", "--label", "label"),
        *("--num-workers", "2", "--epochs", str(epochs), "--batch-size", "32", "--optimizer", "sgd", "--lr", "0.05"),
        *("--output", output_url),
    ]


def _run(command: list, env: dict, cwd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *command], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _succeeded(output_dir: str) -> dict:
    metrics = json.load(open(os.path.join(output_dir, "metrics.json")))
    assert metrics["status"] == "succeeded", metrics.get("error")
    assert [record["epoch"] for record in metrics["history"]] == [1, 2]
    assert os.listdir(os.path.join(output_dir, "model")), "no model written"
    return metrics


def _app_dirs(state: dict, host: int) -> list:
    work = os.path.join(state["dir"], f"work-h{host}")
    return sorted(os.path.join(work, name) for name in os.listdir(work) if name.startswith("app-"))


def test_the_wheel_holds_the_jobs_the_airflow_provider_and_connectors_and_no_tests(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for name in (
        "sparkdl/cli/jobs/__init__.py",
        "sparkdl/cli/jobs/train.py",
        "sparkdl/cli/jobs/predict.py",
        "sparkdl/cli/_submit.py",
        "sparkdl_airflow/operators.py",
        "sparkdl_airflow/entry/train.py",
        "connectors/__init__.py",
        "sparkdl/connectors/delta.py",
    ):
        assert name in names, f"{name} is not in {os.path.basename(wheel)}"
    tops = {name.split("/")[0] for name in names}
    assert tops == {"sparkdl", "sparkdl_airflow", "connectors", os.path.basename(wheel).split("-py3")[0] + ".dist-info"}
    assert not [name for name in names if "tests/" in name or name.endswith((".pyc", "conftest.py"))]
    assert "sparkdl = sparkdl.cli:sparkdl_main" in entry_points and "[apache_airflow_provider]" in entry_points


def test_client_mode_from_the_wheel_trains_across_hosts_and_ships_sparkdl_and_the_model(
    netcluster, fresh_venv, digits, tmp_path
):
    """The driver on h0 (where sparkdl submit runs), one rank on each worker host; each executor
    received the zip of sparkdl and the user's model module through --py-files."""
    env, state = netcluster
    user = _user_dir(tmp_path)
    output = tmp_path / "run"
    before = {host: _app_dirs(state, host) for host in (1, 2)}
    command = _submit_command(fresh_venv, *_spark_options(state), job_args=_job_args(digits, f"file://{output}"))
    done = _run(command, _env(env, fresh_venv), user)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert "sparkdl-train: done in" in done.stdout and f"model in file://{output}/model" in done.stdout
    _succeeded(str(output))
    for host in (1, 2):
        (app,) = sorted(set(_app_dirs(state, host)) - set(before[host]))
        (executor,) = os.listdir(app)
        shipped = os.listdir(os.path.join(app, executor))
        assert "sparkdl.zip" in shipped and "digits_model.py" in shipped, shipped
    assert os.listdir(user) == ["digits_model.py"]  # nothing written where the user ran it


def test_cluster_mode_runs_the_driver_on_a_worker_host_and_writes_to_the_shared_url(
    netcluster, fresh_venv, digits, tmp_path
):
    """spark-submit refuses a .py application in cluster deploy mode on a standalone master;
    sparkdl submit runs it as Spark's PythonRunner, so a worker host starts the Python driver."""
    env, state = netcluster
    user = _user_dir(tmp_path)
    output, stage = tmp_path / "run", tmp_path / "stage"
    python = os.path.join(fresh_venv, "python")
    options = _spark_options(state, "--deploy-mode", "cluster", "--driver-memory", "512m", "--stage-dir", str(stage))
    options += ["--conf", f"spark.pyspark.driver.python={python}", "--conf", f"spark.pyspark.python={python}"]
    done = _run(
        _submit_command(fresh_venv, *options, job_args=_job_args(digits, f"file://{output}")),
        _env(env, fresh_venv),
        user,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-4000:]}"
    running_on = [line for line in text.splitlines() if "Driver running on" in line]
    assert len(running_on) == 1 and any(f" {a}:" in running_on[0] for a in WORKER_ADDRESSES), running_on
    assert "ended FINISHED" in done.stderr
    drivers = [
        os.path.join(state["dir"], f"work-h{host}", name)
        for host in (1, 2)
        for name in os.listdir(os.path.join(state["dir"], f"work-h{host}"))
        if name.startswith("driver-")
    ]
    (driver_dir,) = drivers
    driver_out = open(os.path.join(driver_dir, "stdout")).read()
    assert f"model in file://{output}/model" in driver_out, driver_out[-3000:]
    metrics = _succeeded(str(output))
    assert metrics["exit_code"] == 0
    # The outputs went to the URL, none into the driver's folder on the worker.
    left_there = os.listdir(driver_dir)
    assert all(name in ("stdout", "stderr") or name.endswith(".jar") for name in left_there), left_there
    assert os.listdir(stage) == []  # the staged files were removed once the driver ended


def _await_line(process: subprocess.Popen, needle: str, timeout: float) -> list:
    """Lines of ``process``'s merged output up to one holding ``needle``."""
    seen = []
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        seen.append(line)
        if needle in line:
            return seen
        assert time.monotonic() < deadline, "".join(seen[-50:])
    raise AssertionError(f"ended before {needle!r}:\n" + "".join(seen[-50:]))


def _processes_naming(text: str) -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if text.encode() in handle.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _start(command: list, env: dict, cwd: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *command], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _signal_when(process: subprocess.Popen, needle: str, signum: int) -> str:
    """Sends ``signum`` once a line holds ``needle``; the rest of the output."""
    try:
        _await_line(process, needle, timeout=180)
        process.send_signal(signum)
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signum, rest[-4000:]
    assert f"sparkdl submit: {signal.Signals(signum).name}: stopped spark-submit and every process it started" in rest
    return rest


def test_ctrl_c_in_client_mode_stops_spark_submit_the_driver_and_its_python_workers(
    netcluster, fresh_venv, digits, tmp_path
):
    """SIGINT while the ranks train (local[2] on h0: every process of the application is on the
    host where sparkdl submit runs, the Python workers too)."""
    env, state = netcluster
    options = ["--master", "local[2]", "--conf", "spark.ui.enabled=false", "--stage-dir", str(tmp_path / "stage")]
    job_args = _job_args(digits, f"file://{tmp_path}/run", epochs=10_000)
    process = _start(
        _submit_command(fresh_venv, *options, job_args=job_args), _env(env, fresh_venv), _user_dir(tmp_path)
    )
    _signal_when(process, "epoch 1/", signal.SIGINT)
    # spark-submit's JVM, the Python driver and Spark's Python workers all ran the fresh
    # virtualenv's files (its Spark, its python) on h0.
    on_h0 = subprocess.run(["ip", "netns", "pids", state["namespaces"][0]], capture_output=True, text=True).stdout
    venv_root = os.path.dirname(fresh_venv)
    left = [int(pid) for pid in on_h0.split() if int(pid) in _processes_naming(venv_root)]
    assert not left and not _processes_naming(str(tmp_path)), [open(f"/proc/{pid}/cmdline").read() for pid in left]


def test_sigterm_in_cluster_mode_kills_the_driver_on_its_worker(netcluster, fresh_venv, digits, tmp_path):
    """SIGTERM once the driver runs on a worker: sparkdl submit has the master kill it, waits for
    spark-submit to see it KILLED, then stops spark-submit."""
    env, state = netcluster
    python = os.path.join(fresh_venv, "python")
    options = _spark_options(state, "--deploy-mode", "cluster", "--driver-memory", "512m")
    options += ["--stage-dir", str(tmp_path / "stage"), "--conf", f"spark.pyspark.driver.python={python}"]
    options += ["--conf", f"spark.pyspark.python={python}"]
    job_args = _job_args(digits, f"file://{tmp_path}/run", epochs=10_000)
    process = _start(
        _submit_command(fresh_venv, *options, job_args=job_args), _env(env, fresh_venv), _user_dir(tmp_path)
    )
    rest = _signal_when(process, "Driver running on", signal.SIGTERM)
    assert "killing driver driver-" in rest and "ended KILLED" in rest, rest[-4000:]
    # The driver's JVM and its Python named this test's folder (the staged job, the --output).
    left = _processes_naming(str(tmp_path))
    assert not left, [open(f"/proc/{pid}/cmdline").read() for pid in left]
