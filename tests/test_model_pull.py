"""`pyengine pull / models / rm` and `--model NAME`, against a local HTTP server laid out like the Hugging Face
hub (`/{repo}/resolve/{rev}/{file}` with X-Repo-Commit and a sha256 ETag, `/api/models/{repo}/tree/{rev}`) and a
plain file server: never the internet. The CLI runs as a subprocess with HF_ENDPOINT, HF_HUB_CACHE, PYENGINE_HOME
pointing at the test's own folders."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tiny_models import write_tiny

pytest.importorskip("huggingface_hub")

REPO = "tinyorg/tiny-llama-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """Serves files (name -> bytes) as a hub repo and as plain URLs; can cut a transfer once, lie about a sha."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.cut_once: set[str] = set()      # paths whose next full GET stops half-way
        self.bad_sha: set[str] = set()
        self.ranges: list[str] = []          # Range headers seen
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _file(self):
                path = self.path.split("?", 1)[0]
                m = re.fullmatch(rf"/{re.escape(REPO)}/resolve/[^/]+/(.+)", path)
                if m:
                    return m.group(1), hub.files.get(m.group(1))
                m = re.fullmatch(r"/plain/(.+)", path)
                if m:
                    return m.group(1), hub.files.get(m.group(1))
                return None, None

            def _headers(self, name, data, status, start=0):
                self.send_response(status)
                sha = hashlib.sha256(data).hexdigest()
                if name in hub.bad_sha:
                    sha = "0" * 64
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()

            def _not_found(self):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):
                name, data = self._file()
                if data is None:
                    return self._not_found()
                self._headers(name, data, 200)

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path.startswith(f"/api/models/{REPO}/tree/"):
                    body = json.dumps([{"type": "file", "path": n, "size": len(d),
                                        "oid": hashlib.sha1(d).hexdigest()} for n, d in hub.files.items()]).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                name, data = self._file()
                if data is None:
                    return self._not_found()
                rng = self.headers.get("Range")
                if rng:
                    hub.ranges.append(rng)
                    start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                    self._headers(name, data, 206, start)
                    self.wfile.write(data[start:])
                    return
                self._headers(name, data, 200)
                if name in hub.cut_once:
                    hub.cut_once.discard(name)
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    return write_tiny(tmp_path_factory.mktemp("pull") / "t.gguf", "llama", seed=3).read_bytes()


@pytest.fixture(scope="module")
def big_bytes(tmp_path_factory) -> bytes:
    """A GGUF over twice huggingface_hub's 10 MiB read chunk: a cut half-way has handed over whole chunks, which
    the library then resumes with a Range request (a smaller file is simply fetched again)."""
    import numpy as np

    def pad(tensors):
        tensors["pad"] = np.zeros(6 << 20, np.float32)
    return write_tiny(tmp_path_factory.mktemp("pull") / "big.gguf", "llama", seed=3, edit=pad).read_bytes()


@pytest.fixture
def env(tmp_path, tiny_bytes):
    hub = Hub({"tiny-llama-Q8_0.gguf": tiny_bytes, "README.md": b"# tiny\n"})
    e = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf"),
             PYENGINE_HOME=str(tmp_path / "pe"), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1")
    e.pop("HF_HUB_OFFLINE", None)
    e.pop("PYENGINE_MODEL", None)
    yield hub, e, tmp_path
    hub.close()


