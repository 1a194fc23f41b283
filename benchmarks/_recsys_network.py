"""``benchmarks/recsys.py --netcluster``: the same sides on a cluster of network namespaces with
shaped links, as ``benchmarks/network.py`` runs (``scripts/netcluster``, docs/deploy.md §7).

The outer process (root) builds a 3-host cluster (h0: the standalone master and the driver; h1,
h2: one 1-core Spark worker each, so each rank has a host and a link of its own), then runs
``benchmarks/recsys.py`` again inside h0 with ``--driver``. That driver generates the click log on
the cluster (the hosts share the filesystem) and, for each rate of ``--rates``, shapes every
host's cluster link with ``tc ... tbf`` (``netcluster shape``) and fits every side; the links are
unshaped and the cluster is taken down at the end, also after a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETCLUSTER = os.path.join(ROOT, "scripts", "netcluster")


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--netcluster", action="store_true", help="run on a namespace cluster with shaped links (root)")
    parser.add_argument("--rates", default="none,1gbit,100mbit", help="tc rates, 'none' = unshaped")
    parser.add_argument("--cluster-name", default="sdr", help="netcluster --name (namespace prefix)")
    parser.add_argument("--cluster-dir", default=os.path.join(ROOT, ".sparkdl-netcluster-recsys"))
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # inside h0


def _rates(args: argparse.Namespace) -> None:
    args.rate_list = [r.strip() for r in args.rates.split(",") if r.strip()]


def link_label(rate: str) -> str:
    return {"none": "unshaped", "loopback": "loopback"}.get(
        rate, rate.replace("gbit", " Gbit/s").replace("mbit", " Mbit/s")
    )


def netcluster(args: argparse.Namespace, *command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, NETCLUSTER, "--name", args.cluster_name, "--dir", args.cluster_dir, *command],
        stdin=subprocess.DEVNULL,
        **kwargs,
    )


def shape(args: argparse.Namespace, rate: str) -> None:
    netcluster(args, "shape", rate, check=True, stdout=subprocess.DEVNULL)


def cluster_session(args: argparse.Namespace):
    """The driver's session inside h0, on the cluster's standalone master."""
    _rates(args)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    with open(os.path.join(args.cluster_dir, "state.json")) as handle:
        state = json.load(handle)
    from pyspark.sql import SparkSession

    address = state["cluster_addresses"][0]
    spark = (
        SparkSession.builder.master(state["master_url"])
        .appName("sparkdl-benchmark-recsys-network")
        .config("spark.driver.host", address)
        .config("spark.driver.bindAddress", address)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executor.instances", str(state["hosts"] - 1))
        .config("spark.executor.memory", "1g")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYTHONPATH", ROOT)
        .config("spark.sparkdl.cacheDir", os.path.join(args.cluster_dir, "cache"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_on_netcluster(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/recsys.py --netcluster needs root (scripts/netcluster creates network namespaces)")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")

    def terminated(signum, frame):  # SIGTERM (timeout, kill) also takes the cluster down
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        up = [sys.executable, NETCLUSTER, "--name", args.cluster_name, "--dir", args.cluster_dir, "up"]
        subprocess.run(
            [*up, "--hosts", "3", "--cores", "1", "--memory", "2g"],
            check=True,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        driver = [sys.executable, os.path.abspath(os.path.join(ROOT, "benchmarks", "recsys.py")), *argv, "--driver"]
        done = netcluster(args, "exec", "h0", "--", *driver, env=env, cwd=ROOT)
        return done.returncode
    finally:
        netcluster(args, "down", env=env)
