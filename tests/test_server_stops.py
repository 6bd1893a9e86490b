"""Issues 27.5, 27.7, 33.1-33.3, 33.7: the server's connection safety and its clean starts and stops.

- stalled uploads cannot starve the server: one client address holds at most a few connections whose body
  is still arriving, and a body's first byte has its own short deadline;
- a graceful stop (SIGTERM / SIGINT) stops admissions, lets running requests finish within the shutdown
  timeout, then ends each open stream with an error event and [DONE];
- `pyengine serve` without the server extras gives a one-line hint; its start and ready lines say what it built.

The connection tests run the real app under uvicorn with the stand-in engine of test_server_errors.py.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from pyengine.server.app import create_app
from pyengine.server.limits import ServerLimits
from pyengine.server.http_server import ServerThread, client_key
from test_mpi_serve import ranks_of, tagged
from test_server_errors import FakeEngine

COMP = {"prompt": "hello", "max_tokens": 4}


def stalled_upload(port: int, source: str = "127.0.0.1", first: bytes = b"") -> socket.socket:
    """A POST whose headers arrive and whose body (100 bytes declared) never finishes."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n" + first)
    return s


def answer(s: socket.socket, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    return out


def test_client_key_groups_ipv6_by_64():
    assert client_key("127.0.0.2") == "127.0.0.2"
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1"


def test_stalled_uploads_cannot_starve_health_or_other_clients():
    """256 uploads that never finish (the default connection cap), all from one address: that address keeps
    a few (--max-uploads-per-client), the rest are answered 429 and closed (at once, as the server is crowded), so
    /health and another client are served while they are open (before the fix: 503 until the 30 s body timeout)."""
    limits = ServerLimits(body_timeout=60, header_timeout=60, max_uploads_per_client=4, body_first_byte_timeout=60)
    with ServerThread(create_app(FakeEngine(), model_id="m", limits=limits)) as srv:
        stalled = [stalled_upload(srv.port, first=b'{"prompt": ') for _ in range(256)]
        try:
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200    # at once: no grace when crowded
            uploads, deadline = srv.server.config.http.uploads, time.monotonic() + 10
            while (uploads.count("127.0.0.1") < 4 or len(srv.server.server_state.connections) > 64) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)                                        # shed after the grace (0.5 s)
            late = stalled_upload(srv.port, first=b'{"prompt": ')       # this client's share is full: at once
            assert answer(late, 2).startswith(b"HTTP/1.1 429")
            late.close()
            with httpx.Client(timeout=30) as c:
                assert c.get(srv.url + "/health").status_code == 200
                other = httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
                with other:
                    r = other.post(srv.url + "/v1/completions", json=COMP)
                    assert r.status_code == 200, r.text
            # which 4 of the uploads the server kept depends on the order it accepted them, not on creation order
            answers = [answer(s, 2) for s in stalled[:12]]
            refused = [a for a in answers if a]
            assert len(refused) >= 8, answers                           # at most 4 kept (no answer: still open)
            assert all(a.startswith(b"HTTP/1.1 429") and b'"too_many_uploads"' in a for a in refused), refused
            assert len(srv.server.server_state.connections) < 64       # the refused ones are closed
        finally:
            for s in stalled:
                s.close()


def test_first_byte_of_a_body_has_its_own_deadline():
    limits = ServerLimits(body_timeout=60, body_first_byte_timeout=0.5, keep_alive_timeout=0.5)
    with ServerThread(create_app(FakeEngine(), model_id="m", limits=limits)) as srv:
        t0 = time.monotonic()
        silent = stalled_upload(srv.port)                  # headers, then not a byte of the body
        out = answer(silent, 20)
        assert out.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in out, out
        assert time.monotonic() - t0 < 10                  # the first-byte deadline, not the 60 s body timeout
        crowd = ServerLimits(body_timeout=60, body_first_byte_timeout=0.5, max_connections=2)
        with ServerThread(create_app(FakeEngine(), model_id="m", limits=crowd)) as full:   # counted at once
            out = answer(stalled_upload(full.port), 20)
            assert out.startswith(b"HTTP/1.1 408"), out
        slow = stalled_upload(srv.port, first=b'{"prompt": "hel')   # started: only the whole-body timeout holds it
        time.sleep(1.0)
        slow.sendall(b'lo", "max_tokens": 4}'.ljust(100 - 15))
        assert answer(slow, 20).startswith(b"HTTP/1.1 200")
        silent.close()
        slow.close()


