"""S17 over MPI behind the OpenAI server: `pyengine serve --tensor-parallel-size 2` and `--pipeline-parallel-size
2` start their ranks themselves (the wheel's mpiexec) and serve the official `openai` client the same greedy
tokens as one process (the reference: LLM in this process). Faults: a rank that stops answering (SIGSTOP) or
dies (SIGKILL) mid-step makes the in-flight request fail with a clear error within the timeout while the server
lives on, /health turns unhealthy naming the rank, new requests get 503, its KV is freed, and stopping the
server stops every rank."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from model_paths import model_path
from test_mpi_prompt_values import check_served_prompt_values

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(pid: int) -> dict[int, int]:
    """pid -> MPI rank of every process started under the process ``pid`` (found by the PYENGINE_TEST_SERVER
    their environments inherit): the ranks and their own helper processes."""
    found: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            env = open(f"/proc/{d}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        vals = dict(e.split(b"=", 1) for e in env if b"=" in e)
        if vals.get(b"PYENGINE_TEST_SERVER") == str(pid).encode() and b"OMPI_COMM_WORLD_RANK" in vals:
            found[int(d)] = int(vals[b"OMPI_COMM_WORLD_RANK"])
    return found


def ranks_of(pid: int) -> dict[int, int]:
    """MPI rank -> pid of every rank started under the process ``pid``. A rank's own helper processes (the
    tokenizer and grammar workers rank 0 spawns) inherit its environment: the rank is the one whose parent is
    not a process of the same rank."""
    found: dict[int, list[int]] = {}
    for p, rank in tagged(pid).items():
        found.setdefault(rank, []).append(p)

    def parent(p: int) -> int | None:
        try:
            return int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return {rank: next((p for p in pids if parent(p) not in pids), pids[0]) for rank, pids in found.items()}


class Server:
    """`python -m pyengine serve ...` in its own session; the ranks it starts inherit PYENGINE_TEST_SERVER (its
    pid), by which the test finds them."""

    def __init__(self, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "import os, runpy, sys; os.environ['PYENGINE_TEST_SERVER'] = str(os.getpid()); "
               "sys.argv = ['pyengine'] + sys.argv[1:]; runpy.run_module('pyengine', run_name='__main__')",
               "serve", "--port", str(self.port), "--max-model-len", "256", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "256", *extra]
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout=240):
        t0 = time.time()
        while time.time() - t0 < timeout:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server did not start")

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self) -> int | None:
        """SIGTERM to the server process alone (as a service manager does): it must stop its ranks itself.
        Returns its exit code (None if it had to be killed)."""
        code = None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                code = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        else:
            code = self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)      # whatever is left (nothing, when it works)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        return code


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def eventually(check, timeout: float = 30.0, every: float = 0.2):
    """Run ``check`` (it asserts) until it passes, then return what it returns; after ``timeout`` seconds raise
    its last failure. Reports to the router, /metrics and a stopped job's exits arrive asynchronously: a loaded
    host makes them later, not different."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(every)


def all_gone(ranks: dict) -> None:
    assert all(gone(pid) for pid in ranks.values()), "a rank outlived the server"


@pytest.fixture(scope="module")
def reference():
    from pyengine import LLM
    from pyengine.sampling_params import SamplingParams
    llm = LLM(model_path("smollm2"), max_model_len=256, max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_openai_client_over_mpi_ranks(reference, flags):
    s = Server(*flags)
    try:
        s.wait_ready()
        ranks = ranks_of(s.proc.pid)
        assert sorted(ranks) == [0, 1]                  # started through mpiexec, one process per rank
        c = s.client()
        got = [c.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert got == reference
        chat = c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, stream=True,
                                         messages=[{"role": "user", "content": "Hi!"}])
        assert "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices)
        check_served_prompt_values(c, s.url)           # S19: echo + logprobs and embeddings over the ranks
    finally:
        code = s.stop()
    assert code == 0                                       # SIGTERM: rank 0 shut down and sent every rank STOP
    eventually(lambda: all_gone(ranks))


FAULTS = [("SIGSTOP", "stopped", ["--tensor-parallel-size", "2"]), ("SIGKILL", "dead", ["--tensor-parallel-size", "2"]),
          ("SIGKILL", "dead", ["--pipeline-parallel-size", "2"])]


@pytest.mark.parametrize("sig,state,flags", FAULTS, ids=["tp2-hang", "tp2-die", "pp2-die"])
def test_lost_rank_fails_requests_with_503_and_health_names_it(sig, state, flags):
    """A rank that hangs (SIGSTOP) or dies (SIGKILL) mid-generation: the in-flight request fails with an error
    naming it, within the timeout; its KV blocks are freed; /health says which rank and how; new requests get
    503; the server (rank 0) keeps answering, and SIGTERM to it stops every rank."""
    s = Server(*flags, "--parallel-timeout", "3")
    try:
        s.wait_ready()
        ranks = ranks_of(s.proc.pid)
        c = s.client()
        stream = c.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=200,
                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))                               # generation is under way
        os.kill(ranks[1], getattr(signal, sig))
        t0 = time.time()
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                pass
        assert time.time() - t0 < 30                     # detected within the timeout, not hung
        assert "rank 1" in str(err.value.body or err.value) or "unavailable" in str(err.value)
        assert s.proc.poll() is None                      # rank 0 and its server survived the loss
        h = httpx.get(s.url + "/health", timeout=5)
        assert h.status_code == 503 and "rank 1" in h.json()["reason"] and state in h.json()["reason"]
        with pytest.raises(openai.APIStatusError) as err:
            c.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
        assert err.value.status_code == 503 and "rank 1" in str(err.value.body)
        m = httpx.get(s.url + "/metrics", timeout=5).text
        used = re.search(r"^\w*kv_cache_used_blocks (\S+)$", m, re.M)
        assert used and float(used.group(1)) == 0.0            # the failed request's KV blocks were freed
    finally:
        code = s.stop()
    assert code is not None                                      # it stopped by itself on SIGTERM
    eventually(lambda: all_gone(ranks))
