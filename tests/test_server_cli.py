"""S19/S20 `pyengine serve` as a user runs it (a subprocess on a free loopback port), with the web demo
mounted in the same process, and `pyengine bench serve --url` against it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pyengine.server import web as web_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import free_port, stop_process, wait_http  # noqa: E402


@pytest.fixture(scope="module")
def served():
    port = free_port()
    args = [sys.executable, "-m", "pyengine", "serve", "--port", str(port), "--api-key", "k3y",
            "--max-model-len", "512", "--max-waiting", "8", "--log-level", "warning", "--target-itl-ms", "80"]
    assert (web_server.WEB_ROOT / "index.html").is_file(), "web/index.html is part of the checkout"
    args.append("--with-demo")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, timeout=120)
        yield url
    finally:
        stop_process(proc, timeout=20)


def test_serve_requires_key_and_serves(served):
    url = served
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 401
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k3y"}, timeout=60)
    assert r.status_code == 200, r.text
    model = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k3y"}).json()["data"][0]["id"]
    assert model == "SmolLM2-135M-Instruct.Q4_1" and r.json()["model"] == model
    assert httpx.get(url + "/metrics").status_code == 401            # --api-key covers /metrics too
    metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k3y"}).text
    assert "pyengine_generation_tokens_total" in metrics
    assert "pyengine_target_itl_ms 80.0" in metrics                  # --target-itl-ms reached the engine


def test_demo_in_same_process(served):
    url = served
    assert httpx.get(url + "/").status_code == 401                   # the demo is behind the key as well
    page = httpx.get(url + "/", auth=("any", "k3y"))                 # as a browser resends it after asking
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert httpx.get(url + "/config.js", auth=("any", "k3y")).status_code == 200


def test_bench_serve_against_url(served):
    url = served
    out = subprocess.run([sys.executable, "-m", "pyengine", "bench", "serve", "--url", url, "--api-key", "k3y",
                          "--rate", "4", "--num-requests", "4", "--prompt-len", "24", "--output-len", "4",
                          "--shared-prefix", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = lines[0].split()
    assert "TTFT" in header and "req/s" in header
    row = lines[1].split()
    assert row[0] == url and row[2] == "4/0"        # 4 completed, 0 failed
    assert "4/4" in out.stderr                      # the progress bar reached the end
