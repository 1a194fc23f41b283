"""Training the DLRM on a generated click log with ``TorchEstimator``, and scoring its AUC."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, Optional

import numpy as np
import torch

import sparkdl
from examples.recsys.data import NUM_DENSE, ClickLog, auc, bayes_auc, read_test
from examples.recsys.model import make_optimizer, model_factory, model_inputs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A fit's AUC on the held-out rows next to the hidden model's, and its throughput."""

    auc: float
    bayes_auc: float
    test_rows: int
    samples_per_sec: float
    seconds: float

    def summary(self) -> str:
        return (
            f"AUC {self.auc:.4f} on {self.test_rows:,} held-out rows; the hidden model's (best reachable) "
            f"{self.bayes_auc:.4f}; {self.samples_per_sec:,.0f} samples/s, fit {self.seconds:.1f} s"
        )


def local_session(app_name: str = "sparkdl-recsys", memory_mb: int = 3072, driver_memory_mb: int = 6144):
    """``local-cluster[2,1,<memory_mb>]`` on loopback (``SPARKDL_MASTER`` names another master);
    its executors import this repository, so the model class ships by reference.

    Why 3 GB of JVM heap per executor and 6 GB for the driver: the fitted model's complete
    tables (20 M rows x 4 floats = 305 MB) reach the driver as rank 0's task result, which passes
    through the executor's and the driver's JVM heaps in several copies. With Spark's default
    1 GB the executor dies of ``OutOfMemoryError: Java heap space`` once training is done; with
    3 GB for the driver, so does the driver (and at width 8, 610 MB, 3 GB everywhere failed too).
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return (
        SparkSession.builder.master(os.environ.get("SPARKDL_MASTER", f"local-cluster[2,1,{memory_mb}]"))
        .appName(app_name)
        .config("spark.driver.memory", f"{driver_memory_mb}m")
        .config("spark.executor.memory", f"{memory_mb}m")
        .config("spark.driver.maxResultSize", f"{driver_memory_mb}m")
        .config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYTHONPATH", REPO_ROOT)
        .getOrCreate()
    )


def fit(
    log: ClickLog,
    num_workers: int = 2,
    batch_size: int = 256,
    epochs: int = 1,
    dim: int = 4,
    max_staleness: Optional[int] = 2,
    seed: int = 0,
) -> sparkdl.TorchModel:
    """Trains the DLRM with ``ShardedEmbedding`` tables on ``log.train`` under ``ParameterServer``."""
    return sparkdl.TorchEstimator(
        model=model_factory(log.vocabularies, "sharded", dim),
        optimizer=make_optimizer,  # the dense parameters; each table has its own row-wise Adagrad
        loss=torch.nn.functional.binary_cross_entropy_with_logits,
        inputs=model_inputs(len(log.vocabularies), NUM_DENSE),
        label_col="label",
        strategy=sparkdl.ParameterServer(max_staleness=max_staleness),
        num_workers=num_workers,
        batch_size=batch_size,
        epochs=epochs,
        seed=seed,
        progress=False,
    ).fit(log.train)


def score(module: torch.nn.Module, test: Dict[str, np.ndarray], chunk: int = 8192) -> np.ndarray:
    """The module's logits for the held-out rows, on this process's CPU."""
    names = [k for k in test if k.startswith("c")]
    out = []
    module.eval()
    with torch.no_grad():
        for start in range(0, len(test["label"]), chunk):
            part = slice(start, start + chunk)
            ids = {name: torch.from_numpy(test[name][part]) for name in names}
            out.append(module(torch.from_numpy(test["dense"][part]), **ids).numpy())
    return np.concatenate(out)


def evaluate(model: sparkdl.TorchModel, log: ClickLog, seconds: float) -> Outcome:
    test = read_test(log)
    history = model.history
    samples = sum(float(r["samples"]) for r in history)
    return Outcome(
        auc=auc(test["label"], score(model.module, test)),
        bayes_auc=bayes_auc(test),
        test_rows=len(test["label"]),
        samples_per_sec=samples / max(sum(float(r["seconds"]) for r in history), 1e-9),
        seconds=seconds,
    )


def fit_and_evaluate(log: ClickLog, **kwargs) -> Outcome:
    started = time.time()
    model = fit(log, **kwargs)
    return evaluate(model, log, time.time() - started)