# --- 33.1 / 33.4: install hints ---------------------------------------------------------------------------
NO_SERVER_EXTRAS = """
import sys
for m in ("starlette", "uvicorn", "prometheus_client"):
    sys.modules[m] = None            # as if the [server] extra were not installed
from pyengine.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["serve", "--help"], ["serve"]])
def test_serve_without_server_extras_gives_a_one_line_hint(argv):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", NO_SERVER_EXTRAS, *argv], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "ModuleNotFoundError" not in out, out
    assert f"pip install -e '{root}[server]'" in out, out
    if argv == ["serve"]:
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    else:
        assert r.returncode == 0 and "--shutdown-timeout" in r.stdout


def test_no_install_hint_names_the_unrelated_pypi_project():
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    bad = re.compile(r"pip install\s+['\"]?pyengine\[")
    files = [p for d in ("pyengine", "docs", "scripts") for p in (root / d).rglob("*")
             if p.suffix in (".py", ".md", ".sh") and p.is_file()] + [root / "README.md"]
    hits = [f"{p.relative_to(root)}:{i}" for p in files
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if bad.search(line)]
    assert not hits, hits
    from pyengine.model_files import extras_hint
    assert extras_hint("parallel") == f"pip install -e '{root}[parallel]'"


# --- 27.7 / 33.2 / 33.3: graceful stops, process level ----------------------------------------------------
class ServeProcess:
    """`python -m pyengine serve ...` in its own session (as from a terminal: Ctrl-C is SIGINT to the process
    group), output to a file; its MPI ranks inherit PYENGINE_TEST_SERVER (its pid), by which they are found."""

    def __init__(self, tmp_path, *extra, shutdown_timeout: float = 3.0):
        import os
        import subprocess
        import sys
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        cmd = [sys.executable, "-c", "import os, runpy, sys; os.environ['PYENGINE_TEST_SERVER'] = str(os.getpid()); "
               "sys.argv = ['pyengine'] + sys.argv[1:]; runpy.run_module('pyengine', run_name='__main__')",
               "serve", "--port", str(self.port), "--max-model-len", "1024", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "256", "--shutdown-timeout", str(shutdown_timeout), *extra]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout=240):
        t0 = time.time()
        while time.time() - t0 < timeout:
            assert self.proc.poll() is None, self.text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("server did not start")

    def ranks(self) -> dict[int, int]:
        return ranks_of(self.proc.pid)

    def job(self) -> list[int]:
        """Every process of the job still alive: the launcher's session (mpiexec, prterun, ranks, workers)."""
        import os
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z" and self.proc.pid in (int(stat[1]), int(stat[3])):   # its children, its session
                out.append(int(d))
        out += [p for p in tagged(self.proc.pid) if p not in out and alive(p)]     # ranks and their helpers
        return [p for p in out if p != self.proc.pid]

    def kill(self) -> None:
        import os
        import signal
        for pid in [self.proc.pid, *self.job()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except Exception:
            pass


def alive(pid: int) -> bool:
    import os
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def open_stream(url: str, max_tokens: int):
    """A streamed completion under way (its first chunk read): (response, line iterator, client)."""
    c = httpx.Client(timeout=120)
    r = c.send(c.build_request("POST", url + "/v1/completions", json={
        "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True}), stream=True)
    assert r.status_code == 200
    lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
    first = next(lines)
    return r, lines, c, [first]


def finish(stream) -> list:
    r, lines, c, seen = stream
    try:
        events = seen + list(lines)
    finally:
        r.close()
        c.close()
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def check_graceful_stop(srv: ServeProcess, sig_to_group, grace: float) -> None:
    """Two streams run when the stop signal comes: the short one finishes normally within the grace, the long
    one is ended at the grace with an error event and [DONE]; nothing new is admitted; no traceback."""
    import os
    long = open_stream(srv.url, 900)
    short = open_stream(srv.url, 3)
    t0 = time.monotonic()
    os.killpg(srv.proc.pid, sig_to_group) if sig_to_group else None
    short_events, long_events = finish(short), finish(long)
    took = time.monotonic() - t0
    assert short_events[-1] == "[DONE]" and short_events[-2].get("choices", [{}])[0].get("finish_reason") == "length", \
        (took, short_events, long_events[-3:])
    assert long_events[-1] == "[DONE]", long_events[-3:]
    err = long_events[-2]
    assert "error" in err and err["error"]["code"] == "aborted" and "shutting down" in err["error"]["message"], err
    assert sum(1 for e in long_events if isinstance(e, dict) and "choices" in e) >= 2    # it ran during the grace
    assert grace * 0.8 < took < grace + 30, took
    with pytest.raises(httpx.HTTPError):                 # not admitting: the listener is closed
        httpx.post(srv.url + "/v1/completions", json=COMP, timeout=5)


def test_ctrl_c_on_serve_finishes_streams_without_traceback(tmp_path):
    import signal
    import subprocess
    srv = ServeProcess(tmp_path, shutdown_timeout=5)
    try:
        srv.wait_ready()
        check_graceful_stop(srv, signal.SIGINT, 5)
        try:
            code = srv.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        text = srv.text()
        assert code == 130, text[-3000:]                 # Ctrl-C's conventional status, after a clean stop
        assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
        assert "shutting down" in text
        # the tokenizer and grammar workers went with it; multiprocessing's resource tracker (reparented, in the
        # server's session) leaves when it reads the server's end of its pipe: a moment after, not before
        assert not wait_gone(srv.job(), 10), srv.job()
        check_start_lines(text, 1024, "one process")

    finally:
        srv.kill()


def check_start_lines(text: str, context: int, layout: str) -> None:
    """33.7: a line as loading starts, and a ready line with the KV capacity and the parallel layout."""
    import re
    lines = text.splitlines()
    loading = next(i for i, ln in enumerate(lines) if ln.startswith("pyengine serve: loading"))
    ready = next(i for i, ln in enumerate(lines) if ln.startswith("pyengine serve: model "))
    assert loading < ready and layout in lines[loading] and layout in lines[ready], lines[:ready + 1]
    m = re.search(r"KV cache (\d+) blocks x (\d+) tokens, (\d+) sequences? at the full (\d+)-token context",
                  lines[ready])
    assert m, lines[ready]
    blocks, size, full, ctx = map(int, m.groups())
    assert ctx == context and size == 16 and blocks > 0 and full == blocks // -(-context // size)


def wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.slow
def test_ctrl_c_on_tensor_parallel_serve_is_graceful_and_logs_have_no_ansi(tmp_path):
    """Ctrl-C (SIGINT to the process group) of `serve --tensor-parallel-size 2`: as SIGTERM, rank 0 finishes
    what it can, ends the rest with an error event and [DONE], stops its ranks, and every process exits 0."""
    import signal
    import subprocess
    pytest.importorskip("mpi4py")
    srv = ServeProcess(tmp_path, "--tensor-parallel-size", "2", shutdown_timeout=12)
    try:
        srv.wait_ready()
        ranks = srv.ranks()
        assert sorted(ranks) == [0, 1]
        check_graceful_stop(srv, signal.SIGINT, 12)
        try:
            code = srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        text = srv.text()
        assert code == 0, text[-3000:]
        assert "Traceback" not in text and "shutting down" in text, text[-3000:]
        assert "\x1b[" not in text, repr(text[-2000:])         # no colour codes in a file
        check_start_lines(text, 1024, "tensor-parallel 2 over 2 MPI ranks")
        assert not wait_gone(ranks.values(), 10)
    finally:
        srv.kill()


@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_process_and_frees_the_port(tmp_path):
    import os
    import signal
    pytest.importorskip("mpi4py")
    srv = ServeProcess(tmp_path, "--tensor-parallel-size", "2")
    try:
        srv.wait_ready()
        job = srv.job()
        assert len(srv.ranks()) == 2 and len(job) >= 3, job      # mpiexec (prterun) and both ranks at least
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        left = wait_gone(job, 10)
        assert not left, [open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:200] for p in left]
        assert port_free(srv.port)
    finally:
        srv.kill()


# --- 26.5: the EngineClient contract; /health states ---------------------------------------------------------
def test_engine_client_contract_and_health_states():
    from starlette.testclient import TestClient

    from pyengine.disagg.router import Router
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.server.engine_client import EngineClient
    for cls in (LLMEngine, Router):                     # every method of the contract, by name and signature
        for name in ("get_tokenizer", "add_request", "abort_request", "has_unfinished_requests", "step", "stats",
                     "num_used_blocks", "health", "model_metadata"):
            assert callable(getattr(cls, name, None)), (cls.__name__, name)
    assert isinstance(FakeEngine(), EngineClient)

    class NoHealth:
        max_model_len = 64
    with pytest.raises(TypeError, match="lacks .*health"):
        create_app(NoHealth())

    class Degraded(FakeEngine):
        state = ("degraded", "no prefill instance is alive (rank 1: pid 9 dead)")

        def health(self):
            return self.state
    engine = Degraded()
    with TestClient(create_app(engine, model_id="m"), base_url="http://127.0.0.1") as c:
        h = c.get("/health")
        assert h.status_code == 503 and h.json() == {"status": "degraded", "reason": engine.state[1]}
        assert c.post("/v1/completions", json=COMP).status_code == 200      # degraded still serves
        engine.state = ("unhealthy", "rank 1 dead")
        r = c.post("/v1/completions", json=COMP)
        assert r.status_code == 503 and "rank 1 dead" in r.json()["error"]["message"]


def test_failed_stream_counts_the_status_its_client_saw():
    """A lost MPI rank ends a stream with a 503-type error event: the metrics count 503, not 500."""
    from pyengine.parallel.mpi import ParallelError

    class LosesRank(FakeEngine):
        def step(self):
            raise ParallelError("rank 1 (pid 9) dead")
    from starlette.testclient import TestClient
    with TestClient(create_app(LosesRank(), model_id="m"), base_url="http://127.0.0.1") as c:
        with c.stream("POST", "/v1/completions", json={**COMP, "stream": True}) as r:
            events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "engine_unavailable" and events[-1] == "data: [DONE]"
        m = c.get("/metrics").text
        assert 'errors_total{status="503"} 1.0' in m and 'status="500"' not in m, m


@pytest.mark.slow
def test_disaggregated_serve_degraded_health_graceful_ctrl_c_and_non_zero_exit_after_a_lost_rank(tmp_path):
    """`serve --prefill-instances 1 --decode-instances 1`: with its prefill instance killed /health says degraded
    (503, naming the rank) while the decode instance serves whole requests; Ctrl-C then stops it as gracefully as
    SIGTERM (streams finished or ended with an error event and [DONE]); the launcher exits non-zero, naming the
    rank that died."""
    import os
    import signal
    import subprocess
    pytest.importorskip("mpi4py")
    srv = ServeProcess(tmp_path, "--prefill-instances", "1", "--decode-instances", "1", shutdown_timeout=12)
    try:
        srv.wait_ready()
        ranks = srv.ranks()
        assert sorted(ranks) == [0, 1, 2]
        os.kill(ranks[1], signal.SIGKILL)                        # the prefill instance
        deadline = time.monotonic() + 30
        while (h := httpx.get(srv.url + "/health", timeout=5)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert h.status_code == 503 and h.json()["status"] == "degraded" and "rank 1" in h.json()["reason"], h.text
        check_graceful_stop(srv, signal.SIGINT, 12)
        try:
            code = srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        text = srv.text()
        said = "\n".join(line for line in text.splitlines() if "GET /health" not in line)
        assert code == 1 and "MPI rank 1 ended without shutting down" in text, f"exit {code}\n{said[-3000:]}"
        assert "pyengine serve: loading SmolLM2" in text and "decode rank 2: KV cache" in text, text[:2000]
        assert "Traceback" not in text, text[-3000:]
        assert not wait_gone(ranks.values(), 10)
    finally:
        srv.kill()


def test_route_table_is_what_is_routed_and_what_the_404_lists():
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from pyengine.server.app import ROUTE_TABLE
    app = create_app(FakeEngine(), model_id="m")
    routed = {(m, r.path) for r in app.routes if isinstance(r, Route) for m in r.methods if m != "HEAD"}
    assert routed == {(m, p) for m, p, _ in ROUTE_TABLE}
    with TestClient(app, base_url="http://127.0.0.1") as c:
        text = c.get("/nope").json()["error"]["message"]
    assert all(f"{m} {p}" in text for m, p, _ in ROUTE_TABLE), text
