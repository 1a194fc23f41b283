"""Under Spark's own encryption (``spark.network.crypto.enabled``, ``spark.authenticate``), for real:
sparkdl refuses plaintext collectives, naming the setting, and once they are accepted trains with
its own connections encrypted. The bytes on the wire are checked in tests/unit/test_secure.py,
test_channel.py and test_ps_wire.py (real sockets through a recording proxy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.spark

APP = os.path.join(REPO_ROOT, "tests", "integration", "encrypted_cluster_app.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    output = tmp_path_factory.mktemp("encrypted") / "results.json"
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    done = subprocess.run(
        [sys.executable, APP, str(output)], env=env, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    return json.loads(output.read_text())


def test_plaintext_collectives_are_refused_naming_the_setting(results):
    assert results["refused"] is not None
    assert "spark.network.crypto.enabled=true" in results["refused"]
    assert "spark.sparkdl.allowUnencryptedCollectives=true" in results["refused"]


def test_once_accepted_the_ranks_run_encrypted(results):
    assert results["run"] == {"encrypt": True, "world": 2.0}


def test_the_parameter_server_trains_over_encrypted_connections(results):
    trained = results["parameter_server"]
    assert trained["epochs"] == 2 and trained["loss"] < trained["first_loss"]
