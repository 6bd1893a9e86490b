"""Fixtures for the browser tests: the dev server (`python -m pyengine web`) on a free loopback port, and
Debian's Chromium driven by Python Playwright (never `playwright install`: the machine is offline).

One page (and so one Pyodide boot and one model load per engine) is shared by a whole test module.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from e2e_support import CHROMIUM, CHROMIUM_ARGS, ROOT, free_port, stop_process, wait_http

GOLDEN = ROOT / "tests" / "golden" / "generation_smollm2.json"


@pytest.fixture(scope="session")
def model_path() -> str:
    from pyengine.model_files import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def web_assets():
    """The browser side must be assembled (scripts/setup_web.sh); the pyengine wheel must be current."""
    if not (ROOT / "web" / "vendor" / "manifest.json").is_file():
        pytest.fail("web/vendor is not assembled: run `bash scripts/setup_web.sh`")
    sys.path.insert(0, str(ROOT / "tests" / "pyodide"))
    try:
        import harness  # tests/pyodide/harness.py: rebuilds the wheel if pyengine/ changed
        harness.ensure_fresh_wheel()
    finally:
        sys.path.remove(str(ROOT / "tests" / "pyodide"))


@pytest.fixture(scope="session")
def server(web_assets, model_path):
    """Base URL of `python -m pyengine web --model <default>` on a free port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "web", "--host", "127.0.0.1", "--port", str(port),
                             "--model", model_path], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/config.js", proc)
        yield base
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} not found (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


class PageLog:
    """Console messages and uncaught page errors, shown when a test fails."""
    def __init__(self, page):
        self.lines: list[str] = []
        page.on("console", lambda m: self.lines.append(f"console.{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.lines.append(f"pageerror: {e}"))

    def errors(self) -> list[str]:
        return [ln for ln in self.lines if ln.startswith("pageerror")]

    def __str__(self):
        return "\n".join(self.lines[-60:])


@pytest.fixture(scope="module")
def demo(browser, server):
    """A fresh demo page; yields (page, log). Test modules load models themselves."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(300_000)
    log = PageLog(page)
    page.goto(server + "/")
    page.evaluate("() => window.pyengineDemo.ready")
    yield page, log
    context.close()


@pytest.fixture(scope="session")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())
