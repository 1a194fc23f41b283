"""The DataFrame copy's directory on a local disk cannot be pre-created, owned or read by another
local user (a second uid, ``nobody``, plays that user), and SIGTERM to a driver deletes the copy."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from sparkdl.data import cache
from sparkdl.errors import ConfigError

OTHER_UID = 65534  # nobody


def _as_other_user(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", *command],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture
def shared_temp(monkeypatch):
    """A temp dir like /tmp (mode 1777: every user may create names in it), as this driver's
    temp dir; pytest's own tmp_path lies under a 0700 directory the other user cannot reach."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("a second local user needs root and setpriv (util-linux)")
    path = tempfile.mkdtemp(prefix="sparkdl-shared-tmp-", dir="/tmp")
    os.chmod(path, 0o1777)
    monkeypatch.setattr(cache.tempfile, "tempdir", path)
    monkeypatch.setattr(cache, "_private_dirs", {})
    monkeypatch.setattr(cache, "_stale_checked", True)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def test_a_directory_another_user_made_at_the_predictable_name_is_never_used(shared_temp):
    # The name earlier versions used: the attacker makes it first, open to everyone.
    planted = os.path.join(shared_temp, f"sparkdl-cache-{os.getpid()}")
    made = _as_other_user("mkdir", "-m", "0777", planted)
    assert made.returncode == 0, made.stderr
    path = cache.local_cache_dir()
    assert path != planted and os.path.dirname(path) == shared_temp
    info = os.lstat(path)
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    # Spark writes the files with the umask's modes (0644): inside, no other user reaches them.
    with open(os.path.join(path, "part-0.parquet"), "w") as handle:
        handle.write("training data")
    os.chmod(os.path.join(path, "part-0.parquet"), 0o644)
    listing = _as_other_user("ls", path)
    reading = _as_other_user("cat", os.path.join(path, "part-0.parquet"))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr, listing
    assert reading.returncode != 0 and "training data" not in reading.stdout, reading
    assert os.listdir(planted) == []  # nothing was written to the planted directory


def test_a_directory_that_is_not_private_is_refused_naming_the_setting(shared_temp):
    path = cache.local_cache_dir()
    os.chown(path, OTHER_UID, OTHER_UID)  # replaced by, or given to, another user
    with pytest.raises(ConfigError, match=r"owned by uid 65534.*spark\.sparkdl\.cacheDir"):
        cache.check_private(path)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        cache.local_cache_dir()
    os.chown(path, os.geteuid(), os.getegid())
    os.chmod(path, 0o755)
    with pytest.raises(ConfigError, match="mode 755: other users have access"):
        cache.check_private(path)
    os.rmdir(path)
    os.symlink(shared_temp, path)  # a link where the directory was
    with pytest.raises(ConfigError, match="is not a directory"):
        cache.check_private(path)


def test_a_configured_local_cache_dir_gets_a_private_directory_of_this_driver(shared_temp):
    parent = os.path.join(shared_temp, "team-cache")
    os.makedirs(parent)
    os.chmod(parent, 0o1777)  # a team's shared directory
    root = cache._private_root(f"file://{parent}")
    path = root[len("file://") :]
    assert os.path.dirname(path) == parent and os.path.basename(path).startswith(f"sparkdl-cache-{os.getpid()}-")
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700 and cache._private_root(root) == root
    assert cache._private_root("hdfs://namenode/cache") == "hdfs://namenode/cache"  # the store's to protect


def test_a_directory_that_cannot_be_created_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_private_dirs", {})
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"cannot create a directory for the DataFrame's copy in .*a-file"):
        cache.private_directory(str(blocker / "cache"))


_HOLDS_A_COPY = """
import os, sys, time
sys.path[:0] = [{root!r}]
from sparkdl.data import cache
path = cache.local_cache_dir()
open(os.path.join(path, "part-0.parquet"), "w").write("rows")
cache._clean_up_on_sigterm()  # what the first materialization does
print(path, flush=True)
sys.stdin.read()  # blocked in a system call, as a driver waiting on Spark is
"""


def test_sigterm_deletes_the_copy_and_ends_with_the_signals_status(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    driver = subprocess.Popen(
        [sys.executable, "-c", _HOLDS_A_COPY.format(root=root)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        path = driver.stdout.readline().strip()
        assert os.path.exists(os.path.join(path, "part-0.parquet"))
        driver.terminate()
        assert driver.wait(timeout=30) == -15
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
