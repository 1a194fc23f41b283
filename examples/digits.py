"""The quick-start model and dataset: scikit-learn's bundled handwritten digits (no download).

python examples/digits.py DIR                  # DIR: all 1,797 rows
python examples/digits.py DIR --holdout 0.2    # DIR/train and DIR/test: a fixed seeded split
"""

import argparse
import os
from typing import Optional, Sequence, Tuple

import torch


def make_model() -> torch.nn.Module:
    """A small MLP for 8x8 digits (64 features, 10 classes)."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def write_dataset(path: str, rows: Optional[Sequence[int]] = None) -> str:
    """Writes digits (or the ``rows`` given, by position) as Parquet (features: array<float>,
    label: long) in row groups of 450."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    if rows is not None:
        features, labels = features[np.asarray(rows)], labels[np.asarray(rows)]
    table = pa.table(
        {
            "features": pa.array(list(features), type=pa.list_(pa.float32())),
            "label": pa.array(labels.astype(np.int64)),
        }
    )
    os.makedirs(path, exist_ok=True)
    pq.write_table(table, os.path.join(path, "part-00000.parquet"), row_group_size=450)
    return path


def write_split(path: str, holdout: float = 0.2, seed: int = 0) -> Tuple[str, str]:
    """Writes ``path/train`` and ``path/test``: a seeded permutation of the rows, the last
    ``holdout`` share held out (360 of 1,797 rows at 0.2). Train on the first, score the second."""
    import numpy as np

    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout={holdout!r} must be a fraction between 0 and 1")
    order = np.random.default_rng(seed).permutation(1797)
    cut = int((1.0 - holdout) * len(order))
    return write_dataset(os.path.join(path, "train"), order[:cut]), write_dataset(
        os.path.join(path, "test"), order[cut:]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Writes scikit-learn's digits as Parquet.")
    parser.add_argument("dir")
    parser.add_argument(
        "--holdout", type=float, default=None, help="write DIR/train and DIR/test, holding out this share of the rows"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    args = parser.parse_args()
    print(*(write_split(args.dir, args.holdout, args.seed) if args.holdout else [write_dataset(args.dir)]), sep="\n")


def local_session(app_name: str):
    """The examples' embedded cluster: ``local-cluster[2,1,1024]`` on loopback (``SPARKDL_MASTER``
    names another master)."""
    import os

    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master(os.environ.get("SPARKDL_MASTER", "local-cluster[2,1,1024]"))
        .appName(app_name)
        .config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
