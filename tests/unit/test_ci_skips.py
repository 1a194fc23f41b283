"""Under CI=true a skip fails the run with its reason; elsewhere it stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

SKIPPING = """
import pytest

def test_needs_something_missing():
    pytest.skip("needs a thing this machine lacks")

@pytest.mark.xfail(reason="a known failure", strict=True)
def test_known_failure():
    assert False
"""


@pytest.mark.parametrize("ci, code, outcome", [("true", 1, "1 failed, 1 xfailed"), ("", 0, "1 skipped, 1 xfailed")])
def test_a_skip_fails_only_under_ci(tmp_path, ci, code, outcome):
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        cwd=REPO_ROOT,
        env={**os.environ, "CI": ci},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stdout
    assert outcome in done.stdout, done.stdout
    if ci:
        assert "CI=true runs every test, but this one skipped: Skipped: needs a thing this machine lacks" in done.stdout
