"""Security settings and the data sparkdl writes: pure, no Spark."""

import os
import stat
import subprocess
import sys

import pytest

from sparkdl._security import ALLOW_PLAINTEXT_COLLECTIVES, security_policy
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
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = tmp_path / f"sparkdl-cache-{dead.stdout.strip()}"
    (stale / "df-1").mkdir(parents=True)
    (stale / "df-1" / "part-0.parquet").write_bytes(b"data")
    alive = tmp_path / f"sparkdl-cache-{os.getppid()}"  # a running process: not ours to delete
    alive.mkdir()
    unrelated = tmp_path / "sparkdl-cache-notapid"
    unrelated.mkdir()

    monkeypatch.setattr(cache, "_stale_checked", False)
    path = cache.local_cache_dir()
    assert path == str(tmp_path / f"sparkdl-cache-{os.getpid()}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert not stale.exists() and alive.exists() and unrelated.exists()

    again = tmp_path / f"sparkdl-cache-{dead.stdout.strip()}"
    again.mkdir()
    cache.clear_cache()  # the user's own sweep also removes what dead drivers left
    assert not again.exists() and alive.exists()


def test_materialized_copies_become_owner_only(tmp_path):
    (tmp_path / "df-1" / "sub").mkdir(parents=True)
    (tmp_path / "df-1" / "part-0.parquet").write_bytes(b"x")
    (tmp_path / "df-1" / "sub" / "part-1.parquet").write_bytes(b"y")
    os.chmod(tmp_path / "df-1" / "part-0.parquet", 0o644)
    cache._make_private(f"file://{tmp_path / 'df-1'}")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "df-1").rglob("*")}
    assert modes == {"part-0.parquet": 0o600, "sub": 0o700, "part-1.parquet": 0o600}
    assert stat.S_IMODE((tmp_path / "df-1").stat().st_mode) == 0o700
