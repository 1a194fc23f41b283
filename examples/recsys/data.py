"""A synthetic click log generated with Spark, labelled by a hidden model whose AUC is known.

Every row has ``NUM_DENSE`` dense features ``d0..`` (standard normal) and ``len(VOCABULARIES)``
categorical ones ``c0..`` whose ids are Zipf-distributed over their vocabularies (20 M ids in
all at ``vocab_scale=1``). The popularity rank ``r`` of an id is drawn by inverting the CDF of a
power law with exponent ``zipf``, then scattered over the vocabulary by a bijection
``id = (r * multiplier + offset) mod vocabulary``, so the hot ids are not ``0..k`` (and a range
sharding could not luckily balance them).

The label is drawn from a logistic model that no one sees: ``logit = BIAS + sum over features of
effect(f, id) + DENSE_WEIGHTS . dense + INTERACTION * d0 * effect(0, c0)``, where ``effect(f, id)``
is uniform in ``[-EFFECT_SCALE, EFFECT_SCALE)``, a pure function of a hash of ``(f, id)`` (Spark's
``xxhash64``), so no table of 20 M effects is ever stored. Each row keeps its true click
probability ``p_true``: no model can rank the held-out rows better than ``p_true`` does, so the
AUC of ``p_true`` on them (:func:`bayes_auc`) is the best AUC any model can reach there.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Sequence, Tuple

#: Vocabulary sizes of the categorical features at ``vocab_scale=1``: 20,000,000 ids in all.
VOCABULARIES: Tuple[int, ...] = (
    6_000_000,
    5_000_000,
    3_000_000,
    2_000_000,
    1_500_000,
    1_000_000,
    800_000,
    400_000,
    200_000,
    100_000,
)
NUM_DENSE = 4
DENSE_WEIGHTS = (0.6, -0.4, 0.3, 0.2)
BIAS = -1.0
EFFECT_SCALE = 0.8
INTERACTION = 0.5
#: Large primes: a multiplier coprime with the vocabulary makes the scatter a bijection.
_PRIMES = (1_000_003, 2_000_003, 3_000_017, 4_000_037, 5_000_011, 6_000_011, 7_000_003, 8_000_009, 9_000_011)


@dataclasses.dataclass(frozen=True)
class ClickLog:
    """Where a generated log lies and what it is: ``train`` and ``test`` Parquet directories."""

    train: str
    test: str
    vocabularies: Tuple[int, ...]
    rows: int

    @property
    def categorical(self) -> List[str]:
        return [f"c{i}" for i in range(len(self.vocabularies))]

    @property
    def dense(self) -> List[str]:
        return [f"d{j}" for j in range(NUM_DENSE)]


def vocabularies(vocab_scale: float = 1.0) -> Tuple[int, ...]:
    """The vocabularies at ``vocab_scale`` (each at least 10 ids)."""
    if not vocab_scale > 0:
        raise ValueError(f"vocab_scale={vocab_scale!r} must be > 0")
    return tuple(max(10, int(round(v * vocab_scale))) for v in VOCABULARIES)


def _multiplier(vocabulary: int, feature: int) -> int:
    for prime in _PRIMES[feature % len(_PRIMES) :] + _PRIMES:
        if math.gcd(prime, vocabulary) == 1:
            return prime
    raise ValueError(f"no multiplier coprime with {vocabulary}")  # unreachable for the sizes above


def generate(
    spark,
    path: str,
    rows: int = 200_000,
    vocab_scale: float = 1.0,
    zipf: float = 1.1,
    test_fraction: float = 0.1,
    seed: int = 0,
    partitions: int = 4,
) -> ClickLog:
    """Generates ``rows`` clicks with Spark and writes ``path/train`` and ``path/test`` (Parquet).

    Columns: ``label`` (0.0/1.0), ``d0..d3`` (double), ``c0..c9`` (long ids), ``p_true`` (the
    hidden model's click probability; not a feature). A row is held out when a hash of its
    position says so (``test_fraction`` of them). Deterministic for a given ``seed`` and
    ``partitions``.
    """
    from pyspark.sql import functions as F

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r} must be between 0 and 1")
    if not zipf > 1.0:
        raise ValueError(f"zipf={zipf!r} must be > 1")
    vocab = vocabularies(vocab_scale)
    df = spark.range(0, rows, 1, partitions)
    logit = F.lit(BIAS)
    for j, weight in enumerate(DENSE_WEIGHTS):
        df = df.withColumn(f"d{j}", F.randn(seed * 1000 + j))
        logit = logit + F.lit(weight) * F.col(f"d{j}")
    exponent = 1.0 - zipf
    for f, size in enumerate(vocab):
        u = F.rand(seed * 1000 + 100 + f)
        # Inverse CDF of a power law on [1, size + 1): the popularity rank, 0 the most popular.
        rank = F.floor(F.pow(F.lit(1.0) + u * F.lit((size + 1.0) ** exponent - 1.0), F.lit(1.0 / exponent))) - 1
        rank = F.least(F.greatest(rank.cast("long"), F.lit(0)), F.lit(size - 1))
        offset = (seed * 7919 + f * 104_729) % size
        df = df.withColumn(f"c{f}", F.pmod(rank * F.lit(_multiplier(size, f)) + F.lit(offset), F.lit(size)))
        effect = _effect(F, f, F.col(f"c{f}"), seed)
        logit = logit + effect
        if f == 0:
            logit = logit + F.lit(INTERACTION) * F.col("d0") * effect
    df = df.withColumn("p_true", F.lit(1.0) / (F.lit(1.0) + F.exp(-logit)))
    df = df.withColumn("label", (F.rand(seed * 1000 + 999) < F.col("p_true")).cast("double"))
    held_out = F.pmod(F.xxhash64(F.col("id"), F.lit(seed)), F.lit(1_000_000)) < F.lit(int(test_fraction * 1_000_000))
    columns = ["label"] + [f"d{j}" for j in range(NUM_DENSE)] + [f"c{f}" for f in range(len(vocab))] + ["p_true"]
    train, test = os.path.join(path, "train"), os.path.join(path, "test")
    df.where(~held_out).select(*columns).write.mode("overwrite").parquet(train)
    df.where(held_out).select(*columns).coalesce(1).write.mode("overwrite").parquet(test)
    return ClickLog(train, test, vocab, rows)


def _effect(F, feature: int, ids, seed: int):
    """The hidden effect of each id of ``feature``: uniform in [-EFFECT_SCALE, EFFECT_SCALE)."""
    unit = F.pmod(F.xxhash64(F.lit(feature), ids, F.lit(seed)), F.lit(1 << 24)) / F.lit(float(1 << 24))
    return (unit * 2.0 - 1.0) * F.lit(EFFECT_SCALE)


def read_test(log: ClickLog, limit: int = 0) -> Dict[str, "object"]:
    """The held-out rows as numpy arrays (``dense`` [n, 4] float32, ``c0..`` int64, ``label``,
    ``p_true``), read with pyarrow; the first ``limit`` rows when ``limit`` > 0."""
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(log.test)
    if limit:
        table = table.slice(0, limit)
    out: Dict[str, object] = {
        "dense": np.stack([table[c].to_numpy() for c in log.dense], axis=1).astype(np.float32),
        "label": table["label"].to_numpy(),
        "p_true": table["p_true"].to_numpy(),
    }
    for c in log.categorical:
        out[c] = table[c].to_numpy().astype(np.int64)
    return out


def auc(labels: Sequence[float], scores: Sequence[float]) -> float:
    """The area under the ROC curve (scikit-learn's)."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def bayes_auc(test: Dict[str, object]) -> float:
    """The hidden model's AUC on the held-out rows: the best any model can reach on them."""
    return auc(test["label"], test["p_true"])  # type: ignore[arg-type]
