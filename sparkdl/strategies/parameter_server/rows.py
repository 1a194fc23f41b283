"""Row-wise pieces of a sharded embedding table, as pure functions: which rank owns a row, a
row's initial values, and the row-wise optimizers whose state lives with each row.

Every function depends only on its arguments (seed, table, row id), never on the number of
ranks or on which rank computes it, so a table's values and its split are the same however
many ranks train it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Dict, Tuple

import numpy as np
import torch

from sparkdl.errors import ConfigError

__all__ = ["ROW_OPTIMIZERS", "RowOptimizer", "initial_rows", "mix64", "owners"]

#: The row-wise optimizers a server applies, by name.
ROW_OPTIMIZERS = ("sgd", "adagrad", "adam")
_DEFAULT_EPS = {"sgd": 0.0, "adagrad": 1e-10, "adam": 1e-8}


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (a bijection of uint64 with full avalanche): consecutive ids and
    the few hot ids of a Zipf distribution land on unrelated values."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


#: SplitMix64's finalizer, for other hashes of row ids (the row store's buckets).
mix64 = _mix


def owners(ids: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank that holds each row: a hash of the id modulo the ranks (balanced for skewed ids,
    unlike ranges, where the hot low ids of a Zipf distribution would all land on rank 0)."""
    hashed = _mix(ids.numpy().astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return torch.from_numpy((hashed % np.uint64(world_size)).astype(np.int64))


def initial_rows(seed: int, table: int, ids: torch.Tensor, dim: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of table ``table`` as initialized: N(0, std²) drawn from a counter-based
    hash of (seed, table, row id, column), so a row is the same wherever and whenever it is
    first touched, and no rank ever builds a whole table to initialize it."""
    out = torch.zeros(len(ids), dim, dtype=dtype)
    if std == 0 or len(ids) == 0:
        return out
    key = _mix(np.array([seed & (2**64 - 1)], dtype=np.uint64) ^ _mix(np.array([table + 1], dtype=np.uint64)))
    counter = ids.numpy().astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
    bits = [_mix(key ^ _mix(counter * np.uint64(2) + np.uint64(k))) for k in (0, 1)]
    # 53 random bits each, in (0, 1]: Box-Muller needs log(u1) finite.
    u1, u2 = (((b >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53 for b in bits)
    normal = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
    return out.copy_(torch.from_numpy(normal * std))


@dataclasses.dataclass(frozen=True)
class RowOptimizer:
    """A row-wise optimizer: each row's update uses only that row's gradient and state.

    ``sgd``: ``w -= lr * g``. ``adagrad``: ``a += g²; w -= lr * g / (sqrt(a) + eps)`` (torch's
    Adagrad with ``lr_decay=0``, ``weight_decay=0``). ``adam``: lazy Adam, each row with its
    own step count ``t`` (the pushes that touched it): ``m = b1 m + (1-b1) g``,
    ``v = b2 v + (1-b2) g²``, ``w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``; rows a
    batch does not touch keep their moments (no decay), as in TensorFlow's LazyAdam.
    """

    name: str = "adagrad"
    lr: float = 0.01
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = -1.0  # < 0: the optimizer's default (_DEFAULT_EPS)
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ROW_OPTIMIZERS:
            raise ConfigError(
                f"ShardedEmbedding optimizer={self.name!r} must be one of {', '.join(map(repr, ROW_OPTIMIZERS))}"
            )
        for field, value in (("lr", self.lr), ("initial_accumulator", self.initial_accumulator)):
            if (
                not isinstance(value, numbers.Real)
                or isinstance(value, bool)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ConfigError(f"ShardedEmbedding {field}={value!r} must be a finite number >= 0")
        betas = self.betas
        if (
            not isinstance(betas, (tuple, list))
            or len(betas) != 2
            or not all(isinstance(b, numbers.Real) and 0 <= b < 1 for b in betas)
        ):
            raise ConfigError(f"ShardedEmbedding betas={betas!r} must be two numbers in [0, 1)")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if self.eps < 0:
            object.__setattr__(self, "eps", _DEFAULT_EPS[self.name])
        if not math.isfinite(self.eps):
            raise ConfigError(f"ShardedEmbedding eps={self.eps!r} must be a finite number >= 0")

    def new_state(self, count: int, dim: int, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """The state of ``count`` fresh rows."""
        if self.name == "adagrad":
            return {"sum": torch.full((count, dim), self.initial_accumulator, dtype=dtype)}
        if self.name == "adam":
            zeros = torch.zeros(count, dim, dtype=dtype)
            return {"exp_avg": zeros, "exp_avg_sq": zeros.clone(), "step": torch.zeros(count, dtype=torch.int64)}
        return {}

    def apply(self, rows: torch.Tensor, state: Dict[str, torch.Tensor], grad: torch.Tensor) -> None:
        """Updates ``rows`` (and their ``state``, the same rows' slices) in place from ``grad``."""
        if self.name == "sgd":
            rows.add_(grad, alpha=-self.lr)
        elif self.name == "adagrad":
            state["sum"].addcmul_(grad, grad, value=1.0)
            rows.addcdiv_(grad, state["sum"].sqrt().add_(self.eps), value=-self.lr)
        else:
            beta1, beta2 = self.betas
            state["step"] += 1
            steps = state["step"].to(torch.float64)[:, None]
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            correction1 = (1 - beta1**steps).to(rows.dtype)
            correction2 = (1 - beta2**steps).to(rows.dtype)
            denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(self.eps)
            rows.addcdiv_(state["exp_avg"] / correction1, denom, value=-self.lr)
