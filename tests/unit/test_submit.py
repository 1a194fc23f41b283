"""``sparkdl submit`` without Spark: its command line, the spark-submit command it plans in each
deploy mode, what it ships, how it reads a cluster driver's end, and how it stops what it started
(real processes). tests/integration/test_submit.py runs it for real on a namespace cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest

from sparkdl.cli import _submit_process, sparkdl_main
from sparkdl.cli._common import UsageError
from sparkdl.cli._submit import build_plan, find_spark_submit, model_module_source, submit_main
from sparkdl.cli._submit_args import parse_submit_args
from sparkdl.cli._submit_process import ClusterDriver, group_members
from sparkdl.cli.jobs import JOBS, PREDICT, TRAIN
from tests.conftest import REPO_ROOT

SPARK_HOME, SPARK_SUBMIT = find_spark_submit({})
NO_PYTHON_ENV: dict = {}


def _plan(argv, stage, env=NO_PYTHON_ENV):
    return build_plan(parse_submit_args(argv), SPARK_HOME, SPARK_SUBMIT, str(stage), env)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A user's folder with a model module, as the current directory."""
    (tmp_path / "models.py").write_text("def make_model():\n    return None\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_jobs_are_files_of_the_package_that_run_the_cli():
    assert JOBS == {"train": TRAIN, "predict": PREDICT}
    assert "from sparkdl.cli import main\n" in open(TRAIN).read()
    assert "from sparkdl.cli import predict_main\n" in open(PREDICT).read()
    for name, packaged, entry in (("train.py", TRAIN, "main"), ("predict.py", PREDICT, "predict_main")):
        # jobs/ of a checkout runs the same entry point as the packaged job.
        assert f"sys.exit({entry}())" in open(os.path.join(REPO_ROOT, "jobs", name)).read()
        assert f"sys.exit({entry}())" in open(packaged).read()


def test_spark_submit_options_job_arguments_and_sparkdl_submit_options_are_told_apart():
    options = parse_submit_args(
        [
            "train",
            *("--master=spark://h:7077", "--deploy-mode", "cluster", "-c", "spark.a=1=2", "--conf", "spark.b="),
            *("--py-files", "a.py,b.zip", "--py-files", "c.py", "--driver-memory", "2g", "--verbose"),
            *("--no-ship-sparkdl", "--stage-dir", "/shared", "--name", "mine", "--"),
            *("--master", "local[2]", "--data", "x", "--help"),
        ]
    )
    assert (options.master, options.deploy_mode, options.name, options.stage_dir) == (
        "spark://h:7077",
        "cluster",
        "mine",
        "/shared",
    )
    assert options.conf == [("spark.a", "1=2"), ("spark.b", "")]
    assert options.py_files == ["a.py", "b.zip", "c.py"] and options.passthrough == [
        "--driver-memory",
        "2g",
        "--verbose",
    ]
    assert not options.ship_sparkdl and options.standalone_cluster
    # After --, everything is the job's, its own --master and --help too.
    assert options.job_args == ["--master", "local[2]", "--data", "x", "--help"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["fit"], "the first argument names the job, train or predict (got 'fit')"),
        (
            ["train", "--data", "x"],
            "'--data' is not a spark-submit option nor one of sparkdl submit's; the job's arguments go after --",
        ),
        (["train", "--class", "Main"], "--class is not taken here: sparkdl submit chooses the application"),
        (["train", "--conf", "spark.x"], "--conf 'spark.x': spark-submit's --conf takes KEY=VALUE"),
        (["train", "--deploy-mode", "remote"], "--deploy-mode 'remote': client or cluster"),
        (["predict", "--master"], "--master needs a value"),
    ],
)
def test_bad_arguments_are_a_usage_error_that_says_what_to_change(argv, message, capsys):
    with pytest.raises(UsageError, match="sparkdl submit: ") as caught:
        parse_submit_args(argv)
    assert message in str(caught.value)
    assert sparkdl_main(["submit", *argv]) == 2
    assert message in capsys.readouterr().err


def test_help_is_sparkdl_submits_before_the_separator_and_the_jobs_after_it(capsys):
    assert sparkdl_main(["submit", "train", "--help"]) == 0
    assert "usage: sparkdl submit {train,predict}" in capsys.readouterr().out
    assert submit_main([]) == 2
    assert parse_submit_args(["train", "--", "--help"]).job_args == ["--help"]


