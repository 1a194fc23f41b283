"""`sparkdl.compare` on digits: the example table in README's "Strategies" section.

Starts its own ``local-cluster[2,1,1024]`` application, writes digits as Parquet, and compares the
default strategies for 5 epochs with a 20% validation hold-out. Run from the repository root::

    .venv/bin/python benchmarks/compare_digits.py     # writes /tmp/sparkdl-compare-digits/compare.{json,png}
"""

from __future__ import annotations

import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
# Executors must run this interpreter and everything stays on loopback; set before the JVM starts.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import torch  # noqa: E402

import sparkdl  # noqa: E402
from examples.digits import local_session, write_split  # noqa: E402


def mlp() -> torch.nn.Module:
    """The test suite's digits MLP; defined here so Spark ships it by value."""
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def accuracy(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == label).float().mean()


def main() -> None:
    spark = local_session("sparkdl-compare-digits")
    try:
        train, _ = write_split(tempfile.mkdtemp())
        result = sparkdl.compare(
            model=mlp,
            data=train,
            feature_cols=["features"],
            label_col="label",
            epochs=5,
            batch_size=32,
            optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
            loss=torch.nn.functional.cross_entropy,
            validation=0.2,
            metrics={"accuracy": accuracy},
            target_loss=0.3,
            output_dir="/tmp/sparkdl-compare-digits",
        )
        print(result.table("markdown"))
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
