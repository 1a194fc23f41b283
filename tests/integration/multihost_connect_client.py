"""A Spark Connect client on a host of its own (the namespace cluster's h3): its fits run on the
cluster through the Connect server on h0. Prints one JSON line per scenario.

    scripts/netcluster exec h3 -- python tests/integration/multihost_connect_client.py sc://198.18.0.1:15002 DIR

Run by tests/integration/test_multihost_connect.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]


def wait_for_server(host: str, port: int, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"the Connect server at {host}:{port} did not listen within {timeout_s:g}s") from None
            time.sleep(0.5)  # a port has no readiness event: bounded poll


def main() -> int:
    remote, out = sys.argv[1], sys.argv[2]
    host, port = remote[len("sc://") :].rsplit(":", 1)
    wait_for_server(host, int(port))
    import torch
    from models import accuracy, digits_mlp, read_digits
    from pyspark.sql import SparkSession

    import sparkdl
    from examples.digits import write_split

    spark = SparkSession.builder.remote(remote).getOrCreate()
    train, test = write_split(os.path.join(out, "digits"))
    features, labels = read_digits(test)

    def estimator(**overrides):
        records = overrides.pop("records")
        return sparkdl.TorchEstimator(
            model=digits_mlp,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
            feature_cols=["features"],
            label_col="label",
            num_workers=2,
            batch_size=32,
            epochs=3,
            progress=records.append,
            **overrides,
        )

    lines = []
    records = []
    started = time.monotonic()
    try:
        model = estimator(records=records).fit(spark.read.parquet(train))
        lines.append(
            {
                "scenario": "fit",
                "ok": True,
                "epochs": [r.get("epoch") for r in records if "epoch" in r],
                "accuracy": accuracy(model.module, features, labels),
                "seconds": time.monotonic() - started,
                "channel_host": sparkdl_channel_host(spark),
            }
        )
    except Exception as exc:  # noqa: BLE001 - reported to the test
        lines.append(
            {
                "scenario": "fit",
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            }
        )
    # An address the executors cannot reach (every host has 198.19.255.1 on its own docker0).
    spark.conf.set("spark.sparkdl.clientHost", "198.19.255.1")
    started = time.monotonic()
    try:
        estimator(records=[]).fit(spark.read.parquet(train))
        lines.append({"scenario": "unreachable", "ok": True})
    except Exception as exc:  # noqa: BLE001 - expected
        lines.append(
            {
                "scenario": "unreachable",
                "ok": False,
                "error_type": type(exc).__name__,
                "error": str(exc)[:4000],
                "seconds": time.monotonic() - started,
            }
        )
    finally:
        spark.conf.unset("spark.sparkdl.clientHost")
    for line in lines:
        print("MULTIHOST " + json.dumps(line), flush=True)
    spark.stop()
    return 0


def sparkdl_channel_host(spark) -> str:
    from sparkdl._spark import Session

    return Session(spark).channel_host()


if __name__ == "__main__":
    sys.exit(main())