def test_client_mode_ships_sparkdl_and_the_model_module_of_the_current_directory(user_dir, tmp_path):
    stage = tmp_path / "stage"
    plan = _plan(["train", "--master", "local[2]", "--", "--data", "d", "--model", "models:make_model"], stage)
    zip_path, model_path = str(stage / "sparkdl.zip"), str(stage / "models.py")
    assert list(plan.stage) == [zip_path, model_path, str(stage / "log4j2.properties")]
    command = plan.command
    assert command[0] == SPARK_SUBMIT and command[-5:] == [TRAIN, "--data", "d", "--model", "models:make_model"]
    assert command[command.index("--py-files") + 1] == f"{zip_path},{model_path}"
    # The driver's Python is this one (it has sparkdl) when nothing else names one.
    assert f"spark.pyspark.driver.python={sys.executable}" in command
    assert "--class" not in command and "--deploy-mode" not in command
    assert plan.driver is None and plan.env["SPARK_SUBMIT_OPTS"].endswith(f"file:{stage}/log4j2.properties")

    stage.mkdir()
    for path, make in plan.stage.items():
        make(path)
    names = zipfile.ZipFile(zip_path).namelist()
    assert "sparkdl/cli/jobs/train.py" in names and "sparkdl/__init__.py" in names
    assert open(model_path).read() == (user_dir / "models.py").read_text()
    assert "logger.client.name = org.apache.spark.deploy.ClientEndpoint" in open(stage / "log4j2.properties").read()


def test_what_the_user_chose_stays_theirs(user_dir, tmp_path):
    argv = [
        "predict",
        "--py-files",
        "models.py",
        "--no-ship-sparkdl",
        "--driver-java-options",
        "-Dlog4j.configurationFile=x",
    ]
    plan = _plan(
        [*argv, "--", "--model", "run/model", "--model-factory=models:make_model"],
        tmp_path,
        {"PYSPARK_PYTHON": "/opt/py"},
    )
    assert plan.stage == {}  # the model module already goes with --py-files; no zip; their own log4j
    assert plan.command[plan.command.index("--py-files") + 1] == "models.py"
    assert not any(item.startswith("spark.pyspark.driver.python") for item in plan.command)
    assert plan.command[-4:] == [PREDICT, "--model", "run/model", "--model-factory=models:make_model"]
    assert plan.env == {}


def test_the_model_module_is_shipped_only_when_the_executors_could_lack_it(user_dir, tmp_path, monkeypatch):
    def source(spec, job="train"):
        flag = "--model" if job == "train" else "--model-factory"
        return model_module_source(parse_submit_args([job, "--", flag, spec]), str(user_dir))

    assert source("models:make_model") == str(user_dir / "models.py")
    package = user_dir / "nets"
    package.mkdir()
    (package / "__init__.py").write_text("")
    assert source("nets.vision:resnet") == str(package)
    assert source("json:loads") is None and source("torch.nn:Linear") is None  # the stdlib, site-packages
    assert source("nowhere:make") is None  # the job then says it cannot import it
    assert source("models:make_model", job="predict") == str(user_dir / "models.py")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "their_models.py").write_text("")
    monkeypatch.syspath_prepend(str(elsewhere))
    assert source("their_models:f") == str(elsewhere / "their_models.py")  # on PYTHONPATH, not installed

    plan = _plan(["train", "--", "--model", "nets.vision:resnet"], tmp_path / "stage")
    (tmp_path / "stage").mkdir()
    plan.stage[str(tmp_path / "stage" / "nets.zip")](str(tmp_path / "stage" / "nets.zip"))
    assert zipfile.ZipFile(tmp_path / "stage" / "nets.zip").namelist() == ["nets/__init__.py"]


def test_standalone_cluster_mode_runs_the_job_as_pythonrunner_from_the_stage(user_dir, tmp_path):
    stage = tmp_path / "stage"
    argv = ["train", "--master", "spark://m:7077", "--deploy-mode", "cluster", "--stage-dir", str(tmp_path)]
    argv += ["--py-files", f"extra.py,hdfs:///lib/dep.zip,local:/opt/lib/site.zip,file://{user_dir}/models.py"]
    plan = _plan([*argv, "--", "--model", "models:make_model", "--output", "s3://b/run"], stage)
    command = plan.command
    jar = command[command.index("--class") + 2]
    assert command[command.index("--class") + 1] == "org.apache.spark.deploy.PythonRunner"
    assert os.path.dirname(jar) == str(stage) and os.path.basename(jar).startswith("spark-tags_")
    job, driver_py_files = command[command.index(jar) + 1], command[command.index(jar) + 2]
    assert job == str(stage / "train.py") and plan.stage[job] is not None
    zip_path, extra, models = (str(stage / name) for name in ("sparkdl.zip", "extra.py", "models.py"))
    # The Python driver puts the staged files (the user's own copied in) and local: ones on its
    # path before Spark starts ...
    assert driver_py_files.split(",") == [zip_path, extra, "local:/opt/lib/site.zip", models]
    # ... the executors get every one, remote ones too, through the SparkContext.
    every = [zip_path, extra, "hdfs:///lib/dep.zip", "local:/opt/lib/site.zip", models]
    assert command[command.index("--py-files") + 1].split(",") == every
    assert command[command.index("--files") + 1].split(",") == every
    assert sorted(plan.stage) == sorted([zip_path, extra, models, job, jar, str(stage / "log4j2.properties")])
    assert command[-4:] == ["--model", "models:make_model", "--output", "s3://b/run"]
    assert "spark.standalone.submit.waitAppCompletion=true" in command
    assert not any(item.startswith("spark.pyspark.driver.python") for item in command)  # a path on the workers
    assert plan.driver is not None and plan.driver.master == "spark://m:7077" and plan.driver.reads_log

    waiting = _plan([*argv[:7], "--conf", "spark.standalone.submit.waitAppCompletion=false", "--"], stage)
    assert not waiting.driver.waits and command.count("spark.standalone.submit.waitAppCompletion=true") == 1


