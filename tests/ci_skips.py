"""A pytest plugin (loaded by tests/conftest.py): under CI (``CI=true``) a skipped test fails.

Some tests skip where the machine cannot run them (no root for network namespaces, no second
local user, no Java on PATH). CI runs as root with Java, so there a skip would hide a missing
feature rather than a missing capability: it fails, with the test's own reason.
"""

from __future__ import annotations

import os

import pytest


def skips_fail() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and skips_fail():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"CI=true runs every test, but this one skipped: {reason}"
