"""Shared fixtures: one real local-cluster Spark session for the whole run, loopback only."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

# Executors must run this interpreter (it has torch, petastorm and sparkdl), and all traffic
# stays on loopback; set before pyspark starts the JVM.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Under CI=true a skipped test fails (tests/ci_skips.py says why).
pytest_plugins = ["tests.ci_skips"]


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """A ``local-cluster[2,1,1024]`` session: two executors with one core each, like a tiny real
    cluster (separate executor JVMs and Python workers), shared by every Spark test."""
    from tests.cluster import local_cluster_builder

    cache_dir = tmp_path_factory.mktemp("sparkdl-cache")
    session = (
        local_cluster_builder("sparkdl-tests")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.executorEnv.PYTHONPATH", REPO_ROOT + os.pathsep + os.path.join(REPO_ROOT, "tests"))
        .config("spark.sparkdl.cacheDir", str(cache_dir))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled digits (1797 rows, 64 features in [0, 1], 10 classes)."""
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    return (features / 16.0).astype(np.float32), labels.astype(np.int64)


@pytest.fixture(scope="session")
def digits_split(digits):
    """A fixed 80/20 train/test split of digits."""
    features, labels = digits
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    return (features[order[:cut]], labels[order[:cut]]), (features[order[cut:]], labels[order[cut:]])


@pytest.fixture(scope="session")
def digits_df(spark, digits_split):
    """Training split as a DataFrame with an array<double> features column."""
    (features, labels), _ = digits_split
    return frame(spark, features, labels)


@pytest.fixture(scope="session")
def digits_test_df(spark, digits_split):
    _, (features, labels) = digits_split
    return frame(spark, features, labels)


def frame(spark, features, labels):
    rows = [(f.astype(float).tolist(), int(y)) for f, y in zip(features, labels)]
    return spark.createDataFrame(rows, "features array<double>, label long")


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """Fails a test that leaves a torch.distributed process group behind in the driver."""
    yield
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a test leaked a process group"
