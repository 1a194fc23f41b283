"""The workload of Ray's published "Ray Train vs DDP" benchmark, FashionMNIST-shaped: 784 float32
features, 10 classes, an MLP 784-512-512-10 with ReLU. Nothing can be downloaded here, so the rows
are generated: one random center per class plus Gaussian noise, scaled so that the classes overlap
(a nearest-center classifier gets about 87 % of held-out rows right) and accuracy means something.

Importable without sparkdl or Spark: the Ray Train side builds the model from here
(``ray_train_side.py --model _parity_workload:make_model``).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

FEATURES = 784
HIDDEN = 512
CLASSES = 10
#: The centers' scale against the noise's: small enough that the classes overlap.
CENTER_SCALE = 0.1
NOISE = 1.0


def make_model() -> torch.nn.Module:
    """Ray's benchmark model: 784-512-512-10, ReLU between."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def make_data(rows: int, test_rows: int, seed: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``rows`` training rows and ``test_rows`` held-out rows around the same class centers:
    (train features, train labels, test features, test labels)."""
    from allreduce_vs_ddp import synthetic

    features, labels = synthetic(rows + test_rows, seed, features=FEATURES, center_scale=CENTER_SCALE, noise=NOISE)
    return features[:rows], labels[:rows], features[rows:], labels[rows:]
