"""S17/S18 across two "hosts" for real: two network namespaces this test creates, joined by a veth pair, each with
its own network stack (its own loopback and address), so the ranks on one reach the other only over TCP; Open MPI
runs with `btl tcp,self` (no shared memory at all) and starts the second host's daemon through its remote-launch
agent (`plm_ssh_agent`) pointed at a script that runs the command with `ip netns exec` -- the way `mpiexec
--hostfile` reaches a real second machine through ssh. The link is shaped with `tc` (a token-bucket rate limit:
this kernel has no `netem` qdisc for a fixed delay).

- TP 2 x PP 2 (`LLM(tensor_parallel_size=2, pipeline_parallel_size=2)`): stage 0's two ranks on host A, stage 1's
  on host B; greedy tokens equal one process's.
- a 1 prefill + 1 decode disaggregated server (`pyengine serve --prefill-instances 1 --decode-instances 1`): the
  router and the prefill instance on host A, the decode instance on host B, so every prompt's KV blocks cross the
  link; a client inside host A gets one process's greedy text.

Needs root, iproute2 and the `parallel` extra; the step times it prints are the figures of docs/scaling.md."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from model_paths import model_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="network namespaces need root and iproute2")]
pytest.importorskip("mpi4py")

PROMPTS = ["The capital of France is", "def fib(n):", "Water boils at"]
# the shaped link (tc tbf); PYENGINE_TWO_HOSTS_RATE=none runs unshaped (docs/scaling.md compares the two)
RATE = None if os.environ.get("PYENGINE_TWO_HOSTS_RATE", "20mbit") == "none" else \
    os.environ.get("PYENGINE_TWO_HOSTS_RATE", "20mbit")


def sh(*cmd, check=True, **kw):
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, **kw)


class Hosts:
    """Two namespaces `<tag>a`, `<tag>b` with addresses 10.213.<k>.1 and .2 on a veth pair."""

    def __init__(self, tmp):
        k = os.getpid() % 200 + 20
        self.tag = f"pe{os.getpid() % 10000}"
        self.ns = [self.tag + "a", self.tag + "b"]
        self.ip = [f"10.213.{k}.1", f"10.213.{k}.2"]
        self.subnet = f"10.213.{k}.0/24"
        self.dev = [self.tag + "va", self.tag + "vb"]
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, ip in zip(self.ns, self.dev, self.ip):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", ip + "/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        self.agent = tmp / "netns-agent"
        cases = "\n".join(f"  {ip}) ns={ns} ;;" for ip, ns in zip(self.ip, self.ns))
        self.agent.write_text(textwrap.dedent("""\
            #!/bin/sh
            # Open MPI's remote-launch agent: "agent HOST COMMAND" runs COMMAND on HOST (its network namespace)
            host="$1"; shift
            case "$host" in
            """) + cases + '\n  *) echo "unknown host $host" >&2; exit 1 ;;\nesac\n'
            'exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns; $*"\n')
        self.agent.chmod(0o755)

    def shape(self, rate: str | None) -> None:
        for ns, dev in zip(self.ns, self.dev):
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", "32kbit", "latency", "400ms")

    def mpiexec(self, slots: list[int], argv: list[str]) -> list[str]:
        """The command that runs `python argv` as sum(slots) ranks, slots[i] on host i, from host 0."""
        from pyengine.parallel.launch import mpiexec_command
        base = mpiexec_command(sum(slots), argv, oversubscribe=False)
        hosts = ",".join(f"{ip}:{n}" for ip, n in zip(self.ip, slots) if n)
        extra = ["--prtemca", "plm_ssh_agent", str(self.agent), "--prtemca", "oob_tcp_if_include", self.subnet,
                 "--host", hosts, "--map-by", "slot"]
        inner = " ".join(shlex.quote(a) for a in base[:1] + extra + base[1:])
        return ["ip", "netns", "exec", self.ns[0], "unshare", "--uts", "/bin/sh", "-c",
                f"hostname {self.ns[0]}; exec {inner}"]

    def env(self) -> dict:
        from pyengine.parallel.launch import rank_env
        env = rank_env(tcp=True)
        env["OMPI_MCA_btl_tcp_if_include"] = self.subnet
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        return env

    def close(self) -> None:
        for ns in self.ns:
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            sh("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts(tmp_path_factory.mktemp("hosts"))
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="module")
def reference():
    from pyengine import LLM, SamplingParams
    llm = LLM(model_path("smollm2"), max_model_len=256, max_num_seqs=4)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in out]


TP_PP_SCRIPT = """\
import json, socket, sys, time
from pyengine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=256, max_num_seqs=4)
out = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
t = time.perf_counter()
one = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
ms = (time.perf_counter() - t) * 1000 / 32
print("OUT " + json.dumps({"ids": [o.outputs[0].token_ids for o in out], "ms_per_token": ms}), flush=True)
"""


def test_tp2_pp2_across_two_hosts_equals_one_process(hosts, reference, tmp_path, rate=RATE):
    script = tmp_path / "tp_pp.py"
    script.write_text(TP_PP_SCRIPT)
    hosts.shape(rate)
    p = subprocess.run(hosts.mpiexec([2, 2], [str(script), model_path("smollm2"), json.dumps(PROMPTS)]),
                       env=hosts.env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("OUT ")]
    assert len(lines) == 1, p.stdout[-2000:]
    got = json.loads(lines[0][4:])
    assert got["ids"] == reference
    print(f"\nTP 2 x PP 2 across two namespaces, link {rate or 'unshaped'}: "
          f"{got['ms_per_token']:.1f} ms per generated token (one sequence)")


CLIENT = """\
import json, sys, time, urllib.request
url = sys.argv[1]
deadline = time.time() + 300
while True:
    try:
        if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
            break
    except Exception:
        if time.time() > deadline:
            sys.exit("server not up")
        time.sleep(0.5)
out = []
for prompt in json.loads(sys.argv[2]):
    body = json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                       "logprobs": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    r = json.loads(urllib.request.urlopen(req, timeout=300).read())
    out.append({"text": r["choices"][0]["text"], "s": time.perf_counter() - t})
print("OUT " + json.dumps(out), flush=True)
"""


def test_disaggregated_prefill_and_decode_on_two_hosts(hosts, reference, tmp_path):
    from pyengine import LLM
    tok = LLM(model_path("smollm2"), max_model_len=256, max_num_seqs=1).get_tokenizer()
    hosts.shape(RATE)
    port = 18000 + os.getpid() % 1000
    serve = [sys.executable, "-m", "pyengine", "serve", "--model", model_path("smollm2"), "--prefill-instances", "1",
             "--decode-instances", "1", "--max-model-len", "256", "--port", str(port)]
    server = subprocess.Popen(hosts.mpiexec([2, 1], serve[1:]), env=hosts.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        client = tmp_path / "client.py"
        client.write_text(CLIENT)
        c = subprocess.run(["ip", "netns", "exec", hosts.ns[0], sys.executable, str(client),
                            f"http://127.0.0.1:{port}", json.dumps(PROMPTS)], capture_output=True, text=True,
                           timeout=600)
        assert c.returncode == 0, c.stdout[-2000:] + c.stderr[-2000:]
        got = json.loads(next(ln for ln in c.stdout.splitlines() if ln.startswith("OUT "))[4:])
        assert [g["text"] for g in got] == [tok.decode(ids) for ids in reference]
        print(f"\ndisaggregated across two namespaces, link {RATE}: "
              + ", ".join(f"{g['s'] * 1000:.0f} ms" for g in got) + " per 12-token request")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        hosts.shape(None)
