"""No silent skips: under CI (CI=true) a test that skips fails instead, naming the reason. The suite's
dependencies are all installed by scripts/test.sh, so a skip there can only hide a broken set-up or import."""
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true" and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (tests/conftest.py forbids skips): {report.longrepr}"
