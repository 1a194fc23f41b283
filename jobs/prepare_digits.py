"""Writes scikit-learn's bundled digits (no download) as two Parquet datasets, a training split
and a held-out split, for the example pipeline's prepare step:

    python jobs/prepare_digits.py DIR [--holdout 0.2] [--seed 0]

DIR/train and DIR/test (features: array<float>, label: long, the schema of examples/digits.py)
are a fixed seeded split: train on DIR/train, score only DIR/test, rows the model never saw.
With the defaults the split is 1,437 training rows and 360 held-out rows.
"""

from __future__ import annotations

import argparse
import os
from typing import Tuple


def write_split(path: str, holdout: float = 0.2, seed: int = 0) -> Tuple[str, str]:
    """Writes DIR/train and DIR/test and returns their paths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout={holdout!r} must be a fraction between 0 and 1")
    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int((1.0 - holdout) * len(labels))
    paths = []
    for name, rows in (("train", order[:cut]), ("test", order[cut:])):
        table = pa.table(
            {
                "features": pa.array(list(features[rows]), type=pa.list_(pa.float32())),
                "label": pa.array(labels[rows].astype(np.int64)),
            }
        )
        target = os.path.join(path, name)
        os.makedirs(target, exist_ok=True)
        pq.write_table(table, os.path.join(target, "part-00000.parquet"), row_group_size=450)
        paths.append(target)
    return paths[0], paths[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="writes DIR/train and DIR/test")
    parser.add_argument("--holdout", type=float, default=0.2, help="fraction of the rows held out in DIR/test (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    args = parser.parse_args()
    for written in write_split(args.dir, args.holdout, args.seed):
        print(written)
