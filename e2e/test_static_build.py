"""The static build (scripts/build_static.py) works from a plain static host (python -m http.server), and the
Pyodide location is configurable: by config.js at build time (--pyodide) and by the ?pyodide= query parameter.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from e2e_support import ROOT, free_port, stop_process, wait_http

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def static_site(tmp_path_factory, web_assets):
    """web/dist-like build whose config.js points Pyodide at ./alt-pyodide/ (a stand-in for a CDN), plus a
    copy of the vendored runtime at ./vendor/pyodide/ for the default route; served by http.server."""
    out = tmp_path_factory.mktemp("static") / "dist"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_static.py"), "--out", str(out),
                    "--pyodide", "./alt-pyodide/"], check=True, capture_output=True, text=True)
    assert not (out / "vendor" / "pyodide").exists()          # --pyodide: the runtime is not shipped
    shutil.copytree(ROOT / "web" / "vendor" / "pyodide", out / "alt-pyodide")
    shutil.copytree(ROOT / "web" / "vendor" / "pyodide", out / "other-pyodide")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/index.html", proc)
        yield base, out
    finally:
        stop_process(proc)


def _boot(browser, url: str) -> tuple[dict, list[str]]:
    context = browser.new_context()
    page = context.new_page()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(url)
        page.evaluate("() => window.pyengineDemo.ready")
        page.wait_for_function("() => window.pyengineDemo.state().python.status !== 'starting'", timeout=180_000)
        return page.evaluate("() => window.pyengineDemo.state()"), requests
    finally:
        context.close()


@pytest.mark.parametrize("query,folder", [("", "alt-pyodide"), ("?pyodide=./other-pyodide/", "other-pyodide")])
def test_static_build_boots_pyodide_from_configured_location(browser, static_site, query, folder):
    base, out = static_site
    state, requests = _boot(browser, f"{base}/index.html{query}")
    assert state["python"]["status"] == "idle", state
    assert state["ts"]["status"] != "unavailable", state          # ts-mini's worker is in the build too
    wasm = [u for u in requests if u.endswith("pyodide.asm.wasm")]
    assert wasm and all(f"/{folder}/" in u for u in wasm), wasm
    assert any(u.endswith(".whl") and "/vendor/wheels/pyengine-" in u for u in requests), requests
    assert any("numpy-2.2.5" in u and f"/{folder}/" in u for u in requests)
