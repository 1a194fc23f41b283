"""A DLRM-style click model (Naumov et al., 2019): one embedding table per categorical feature,
a bottom MLP on the dense features, pairwise dot products between all of their vectors (the
feature interactions), and a top MLP on those products and the bottom MLP's output.

``tables`` chooses what holds the rows, so that the same model runs under every strategy:

* ``"sharded"``: ``sparkdl.ShardedEmbedding`` — the rows live on the parameter servers, sharded by
  row over the ranks, with a row-wise Adagrad; trains under ``ParameterServer`` only.
* ``"sparse"``: ``nn.Embedding(sparse=True)`` — every rank holds the whole table; its gradients
  are row-sparse (DDP allreduces them as sparse tensors under ``AllReduce``).
* ``"dense"``: ``nn.Embedding`` — the whole table, dense gradients (today's dense
  ``ParameterServer`` pushes and pulls all of it every step).

All three start from N(0, 1/dim) rows and train every parameter with Adagrad at the same
learning rate (:func:`make_optimizer`), so they differ in where rows live and what moves.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, Sequence

import torch

import sparkdl

TABLES = ("sharded", "sparse", "dense")
LEARNING_RATE = 0.05


class DLRM(torch.nn.Module):
    """``forward(dense, c0=..., c1=..., ...)``: dense float32 ``[B, num_dense]``, each ``c<i>`` int64
    ids ``[B]``; returns the click logit ``[B]``."""

    def __init__(
        self,
        vocabularies: Sequence[int],
        num_dense: int = 4,
        dim: int = 4,
        hidden: int = 32,
        tables: str = "sharded",
        lr: float = LEARNING_RATE,
    ) -> None:
        super().__init__()
        if tables not in TABLES:
            raise ValueError(f"tables={tables!r} must be one of {TABLES}")
        self.names = [f"c{i}" for i in range(len(vocabularies))]
        self.embeddings = torch.nn.ModuleDict(
            {name: _table(rows, dim, tables, lr) for name, rows in zip(self.names, vocabularies)}
        )
        self.bottom = torch.nn.Sequential(
            torch.nn.Linear(num_dense, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim), torch.nn.ReLU()
        )
        vectors = len(vocabularies) + 1
        self.register_buffer("pairs", torch.tril_indices(vectors, vectors, offset=-1), persistent=False)
        self.top = torch.nn.Sequential(
            torch.nn.Linear(vectors * (vectors - 1) // 2 + dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, dense: torch.Tensor, **categorical: torch.Tensor) -> torch.Tensor:
        bottom = self.bottom(dense)
        vectors = torch.stack([bottom] + [self.embeddings[name](categorical[name]) for name in self.names], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([bottom, products], dim=1)).squeeze(-1)


def _table(rows: int, dim: int, tables: str, lr: float) -> torch.nn.Module:
    if tables == "sharded":
        return sparkdl.ShardedEmbedding(rows, dim, optimizer="adagrad", lr=lr, init_std=1.0 / math.sqrt(dim))
    table = torch.nn.Embedding(rows, dim, sparse=tables == "sparse")
    torch.nn.init.normal_(table.weight, std=1.0 / math.sqrt(dim))
    return table


def model_factory(vocabularies: Sequence[int], tables: str = "sharded", dim: int = 4) -> Callable[[], DLRM]:
    """A zero-argument builder, what ``TorchEstimator(model=...)`` takes."""
    return functools.partial(DLRM, tuple(vocabularies), dim=dim, tables=tables)


def make_optimizer(params, lr: float = LEARNING_RATE) -> torch.optim.Optimizer:
    """Adagrad for the model's parameters (dense and, for ``nn.Embedding`` tables, sparse)."""
    return torch.optim.Adagrad(params, lr=lr)


def model_inputs(num_categorical: int, num_dense: int = 4) -> Dict[str, object]:
    """``TorchEstimator(inputs=...)`` for the click log's columns."""
    inputs: Dict[str, object] = {"dense": [f"d{j}" for j in range(num_dense)]}
    inputs.update({f"c{i}": f"c{i}" for i in range(num_categorical)})
    return inputs


def table_bytes(vocabularies: Sequence[int], dim: int = 4) -> int:
    """Bytes of all embedding rows (float32), as one rank holds them with ``nn.Embedding``."""
    return sum(vocabularies) * dim * 4
