"""The quick-start model and dataset: scikit-learn's bundled handwritten digits (no download)."""

import os
import sys

import torch


def make_model() -> torch.nn.Module:
    """A small MLP for 8x8 digits (64 features, 10 classes)."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def write_dataset(path: str) -> str:
    """Writes digits as Parquet (features: array<float>, label: long) in 4 row groups."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    table = pa.table(
        {
            "features": pa.array(list(features), type=pa.list_(pa.float32())),
            "label": pa.array(labels.astype(np.int64)),
        }
    )
    os.makedirs(path, exist_ok=True)
    pq.write_table(table, os.path.join(path, "part-00000.parquet"), row_group_size=450)
    return path


if __name__ == "__main__":
    print(write_dataset(sys.argv[1]))
