"""Security settings and the data sparkdl writes: pure, no Spark."""

import os
import stat
import subprocess
import sys

import pytest

from sparkdl._net.policy import ALLOW_PLAINTEXT_COLLECTIVES, security_policy
from sparkdl.data import cache
from sparkdl.errors import ConfigError


def _conf(**settings):
    values = {key.replace("_", "."): value for key, value in settings.items()}
    return values.get


def test_no_spark_encryption_means_integrity_only():
    assert security_policy(_conf()).encrypt is False
    assert security_policy(_conf(spark_network_crypto_enabled="false")).encrypt is False


@pytest.mark.parametrize("setting", ["spark.network.crypto.enabled", "spark.ssl.enabled"])
def test_spark_encryption_refuses_plaintext_collectives_naming_the_setting(setting):
    with pytest.raises(ConfigError) as info:
        security_policy({setting: "true"}.get)
    assert f"{setting}=true" in str(info.value) and f"{ALLOW_PLAINTEXT_COLLECTIVES}=true" in str(info.value)
    policy = security_policy({setting: "True", ALLOW_PLAINTEXT_COLLECTIVES: "true"}.get)
    assert policy.encrypt is True and policy.because == setting


def test_default_cache_dir_is_private_and_stale_caches_of_dead_drivers_go(tmp_path, monkeypatch):
    monkeypatch.setattr(cache.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = tmp_path / f"sparkdl-cache-{dead.stdout.strip()}-k3j2x9"
    (stale / "df-1").mkdir(parents=True)
    stale_old_name = tmp_path / f"sparkdl-cache-{dead.stdout.strip()}"  # as earlier versions named it
    stale_old_name.mkdir()
    (stale / "df-1" / "part-0.parquet").write_bytes(b"data")
    alive = tmp_path / f"sparkdl-cache-{os.getppid()}"  # a running process: not ours to delete
    alive.mkdir()
    unrelated = tmp_path / "sparkdl-cache-notapid"
    unrelated.mkdir()

    monkeypatch.setattr(cache, "_stale_checked", False)
    monkeypatch.setattr(cache, "_private_dirs", {})
    path = cache.local_cache_dir()
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith(f"sparkdl-cache-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and cache.local_cache_dir() == path
    assert not stale.exists() and not stale_old_name.exists() and alive.exists() and unrelated.exists()

    again = tmp_path / f"sparkdl-cache-{dead.stdout.strip()}"
    again.mkdir()
    cache.clear_cache()  # the user's own sweep also removes what dead drivers left
    assert not again.exists() and alive.exists()


def test_materialized_copies_become_owner_only(tmp_path):
    (tmp_path / "df-1" / "sub").mkdir(parents=True)
    (tmp_path / "df-1" / "part-0.parquet").write_bytes(b"x")
    (tmp_path / "df-1" / "sub" / "part-1.parquet").write_bytes(b"y")
    os.chmod(tmp_path / "df-1" / "part-0.parquet", 0o644)
    cache.make_private(f"file://{tmp_path / 'df-1'}")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "df-1").rglob("*")}
    assert modes == {"part-0.parquet": 0o600, "sub": 0o700, "part-1.parquet": 0o600}
    assert stat.S_IMODE((tmp_path / "df-1").stat().st_mode) == 0o700


# ---- Refused before the data is touched (issue #29, 10b) -----------------------------------------
# Under Spark encryption without allowUnencryptedCollectives the launch refuses; the DataFrame must
# not have been written to the cache by then.


class _Conf:
    def __init__(self, values):
        self.values = values

    def get(self, key, default=None):
        return self.values.get(key, default)


class _Spark:
    def __init__(self, **values):
        self.conf = _Conf(values)


def _frame(spark):
    from pyspark.sql import DataFrame
    from pyspark.sql import types as T

    class Frame(DataFrame):  # a DataFrame as far as prepare_data asks: columns, schema, session
        def __new__(cls):  # no JVM DataFrame behind it
            return object.__new__(cls)

        def __init__(self):
            pass

        columns = ["features", "label"]
        sparkSession = spark
        schema = T.StructType(
            [T.StructField("features", T.ArrayType(T.DoubleType())), T.StructField("label", T.LongType())]
        )

    return Frame()


def _data_settings():
    import torch

    import sparkdl

    return sparkdl.TorchEstimator(model=lambda: torch.nn.Linear(2, 2), progress=False)._data_settings()


@pytest.mark.parametrize("setting", ["spark.network.crypto.enabled", "spark.ssl.enabled"])
def test_spark_encryption_refuses_before_the_dataframe_is_materialized(setting, monkeypatch):
    from sparkdl._driver import prepare_data as prepare

    written = []

    def materialize(df, columns, *args, **kwargs):
        written.append(columns)
        raise RuntimeError("materialized")

    monkeypatch.setattr(prepare, "materialize", materialize)
    refused = _Spark(**{setting: "true"})
    with pytest.raises(ConfigError, match=f"{setting}=true.*{ALLOW_PLAINTEXT_COLLECTIVES}=true"):
        prepare.prepare_data(_frame(refused), _data_settings(), 2)
    assert written == []
    # Accepted: the same DataFrame goes on to be materialized (what the refusal must come before).
    accepted = _Spark(**{setting: "true", ALLOW_PLAINTEXT_COLLECTIVES: "true"})
    with pytest.raises(RuntimeError, match="materialized"):
        prepare.prepare_data(_frame(accepted), _data_settings(), 2)
    assert written == [["features", "label"]]


def test_the_estimator_refuses_before_warming_up_or_preparing(monkeypatch):
    import sparkdl.estimator as estimator

    touched = []
    monkeypatch.setattr(estimator, "warm_up", lambda *a, **k: touched.append("warm_up"))
    monkeypatch.setattr(estimator, "prepare_data", lambda *a, **k: touched.append("prepare_data"))
    est = estimator.TorchEstimator(model=lambda: __import__("torch").nn.Linear(2, 2), progress=False)
    with pytest.raises(ConfigError, match=ALLOW_PLAINTEXT_COLLECTIVES):
        est.fit(_frame(_Spark(**{"spark.network.crypto.enabled": "true"})))
    assert touched == []