def test_standalone_cluster_mode_needs_a_stage_dir_every_host_mounts(user_dir, tmp_path, capsys):
    argv = ["train", "--master", "spark://m:7077", "--deploy-mode", "cluster"]
    with pytest.raises(UsageError, match="needs --stage-dir DIR: the worker that Spark picks for the driver"):
        _plan([*argv, "--"], tmp_path)
    assert submit_main([*argv, "--stage-dir", "s3://bucket/stage", "--dry-run", "--"]) == 2
    assert "--stage-dir 's3://bucket/stage': a directory of this host" in capsys.readouterr().err
    assert submit_main([*argv, "--stage-dir", f"file://{tmp_path}/shared", "--dry-run", "--", "--data", "d"]) == 0
    out = capsys.readouterr().out
    assert f"# stages {tmp_path}/shared/sparkdl-submit-DRY-RUN/train.py" in out
    assert "--class org.apache.spark.deploy.PythonRunner" in out and out.rstrip().endswith("--data d")
    assert not os.path.exists(tmp_path / "shared")  # a dry run writes nothing


@pytest.mark.parametrize("master", ["yarn", "k8s://https://api:6443", None])
def test_other_cluster_managers_get_the_python_application_as_spark_submit_takes_it(user_dir, tmp_path, master):
    argv = ["train", "--deploy-mode", "cluster"] + (["--master", master] if master else [])
    plan = _plan([*argv, "--", "--data", "d"], tmp_path)
    assert "--class" not in plan.command and plan.command[-3:] == [TRAIN, "--data", "d"] and plan.driver is None
    assert not any(item.startswith("spark.pyspark.driver.python") for item in plan.command)


def test_spark_submit_comes_from_spark_home_else_the_pyspark_package(tmp_path):
    assert SPARK_SUBMIT == os.path.join(SPARK_HOME, "bin", "spark-submit") and os.access(SPARK_SUBMIT, os.X_OK)
    import pyspark

    assert SPARK_HOME == os.path.dirname(pyspark.__file__)
    with pytest.raises(UsageError, match=f"SPARK_HOME \\({tmp_path}\\) has no bin/spark-submit; set SPARK_HOME"):
        find_spark_submit({"SPARK_HOME": str(tmp_path)})


#: ClientEndpoint's lines, as spark-submit 4.3 printed them in the namespace cluster.
SUBMITTED = "26/12/06 01:29:19 INFO ClientEndpoint: Driver successfully submitted as driver-20261206012919-0000"
RUNNING = (
    "26/12/06 01:29:24 INFO ClientEndpoint: Driver running on 198.18.0.3:7078 (worker-20261206012900-198.18.0.3-7078)"
)
FINAL = (
    "26/12/06 01:29:44 INFO ClientEndpoint: State of driver driver-20261206012919-0000 is {}, exiting spark-submit JVM."
)


@pytest.mark.parametrize("state, status", [("FINISHED", 0), ("FAILED", 1), ("KILLED", 1), ("ERROR", 1)])
def test_a_cluster_drivers_end_is_read_from_spark_submits_log(state, status):
    driver = ClusterDriver(master="spark://m:7077", spark_class="spark-class")
    for line in (
        SUBMITTED,
        "26/12/06 01:29:24 INFO ClientEndpoint: State of driver-x is RUNNING",
        RUNNING,
        FINAL.format(state),
    ):
        driver.read(line)
    assert (driver.driver_id, driver.address, driver.state) == ("driver-20261206012919-0000", "198.18.0.3:7078", state)
    # spark-submit itself exits 0 whatever the driver did.
    code, summary = driver.outcome(0)
    assert (
        code == status
        and f"ran on 198.18.0.3:7078 (worker-20261206012900-198.18.0.3-7078) and ended {state}" in summary
    )


