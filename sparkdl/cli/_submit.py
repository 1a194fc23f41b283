"""``sparkdl submit train|predict [spark-submit options] -- [job arguments]``: spark-submit on the
job that ships inside the package (:mod:`sparkdl.cli.jobs`), with what the executors need.

What it adds to a plain spark-submit:

- **The application.** ``sparkdl/cli/jobs/train.py`` or ``predict.py`` of the installed sparkdl,
  so a ``pip install sparkdl-torch`` has something to submit.
- **sparkdl for the executors.** A zip of the installed sparkdl (``sparkdl package``) goes with
  ``--py-files`` unless ``--no-ship-sparkdl`` (executors that have sparkdl installed, or a packed
  virtualenv given with ``--archives``). Shipped by default so that the executors run the very
  code the driver runs.
- **The model's module.** The module of the job's ``--model module:factory`` (``predict``:
  ``--model-factory``) goes with ``--py-files`` when it is a file or package in the current
  directory, or anywhere outside an installed location (site-packages, the standard library).
- **The driver's Python** in client mode: this interpreter (it has sparkdl), unless
  ``spark.pyspark.driver.python``/``spark.pyspark.python`` or ``PYSPARK_DRIVER_PYTHON``/
  ``PYSPARK_PYTHON`` say otherwise.
- **Cluster deploy mode on a standalone master**, which spark-submit refuses for a ``.py``
  application: the job runs as the JVM application ``org.apache.spark.deploy.PythonRunner`` (as
  YARN's cluster mode runs Python drivers), so the worker that Spark picks starts the Python
  driver. The worker reads the job, the jar it starts the driver from and the shipped files from
  ``--stage-dir``, which every host must mount at the same path; the driver's Python is
  ``spark.pyspark.driver.python`` (a path on the worker hosts). spark-submit waits for the driver
  (``spark.standalone.submit.waitAppCompletion``) and the exit status says how it ended.

spark-submit's output streams through; the exit status is the job's (0, 1 training failed, 2 bad
arguments; in standalone cluster mode 0 when the driver finished, 1 when it failed or was
killed). SIGINT/SIGTERM/SIGHUP stop spark-submit and every process it started (in standalone
cluster mode they also kill the driver on the cluster) and exit 128 + the signal's number.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
import urllib.parse
import zipfile
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from sparkdl.cli._common import UsageError
from sparkdl.cli._package import package
from sparkdl.cli._submit_args import USAGE, SubmitOptions, asks_for_help, parse_submit_args
from sparkdl.cli._submit_process import ClusterDriver, run_spark_submit
from sparkdl.cli.jobs import JOBS

#: Where each job names the module of the model factory it imports.
MODEL_OPTIONS = {"train": "--model", "predict": "--model-factory"}
PYTHON_RUNNER = "org.apache.spark.deploy.PythonRunner"
#: spark-submit's log: warnings and errors only, so that the job's progress lines stay readable (as
#: jobs/log4j2.properties), but for the lines of a standalone cluster-mode client that say which
#: driver was submitted, where it runs and how it ended (sparkdl submit reads them).
SPARK_LOG4J = """rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.client.name = org.apache.spark.deploy.ClientEndpoint
logger.client.level = info
"""


def find_spark_submit(env: Mapping[str, str]) -> Tuple[str, str]:
    """``(spark_home, its bin/spark-submit)``: ``SPARK_HOME``'s, else the pyspark package's."""
    home = env.get("SPARK_HOME")
    where = "SPARK_HOME"
    if not home:
        spec = importlib.util.find_spec("pyspark")
        if spec is None or not spec.submodule_search_locations:
            raise UsageError("sparkdl submit: no spark-submit: set SPARK_HOME, or pip install pyspark")
        home, where = list(spec.submodule_search_locations)[0], "the pyspark package"
    submit = os.path.join(home, "bin", "spark-submit")
    if not os.access(submit, os.X_OK):
        raise UsageError(f"sparkdl submit: {where} ({home}) has no bin/spark-submit; set SPARK_HOME to a Spark")
    return home, submit


def model_module_source(options: SubmitOptions, cwd: str) -> Optional[str]:
    """The file or package directory of the job's model module, when it must be shipped: found in
    ``cwd`` (where the job's own loader looks too), or importable from outside an installed
    location. None when the job names no module, it is installed, or it cannot be found (the job
    then says so itself)."""
    flag = MODEL_OPTIONS[options.job]
    spec = None
    for index, argument in enumerate(options.job_args):
        if argument == flag and index + 1 < len(options.job_args):
            spec = options.job_args[index + 1]
        elif argument.startswith(flag + "="):
            spec = argument[len(flag) + 1 :]
    top = (spec or "").partition(":")[0].split(".")[0]
    if not top:
        return None
    for candidate in (os.path.join(cwd, top + ".py"), os.path.join(cwd, top)):
        if os.path.isfile(candidate) or os.path.isfile(os.path.join(candidate, "__init__.py")):
            return candidate
    found = importlib.util.find_spec(top)  # a top-level name: finds, runs nothing
    if found is None or not found.origin or not os.path.isfile(found.origin):
        return None
    source = os.path.dirname(found.origin) if found.submodule_search_locations else found.origin
    return None if _installed(source) else source


def _installed(path: str) -> bool:
    real = os.path.realpath(path)
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return any(real.startswith(os.path.realpath(root) + os.sep) for root in roots) or any(
        part in ("site-packages", "dist-packages") for part in real.split(os.sep)
    )


#: Files to stage: path -> what writes it there.
_Files = Dict[str, Callable[[str], object]]


@dataclasses.dataclass
class Plan:
    """What one submission runs: the command, its environment's additions, and the files to write
    into the stage folder first (path -> how to make it)."""

    command: List[str]
    env: Dict[str, str]
    stage: _Files
    driver: Optional[ClusterDriver] = None


def build_plan(options: SubmitOptions, spark_home: str, spark_submit: str, stage: str, env: Mapping[str, str]) -> Plan:
    """The spark-submit command for ``options``, with the files shipped from ``stage``."""
    files: _Files = {}
    if options.ship_sparkdl:
        files[os.path.join(stage, "sparkdl.zip")] = package
    shipped_names = {os.path.basename(item.rstrip("/")) for item in options.py_files}
    source = model_module_source(options, os.getcwd())
    if source is not None and not {os.path.basename(source), os.path.basename(source) + ".zip"} & shipped_names:
        if os.path.isdir(source):
            files[os.path.join(stage, os.path.basename(source) + ".zip")] = _zipper(source)
        else:
            files[os.path.join(stage, os.path.basename(source))] = _copier(source)
    conf = list(options.conf)
    if options.standalone_cluster:
        return _standalone_cluster_plan(options, spark_home, spark_submit, stage, env, files, conf)
    if not options.cluster_mode and not _driver_python_given(options, env):
        conf.append(("spark.pyspark.driver.python", sys.executable))
    command = _common_head(options, spark_submit, conf, list(files) + options.py_files, options.files)
    plan_env = _quiet_logs(options, env, stage, files)
    return Plan(command=command + [JOBS[options.job], *options.job_args], env=plan_env, stage=files)


def _standalone_cluster_plan(
    options: SubmitOptions,
    spark_home: str,
    spark_submit: str,
    stage: str,
    env: Mapping[str, str],
    files: _Files,
    conf: List[Tuple[str, str]],
) -> Plan:
    """The PythonRunner route: the worker copies the jar (``{{USER_JAR}}``: any jar will do, the
    class is on every worker's classpath) and the driver runs ``python JOB PY_FILES ARGS``."""
    if options.stage_dir is None:
        raise UsageError(
            "sparkdl submit: --deploy-mode cluster on a standalone master (spark://) needs --stage-dir DIR: the "
            "worker that Spark picks for the driver reads the job, the jar it starts it from and the shipped files "
            "there, so DIR must be mounted at the same path on every host"
        )
    jars = sorted(name for name in os.listdir(os.path.join(spark_home, "jars")) if name.endswith(".jar"))
    jars = [name for name in jars if name.startswith("spark-tags_")] or jars  # 16 KB, in every Spark
    if not jars:
        raise UsageError(f"sparkdl submit: {spark_home}/jars holds no jar; set SPARK_HOME to a Spark")
    jar = os.path.join(stage, jars[0])
    job = os.path.join(stage, os.path.basename(JOBS[options.job]))
    files[jar] = _copier(os.path.join(spark_home, "jars", jars[0]))
    files[job] = _copier(JOBS[options.job])
    shipped = [path for path in files if path not in (jar, job)]
    user, user_on_driver = _user_py_files(options.py_files, stage, files)
    py_files = shipped + user
    if options.setting("spark.standalone.submit.waitAppCompletion") is None:
        conf.append(("spark.standalone.submit.waitAppCompletion", "true"))
    command = _common_head(options, spark_submit, conf, py_files, options.files + py_files)
    command += ["--class", PYTHON_RUNNER, jar, job, ",".join(shipped + user_on_driver), *options.job_args]
    plan_env = _quiet_logs(options, env, stage, files)
    waits = options.setting("spark.standalone.submit.waitAppCompletion") != "false"
    driver = ClusterDriver(
        master=options.effective_master or "",
        spark_class=os.path.join(spark_home, "bin", "spark-class"),
        waits=waits,
        reads_log="SPARK_SUBMIT_OPTS" in plan_env,
    )
    return Plan(command=command, env=plan_env, stage=files, driver=driver)


def _quiet_logs(options: SubmitOptions, env: Mapping[str, str], stage: str, files: _Files) -> Dict[str, str]:
    """spark-submit's own JVM (the driver in client mode, the client in cluster mode) logs warnings
    and errors only, and the lines of how a cluster driver ended (:data:`SPARK_LOG4J`); not when
    the user names a log4j configuration of their own."""
    own = [env.get("SPARK_SUBMIT_OPTS", "")]
    if not options.cluster_mode:  # the driver is spark-submit's JVM: its options are the driver's
        own.append(options.setting("spark.driver.extraJavaOptions") or "")
        pairs = zip(options.passthrough, options.passthrough[1:])
        own += [value for option, value in pairs if option == "--driver-java-options"]
    if any("log4j" in text for text in own):
        return {}
    path = os.path.join(stage, "log4j2.properties")
    files[path] = _writer(SPARK_LOG4J)
    return {"SPARK_SUBMIT_OPTS": f"{env.get('SPARK_SUBMIT_OPTS', '')} -Dlog4j.configurationFile=file:{path}".strip()}


def _user_py_files(py_files: List[str], stage: str, files: _Files) -> Tuple[List[str], List[str]]:
    """The user's ``--py-files`` for a driver on a worker: a path of this host (or ``file:``) is
    copied into the stage, since the worker may not see it; ``local:`` (on every host) and remote
    URLs stay. Returns them all, and those the Python driver puts on its path before it starts
    Spark (PythonRunner takes local files only; remote ones come with the SparkContext)."""
    every, on_driver = [], []
    for item in py_files:
        parsed = urllib.parse.urlparse(item)
        if parsed.scheme in ("", "file"):
            staged = os.path.join(stage, os.path.basename(parsed.path))
            files[staged] = _copier(parsed.path)
            every.append(staged)
            on_driver.append(staged)
        else:
            every.append(item)
            if parsed.scheme == "local":
                on_driver.append(item)
    return every, on_driver


def _common_head(
    options: SubmitOptions, spark_submit: str, conf: List[Tuple[str, str]], py_files: List[str], files: List[str]
) -> List[str]:
    command = [spark_submit]
    if options.master:
        command += ["--master", options.master]
    if options.deploy_mode:
        command += ["--deploy-mode", options.deploy_mode]
    command += ["--name", options.name or f"sparkdl {options.job}"]
    for key, value in conf:
        command += ["--conf", f"{key}={value}"]
    if py_files:
        command += ["--py-files", ",".join(py_files)]
    if files:
        command += ["--files", ",".join(files)]
    return command + options.passthrough


def _driver_python_given(options: SubmitOptions, env: Mapping[str, str]) -> bool:
    keys = ("spark.pyspark.driver.python", "spark.pyspark.python")
    return any(options.setting(key) for key in keys) or any(
        env.get(name) for name in ("PYSPARK_DRIVER_PYTHON", "PYSPARK_PYTHON")
    )


def _copier(source: str) -> Callable[[str], object]:
    return lambda destination: shutil.copyfile(source, destination)


def _writer(text: str) -> Callable[[str], object]:
    def write(destination: str) -> None:
        with open(destination, "w") as handle:
            handle.write(text)

    return write


def _zipper(directory: str) -> Callable[[str], object]:
    """A zip of the package ``directory`` (its name at the top, as ``--py-files`` wants it)."""

    def write(destination: str) -> None:
        base = os.path.dirname(os.path.abspath(directory))
        with zipfile.ZipFile(destination, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for folder, dirs, names in os.walk(directory):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for name in sorted(names):
                    if not name.endswith((".pyc", ".pyo")):
                        full = os.path.join(folder, name)
                        archive.write(full, os.path.relpath(full, base))

    return write


def _new_stage(options: SubmitOptions) -> str:
    """A new folder for this submission's staged files, in ``--stage-dir`` or the temp folder (a
    dry run only names one)."""
    root = _stage_root(options)
    if options.dry_run:
        return os.path.join(root or tempfile.gettempdir(), "sparkdl-submit-DRY-RUN")
    try:
        if root is not None:
            os.makedirs(root, exist_ok=True)
        return tempfile.mkdtemp(prefix="sparkdl-submit-", dir=root)
    except OSError as exc:
        raise UsageError(
            f"sparkdl submit: --stage-dir {options.stage_dir!r}: cannot make a folder there: {exc}"
        ) from exc


def _stage_root(options: SubmitOptions) -> Optional[str]:
    """``--stage-dir`` as a local directory (a ``file://`` URL is one)."""
    if options.stage_dir is None:
        return None
    given = options.stage_dir
    if given.startswith("file://"):
        given = given[len("file://") :]
    if "://" in given:
        raise UsageError(
            f"sparkdl submit: --stage-dir {options.stage_dir!r}: a directory of this host (spark-submit and the "
            "worker that runs the driver read the staged files as local files), not a URL"
        )
    return os.path.abspath(given)


def submit_main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``sparkdl submit``; returns the exit status (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or asks_for_help(argv):
        print(USAGE)
        return 0 if argv else 2
    try:
        options = parse_submit_args(argv)
        spark_home, spark_submit = find_spark_submit(os.environ)
        stage = _new_stage(options)
        try:
            plan = build_plan(options, spark_home, spark_submit, stage, os.environ)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    if options.dry_run:
        for path in plan.stage:
            print(f"# stages {path}")
        print(
            " ".join([*(f"{name}={shlex.quote(value)}" for name, value in plan.env.items()), shlex.join(plan.command)])
        )
        return 0
    keep = plan.driver is not None and not plan.driver.waits
    try:
        try:
            for path, make in plan.stage.items():
                make(path)
        except OSError as exc:
            print(f"sparkdl submit: cannot stage {os.path.basename(path)} in {stage}: {exc}", file=sys.stderr)
            return 1
        return run_spark_submit(plan.command, {**os.environ, **plan.env}, plan.driver)
    finally:
        if not keep:
            shutil.rmtree(stage, ignore_errors=True)
