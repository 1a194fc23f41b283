"""Spark Connect from another host: the Connect server (the driver) on the namespace cluster's h0,
one worker on h1 and on h2, the client on h3, a host of its own. The executors reach the client's
progress channel over the cluster network; an address they cannot reach fails the fit within a
bound, naming spark.sparkdl.clientHost. Needs root, as tests/integration/test_multihost.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_multihost import SCRIPT, cluster_up

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

CLIENT = os.path.join(REPO_ROOT, "tests", "integration", "multihost_connect_client.py")
PORT = 15002


@pytest.fixture(scope="module")
def connect_cluster(tmp_path_factory):
    """Four hosts (workers on h1 and h2 only) and a Connect server on h0; all taken down after."""
    work = tmp_path_factory.mktemp("netcluster-connect")
    with cluster_up("sdc", str(work / "cluster"), "--hosts", "4", "--workers", "2") as (env, state):
        submit = [
            os.path.join(os.path.dirname(sys.executable), "spark-submit"),
            "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer",
            "--master",
            state["master_url"],
            "--conf",
            "spark.connect.grpc.binding.address=198.18.0.1",
            "--conf",
            f"spark.connect.grpc.binding.port={PORT}",
            "--conf",
            "spark.driver.host=198.18.0.1",
            "--conf",
            "spark.driver.bindAddress=198.18.0.1",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.executor.instances=2",
            "--conf",
            "spark.executor.memory=768m",
            "--conf",
            f"spark.executorEnv.PYTHONPATH={REPO_ROOT}{os.pathsep}{os.path.join(REPO_ROOT, 'tests')}",
            "--conf",
            f"spark.sparkdl.cacheDir={work / 'cache'}",
            "spark-internal",
        ]
        with open(work / "server.log", "w") as log:
            server = subprocess.Popen(
                [sys.executable, SCRIPT, "exec", "h0", "--", *submit],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            yield env, work
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)  # the server's own session: spark-submit and its JVM
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait(timeout=30)


def test_a_connect_client_on_another_host_trains_and_an_unreachable_client_address_fails_in_bounded_time(
    connect_cluster,
):
    env, work = connect_cluster
    done = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "exec",
            "h3",
            "--",
            sys.executable,
            CLIENT,
            f"sc://198.18.0.1:{PORT}",
            str(work / "client"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    server_log = (work / "server.log").read_text(errors="replace")[-3000:]
    assert done.returncode == 0, f"{done.stderr[-4000:]}\nserver:\n{server_log}"
    fit, unreachable = [
        json.loads(line[len("MULTIHOST ") :]) for line in done.stdout.splitlines() if line.startswith("MULTIHOST ")
    ]
    assert fit["ok"], fit
    # The client listened on its own cluster address (the route to the Connect server), and every
    # epoch reached it while the fit ran.
    assert fit["channel_host"] == "198.18.0.4" and fit["epochs"] == [1, 2, 3] and fit["accuracy"] >= 0.8, fit
    assert not unreachable["ok"] and "spark.sparkdl.clientHost" in unreachable["error"], unreachable
    assert "198.19.255.1" in unreachable["error"] and unreachable["seconds"] < 120, unreachable