def cli(env, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pyengine", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_pull_from_hub_resumes_a_cut_transfer_and_resolves_by_name(env, big_bytes):
    hub, e, tmp = env
    tiny_bytes = hub.files["tiny-llama-Q8_0.gguf"] = big_bytes
    hub.cut_once.add("tiny-llama-Q8_0.gguf")
    r = cli(e, "pull", f"{REPO}/tiny-llama-Q8_0.gguf", cwd=tmp)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert Path(path).read_bytes() == tiny_bytes
    assert hub.ranges and hub.ranges[0] != "bytes=0-", "the cut transfer was not resumed with a Range request"
    # every name the docs promise resolves to that file: repo/file, file, stem, repo (its only GGUF)
    r = cli(e, "models", "--json", cwd=tmp)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    hub_rows = [x for x in rows if x["source"] == "hub"]
    assert [(x["name"], x["arch"], x["quant"], x["size"]) for x in hub_rows] == [
        (f"{REPO}/tiny-llama-Q8_0.gguf", "llama", "Q8_0", len(tiny_bytes))]
    for name in (f"{REPO}/tiny-llama-Q8_0.gguf", "tiny-llama-Q8_0.gguf", "tiny-llama-Q8_0", REPO):
        r = cli(e, "info", "--model", name, cwd=tmp)
        assert r.returncode == 0, (name, r.stderr)
        assert path in r.stdout and "llama" in r.stdout, (name, r.stdout)
    # pulled again: nothing downloaded
    n = len(hub.ranges)
    r = cli(e, "pull", f"{REPO}/tiny-llama-Q8_0.gguf", cwd=tmp)
    assert r.returncode == 0 and "already here" in r.stdout and len(hub.ranges) == n
    r = cli(e, "rm", "tiny-llama-Q8_0", cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(path) and not list((tmp / "hf").rglob("blobs/*"))
    r = cli(e, "info", "--model", "tiny-llama-Q8_0", cwd=tmp)
    assert r.returncode == 1 and "pyengine models" in r.stderr


def test_pull_repo_picks_its_gguf_and_refuses_a_wrong_checksum(env):
    hub, e, tmp = env
    r = cli(e, "pull", f"{REPO}:q8_0", cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("tiny-llama-Q8_0.gguf")
    r = cli(e, "pull", f"{REPO}:Q4_K_M", cwd=tmp)
    assert r.returncode == 1 and "no GGUF file matching 'Q4_K_M'" in r.stderr
    hub.bad_sha.add("tiny-llama-Q8_0.gguf")
    r = cli(e, "pull", "--force", f"{REPO}/tiny-llama-Q8_0.gguf", cwd=tmp)
    assert r.returncode == 1 and "checksum mismatch" in r.stderr
    assert not [p for p in (tmp / "hf").rglob("*.gguf")], "a file that failed its checksum was kept"


def test_pull_url_resumes_across_runs_and_checks_the_file(env, tiny_bytes):
    hub, e, tmp = env
    url = f"{hub.url}/plain/tiny-llama-Q8_0.gguf"
    hub.cut_once.add("tiny-llama-Q8_0.gguf")
    r = cli(e, "pull", url, cwd=tmp)
    assert r.returncode == 1 and "run the same pull again to resume" in r.stderr
    part = tmp / "pe" / "models" / "tiny-llama-Q8_0.gguf.part"
    assert 0 < part.stat().st_size < len(tiny_bytes)
    r = cli(e, "pull", url, "--sha256", hashlib.sha256(tiny_bytes).hexdigest(), cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert hub.ranges == [f"bytes={len(tiny_bytes) // 2}-"]
    assert Path(r.stdout.strip()).read_bytes() == tiny_bytes
    r = cli(e, "models", cwd=tmp)
    assert re.search(r"^tiny-llama-Q8_0\s+.*\sllama\s+Q8_0\s+url$", r.stdout, re.M), r.stdout
    # not a GGUF: refused and deleted
    hub.files["notes.gguf"] = b"this is not a gguf" * 10
    r = cli(e, "pull", f"{hub.url}/plain/notes.gguf", cwd=tmp)
    assert r.returncode == 1 and "not a readable GGUF" in r.stderr
    assert not (tmp / "pe" / "models" / "notes.gguf").exists()


def test_offline_and_unknown_names_say_what_to_do(tmp_path):
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    e = dict(os.environ, HF_ENDPOINT=closed, HF_HUB_CACHE=str(tmp_path / "hf"), PYENGINE_HOME=str(tmp_path / "pe"),
             HF_HUB_DISABLE_XET="1")
    e.pop("PYENGINE_MODEL", None)
    r = cli(e, "pull", f"{REPO}/tiny-llama-Q8_0.gguf", cwd=tmp_path)
    assert r.returncode == 1 and "cannot reach" in r.stderr and "Traceback" not in r.stderr
    r = cli(e, "info", "--model", "HuggingFaceTB/SmolLM2-360M-Instruct-GGUF", cwd=tmp_path)
    assert r.returncode == 1 and "pyengine pull HuggingFaceTB/SmolLM2-360M-Instruct-GGUF" in r.stderr
    r = cli(e, "models", cwd=tmp_path)          # the packaged default model is listed by its name
    assert re.search(r"^SmolLM2-135M-Instruct\s.*\sllama\s+Q4_1\s+packaged$", r.stdout, re.M), r.stdout
    r = cli(e, "rm", "SmolLM2-135M-Instruct", cwd=tmp_path)
    assert r.returncode == 1 and "pip uninstall" in r.stderr
