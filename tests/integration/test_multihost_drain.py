"""A host drained: Spark's graceful decommissioning of a worker (SIGPWR to it, as a node's
shutdown or a Kubernetes pre-stop hook does), or SIGTERM to an executor's JVM under
spark.executor.decommission.signal=TERM, while a fit runs. The ranks take a checkpoint at once
(sparkdl._runtime.drain), the attempt ends without counting as a failure (max_failures=0), and the run
resumes from that very step on the host that is left (min_workers=1). One cluster for both
tests, the SIGTERM one first: it drains one executor and leaves its worker in service, while a
decommissioned worker stays so (the last test). Needs root, as tests/integration/test_multihost.py."""

from __future__ import annotations

import pytest

from tests.integration.test_multihost import _drive, cluster_up

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


@pytest.fixture(scope="module")
def decommissioning_cluster(tmp_path_factory):
    state_dir = str(tmp_path_factory.mktemp("netcluster-drain"))
    with cluster_up("sdd", state_dir, "--hosts", "3", "--spark-conf", "spark.decommission.enabled=true") as (
        env,
        _state,
    ):
        yield env


@pytest.mark.parametrize(
    "how, conf",
    [
        # SIGTERM decommissions instead of killing the executor (Kubernetes, spot reclaim).
        ("sigterm", ["spark.decommission.enabled=true", "spark.executor.decommission.signal=TERM"]),
        # Last: the worker it decommissions takes no executor again, for the cluster's lifetime.
        ("decommission", ["spark.decommission.enabled=true"]),
    ],
)
def test_a_decommissioned_host_drains_the_run_with_a_checkpoint_and_it_resumes_there(
    decommissioning_cluster, tmp_path, how, conf
):
    (line,) = _drive(decommissioning_cluster, tmp_path, f"drain:{how}", conf=conf)
    assert line["ok"], f"{line.get('error')}\n{line.get('traceback', '')}"
    first, second = line["attempts"]
    # Not a failure: max_failures=0 and still relaunched.
    assert first.get("drained") is True and "HostDrained: drained at step" in first["error"], first
    assert "Spark is decommissioning executor" in first["error"] and line["decommissioned"] in first["error"], first
    # A decommissioned worker (SIGPWR) takes no executor again: the relaunch runs on the host that
    # is left. Under SIGTERM only the executor drains; its worker is alive, so the master may start
    # a replacement executor there before the relaunch gathers its slots (both are right).
    relaunch_sizes = {"decommission": (1,), "sigterm": (1, 2)}[how]
    assert second["error"] is None and line["workers"][0] == 2 and line["workers"][1] in relaunch_sizes, line
    drained_at = int(first["error"].split("drained at step ")[1].split()[0])
    # The checkpoint of the drain step itself: the relaunch redid no step. The notice came after
    # step 12; the ranks agree about every half second (steps of 0.05 s here: every 10 or fewer).
    assert drained_at > 12, first
    assert line["steps"]["resumed_at"] == drained_at, line
    assert line["accuracy"] >= 0.6, line
