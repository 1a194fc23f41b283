"""Subnormal floats: a fit whose loss reaches 0 on x86 CPUs, with and without flushing them to zero.

    .venv/bin/python benchmarks/subnormal_floats.py [--epochs 8]

The model and data of the plan test (tests/integration/test_multihost.py: a 256-1024-1024-10 MLP,
Adam, ten well-separated classes, 16 steps of 32 rows per epoch on each of 2 workers), trained
with ModelAveraging(τ=16) and with DiLoCo(τ=16) on ``local-cluster[2,1,1024]``, each once with
``spark.sparkdl.flushDenormals=true`` (sparkdl's default) and once with ``false``. DiLoCo's outer
Nesterov step drives this easy problem's loss to exactly 0: its gradients, and Adam's averages of
their squares, underflow to subnormal floats, on which x86 CPUs compute in microcode. Prints per
fit the median samples/s of the epochs after the first, the final loss and the ratio to the same
strategy's flushed fit, side by side in one run: compare the rows, not the absolute figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
# The plan test's model and data, as that test builds them (tests/integration/multihost_app.py).
PLAN_APP_DIR = os.path.join(ROOT, "tests", "integration")
sys.path.insert(0, PLAN_APP_DIR)


def adam(params):
    import torch

    return torch.optim.Adam(params, lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    from _spark import local_cluster
    from multihost_app import PLAN_EPOCH_ROWS, plan_data, plan_mlp

    import sparkdl

    strategies = {
        "ModelAveraging(τ=16)": sparkdl.ModelAveraging(sync_every=16),
        "DiLoCo(τ=16)": sparkdl.ModelAveraging(sync_every=16, outer_optimizer=sparkdl.OuterSGD()),
    }
    spark = local_cluster("sparkdl-subnormal-floats", pythonpath=(ROOT, os.path.join(ROOT, "benchmarks"), PLAN_APP_DIR))
    try:
        with tempfile.TemporaryDirectory() as scratch:
            data = plan_data(scratch, rows=PLAN_EPOCH_ROWS)
            print(f"{'strategy':<22} {'flushDenormals':>14} {'samples/s':>10} {'final loss':>11} {'vs flushed':>10}")
            for label, strategy in strategies.items():
                flushed = None
                for flush in ("true", "false"):
                    spark.conf.set("spark.sparkdl.flushDenormals", flush)
                    fitted = sparkdl.TorchEstimator(
                        model=plan_mlp,
                        optimizer=adam,
                        strategy=strategy,
                        num_workers=2,
                        batch_size=32,
                        epochs=args.epochs,
                        progress=False,
                    ).fit(data)
                    rate = statistics.median(epoch["samples_per_sec"] for epoch in fitted.history[1:])
                    flushed = flushed or rate
                    print(
                        f"{label:<22} {flush:>14} {rate:>10.0f} {fitted.history[-1]['loss']:>11.3g} {rate / flushed:>10.2f}",
                        flush=True,
                    )
    finally:
        spark.conf.unset("spark.sparkdl.flushDenormals")
        spark.stop()


if __name__ == "__main__":
    main()