def test_without_the_final_state_the_exit_status_says_what_is_known():
    not_waiting = ClusterDriver(master="m", spark_class="c", waits=False)
    not_waiting.read(SUBMITTED)
    assert not_waiting.outcome(0)[0] == 0 and "did not wait" in not_waiting.outcome(0)[1]
    assert ClusterDriver(master="m", spark_class="c").outcome(0)[0] == 1
    assert ClusterDriver(master="m", spark_class="c").outcome(3)[0] == 3
    theirs = ClusterDriver(master="m", spark_class="c", reads_log=False)
    assert theirs.outcome(0) == (0, theirs.outcome(0)[1]) and "not the driver's" in theirs.outcome(0)[1]


#: run_spark_submit on its own: the module is loaded from its file (standard library only), not
#: through sparkdl.cli, whose commands import torch.
RUNNER = textwrap.dedent(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("submit_process", sys.argv[1])
    module = sys.modules["submit_process"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.KILL_GRACE_S = float(sys.argv[2])
    sys.exit(module.run_spark_submit(sys.argv[3:], {"PATH": "/usr/bin:/bin"}))
    """
)


def _runner(grace_s: float, script: str) -> subprocess.Popen:
    """run_spark_submit in a process of its own (signal handlers are the main thread's) on a
    shell script standing in for a process tree."""
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, _submit_process.__file__, str(grace_s), "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _group_of_child(runner: subprocess.Popen) -> int:
    """The process group of the runner's child: its pid, printed first by the script."""
    return int(runner.stdout.readline())


def test_the_exit_status_is_the_childs_and_nothing_of_it_is_left():
    runner = _runner(1.0, "echo $$; (trap '' TERM; exec sleep 60) & exit 3")
    group = _group_of_child(runner)
    assert runner.wait(timeout=30) == 3
    assert group_members(group) == []  # the orphan that ignores SIGTERM was killed after the grace


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_whole_group_and_exits_128_plus_its_number(signum):
    runner = _runner(30.0, "echo $$; sleep 60 & sleep 60 & wait")
    group = _group_of_child(runner)
    started = time.monotonic()
    runner.send_signal(signum)
    _, err = runner.communicate(timeout=30)
    assert runner.returncode == 128 + signum and time.monotonic() - started < 10, err
    assert f"sparkdl submit: {signal.Signals(signum).name}: stopped spark-submit and every process it started" in err
    assert group_members(group) == []


def test_a_second_signal_skips_the_grace_period():
    # The shell says when the first signal reached its group, then runs on in a new sleep. Its
    # trap is set before it prints its pid: a signal sent between the two killed it (CI, once).
    runner = _runner(60.0, "trap 'echo stopping' TERM; echo $$; sleep 60 & wait; sleep 60")
    group = _group_of_child(runner)
    started = time.monotonic()
    runner.send_signal(signal.SIGTERM)
    assert runner.stdout.readline() == "stopping\n"
    runner.send_signal(signal.SIGTERM)
    runner.communicate(timeout=30)
    assert runner.returncode == 128 + signal.SIGTERM and time.monotonic() - started < 30
    assert group_members(group) == []


def test_logs_are_quiet_unless_the_user_configures_log4j_for_spark_submits_jvm(user_dir, tmp_path):
    cluster = ["train", "--master", "spark://m:7077", "--deploy-mode", "cluster", "--stage-dir", str(tmp_path)]
    # In cluster mode the driver's options are the worker's JVM's, not spark-submit's: the client
    # stays quiet, and its log still says how the driver ended.
    theirs = _plan([*cluster, "--driver-java-options", "-Dlog4j.configurationFile=x", "--"], tmp_path)
    assert "log4j2.properties" in theirs.env["SPARK_SUBMIT_OPTS"] and theirs.driver.reads_log
    own = _plan([*cluster, "--"], tmp_path, {"SPARK_SUBMIT_OPTS": "-Xss4m -Dlog4j2.configurationFile=mine"})
    assert own.env == {} and not own.driver.reads_log
    client = _plan(["train", "--conf", "spark.driver.extraJavaOptions=-Dlog4j.configurationFile=x", "--"], tmp_path)
    assert client.env == {}
    kept = _plan(["train", "--"], tmp_path, {"SPARK_SUBMIT_OPTS": "-Xss4m"})
    assert kept.env["SPARK_SUBMIT_OPTS"] == f"-Xss4m -Dlog4j.configurationFile=file:{tmp_path}/log4j2.properties"


def test_a_stage_dir_that_cannot_be_made_is_a_usage_error(user_dir, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert submit_main(["train", "--stage-dir", str(tmp_path / "a-file" / "stage"), "--"]) == 2
    assert f"--stage-dir '{tmp_path}/a-file/stage': cannot make a folder there" in capsys.readouterr().err
