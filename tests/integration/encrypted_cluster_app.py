"""The Spark application behind test_encrypted_cluster.py (its own process: it needs a
SparkContext with Spark's authentication and RPC encryption on, and a process holds one).

Usage: python encrypted_cluster_app.py OUTPUT_JSON

``local-cluster[2,1,1024]`` with ``spark.authenticate`` and ``spark.network.crypto.enabled``: a
run is refused until ``spark.sparkdl.allowUnencryptedCollectives`` accepts plaintext collectives;
then the channel, the rendezvous and the parameter server all run encrypted.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def what_the_ranks_see(ctx: Any) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    ctx.report(marker="sparkdl-plaintext-marker")  # through the (encrypted) progress channel
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"encrypt": ctx._rank.env.encrypt, "world": float(total.item())}


def main(output: str) -> None:
    import sparkdl
    from tests.cluster import local_cluster_builder
    from tests.models import digits_mlp

    spark = (
        local_cluster_builder("sparkdl-encrypted")
        .config("spark.authenticate", "true")
        .config("spark.authenticate.secret", "sparkdl-test-secret")
        .config("spark.network.crypto.enabled", "true")
        .config("spark.io.encryption.enabled", "true")
        .config("spark.executorEnv.PYTHONPATH", REPO_ROOT)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    results: Dict[str, Any] = {}
    try:
        try:
            sparkdl.run(what_the_ranks_see, num_workers=2, progress=False, spark=spark)
            results["refused"] = None
        except sparkdl.ConfigError as error:
            results["refused"] = str(error)
        spark.conf.set("spark.sparkdl.allowUnencryptedCollectives", "true")
        results["run"] = sparkdl.run(what_the_ranks_see, num_workers=2, progress=False, spark=spark)
        from sklearn.datasets import load_digits

        digits = load_digits()
        rows = [(list(map(float, x)), int(y)) for x, y in zip(digits.data[:512] / 16.0, digits.target[:512])]
        frame = spark.createDataFrame(rows, "features array<double>, label long")
        model = sparkdl.TorchEstimator(
            model=digits_mlp, strategy=sparkdl.ParameterServer(), num_workers=2, batch_size=32, epochs=2, progress=False
        ).fit(frame)
        results["parameter_server"] = {
            "epochs": len(model.history),
            "loss": model.history[-1]["loss"],
            "first_loss": model.history[0]["loss"],
        }
    finally:
        spark.stop()
    with open(output, "w") as handle:
        json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
