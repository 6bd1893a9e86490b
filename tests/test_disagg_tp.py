"""S18 with tensor-parallel instances: `pyengine serve --prefill-instances 1 --decode-instances 1
--tensor-parallel-size 2` starts 5 MPI ranks (router; prefill leader + follower; decode leader + follower), each
instance's KV heads sharded over its two ranks and its blocks gathered / scattered whole (kv_transfer.KVBlocks).
The reference is the colocated single-process engine (LLM in this process): greedy text on the golden prompts and
on a multi-block prompt, and seeded sampling, identical through the official `openai` client; a second prompt
sharing 4 blocks with the first ships only the blocks the decode instance does not hold; an abort mid-decode
leaves 0 blocks in use on both instances; a killed prefill follower fails the request on that instance cleanly
while the decode instance finishes its running stream and serves new requests; a killed decode follower then ends
that instance's stream with the error and leaves the server unhealthy (no decode instance). Then prefill T=2 -> decode T=1
(heterogeneous) gives the same text."""
import os
import signal
import time

import httpx
import pytest

from model_paths import model_path
from test_disagg_serve import PROMPTS, metric, prefill_down_decode_empty
from test_mpi_serve import Server, all_gone, eventually, gone, ranks_of

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--prefill-instances", "1", "--decode-instances", "1", "--tensor-parallel-size", "2")
LONG = [1000 + 7 * i for i in range(70)]                 # 4 full blocks of 16 + a partial one
SHARED = LONG[:64] + [5000 + i for i in range(9)]         # its first 4 blocks, then its own tail
SEEDED = dict(temperature=0.8, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def reference():
    from pyengine import LLM
    from pyengine.sampling_params import SamplingParams
    llm = LLM(model_path("smollm2"), max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    long = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in (LONG, SHARED)], greedy)]
    seeded = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, ignore_eos=True, **SEEDED))[0].outputs[0].text
    return {"greedy": texts, "long": long, "seeded": seeded}


def complete(c, prompt, **kw):
    kw = {"max_tokens": 8, "temperature": 0, **kw}
    return c.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **kw).choices[0].text


def totals(s) -> tuple[float, float]:
    m = httpx.get(s.url + "/metrics", timeout=5).text
    return metric(m, "pyengine_kv_transfer_blocks_total"), metric(m, "pyengine_kv_transfer_cached_blocks_total")


@pytest.fixture(scope="module")
def server():
    s = Server(*FLAGS)
    s.wait_ready()
    s.ranks = ranks_of(s.proc.pid)
    yield s
    s.stop()
    eventually(lambda: all_gone(s.ranks))


def test_tp_instances_serve_the_colocated_engines_text(server, reference):
    assert sorted(server.ranks) == [0, 1, 2, 3, 4]
    c = server.client()
    assert [complete(c, p) for p in PROMPTS] == reference["greedy"]
    assert complete(c, PROMPTS[0], max_tokens=12, **SEEDED) == reference["seeded"]
    chunks = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, max_tokens=6, stream=True, temperature=0, messages=[{"role": "user", "content": "Hi!"}])
        if ch.choices]
    assert len([x for x in chunks if x]) >= 2
    # the multi-block prompt, then one sharing its first 4 blocks: only the blocks the decode side lacks move
    sent0, cached0 = totals(server)
    assert complete(c, LONG) == reference["long"][0]

    def moved(base, want):
        now = totals(server)
        assert (now[0] - base[0], now[1] - base[1]) == want
        return now
    sent1, cached1 = eventually(lambda: moved((sent0, cached0), (5, 0)))
    assert complete(c, SHARED) == reference["long"][1]
    eventually(lambda: moved((sent1, cached1), (1, 4)))            # 5 blocks: 4 cached, 1 shipped
    m = httpx.get(server.url + "/metrics", timeout=5).text
    for rank, role in ((1, "prefill"), (3, "decode")):            # one series per instance, named by its leader
        assert metric(m, "pyengine_instance_up", f'{{rank="{rank}",role="{role}"}}') == 1.0
    for rank in (2, 4):
        assert f'rank="{rank}"' not in m


def test_abort_mid_decode_leaves_no_blocks_in_use(server):
    c = server.client()
    stream = c.completions.create(model=MODEL, prompt=LONG, max_tokens=150, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.response.close()                                        # the client goes away mid-decode
    deadline = time.time() + 20
    while True:
        m = httpx.get(server.url + "/metrics", timeout=5).text
        used = [metric(m, "pyengine_instance_kv_cache_used_blocks", f'{{rank="{r}",role="{role}"}}')
                for r, role in ((1, "prefill"), (3, "decode"))]
        if used == [0.0, 0.0] or time.time() > deadline:
            break
        time.sleep(0.3)
    assert used == [0.0, 0.0]
    assert metric(m, "pyengine_num_requests_running") == 0


def test_killed_followers_fail_their_instances_requests_cleanly(server, reference):
    c = server.client()
    running = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True})
    it = iter(running)
    next(it)                                                       # decoding on ranks 3-4
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": [1000 + i for i in range(240)], "max_tokens": 4,
                            "stream": True}) as victim:
        os.kill(server.ranks[2], signal.SIGKILL)                   # the prefill instance's follower, mid-prefill
        body = "".join(victim.iter_text())
    assert "prefill instance rank 1" in body and '"error"' in body
    assert not gone(server.ranks[1])                               # its leader lives on (down, not crashed)
    rest = [ch.choices[0].text for ch in it if ch.choices]
    assert len(rest) + 1 == 60                                     # the running stream lost nothing
    assert [complete(c, p) for p in PROMPTS] == reference["greedy"]   # the decode instance prefills them now
    h = httpx.get(server.url + "/health", timeout=5)      # issue 27.7: serving, but degraded (was 200 "ok")
    assert h.status_code == 503 and h.json()["status"] == "degraded" and "rank 1" in h.json()["reason"]
    eventually(lambda: prefill_down_decode_empty(server.url, 3))
    # then the decode instance's follower, mid-stream: that instance goes down too, its stream ends with the error,
    # and with no decode instance left the server is unhealthy (its leader lives on, down)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 150, "stream": True,
                            "ignore_eos": True}) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))      # decoding on ranks 3-4
        os.kill(server.ranks[4], signal.SIGKILL)
        rest = "\n".join(lines)
    assert "decode instance rank 3" in rest and '"error"' in rest
    assert not gone(server.ranks[3])
    deadline = time.time() + 10
    while httpx.get(server.url + "/health", timeout=5).status_code != 503 and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 503


def test_prefill_tp2_ships_to_decode_tp1(reference):
    s = Server("--prefill-instances", "1", "--decode-instances", "1", "--prefill-tensor-parallel-size", "2")
    try:
        s.wait_ready()
        ranks = ranks_of(s.proc.pid)
        assert sorted(ranks) == [0, 1, 2, 3]
        c = s.client()
        assert [complete(c, p) for p in PROMPTS] == reference["greedy"]
        assert complete(c, LONG) == reference["long"][0]
    finally:
        s.stop()
    eventually(lambda: all_gone(ranks))


@pytest.mark.parametrize("model,dtype", [("smollm2", "auto"), ("smollm2", "fp16"), ("smollm2", "q8_0"),
                                         ("gemma3", "q8_0")])
def test_tp_kv_blocks_gather_and_scatter_whole_blocks(tmp_path, model, dtype):
    """Over 2 tensor ranks (SmolLM2's 3 KV heads as 2 + 1; Gemma 3's one KV head replicated on both) the gathered
    blocks are one process's blocks (the reference: the same prefill in this process, in the same format), and a
    decode step over a scattered copy of them gives the same logits as over the blocks the ranks wrote themselves
    (every rank, replicas included, got its heads) and as one process."""
    import subprocess
    import sys

    import numpy as np

    from pyengine.disagg.kv_transfer import KVBlocks
    from pyengine.engine.executor import LocalExecutor
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.gguf import quants
    from pyengine.parallel.launch import mpiexec_command, rank_env
    here = os.path.dirname(__file__)
    sys.path.insert(0, here)
    from mpi_kv_check import RUNNER_KW, TABLE, prefill_and_decode, prompt
    path = model_path(model)
    proc = subprocess.run(mpiexec_command(2, [os.path.join(here, "mpi_kv_check.py"), "--model", path, "--tp", "2",
                                              "--kv-dtype", dtype, "--out", str(tmp_path)]),
                          env=rank_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = np.load(tmp_path / "kv.npz")
    r = ModelRunner(path, kv_cache_dtype=dtype, **RUNNER_KW)
    ref_logits = prefill_and_decode(r, TABLE, prompt(r.config.vocab_size))
    ref = KVBlocks(LocalExecutor(r)).read(TABLE)
    assert got["gathered"].shape == ref.shape and got["gathered"].dtype == ref.dtype
    assert list(got["heads"]) == ([0, 2] if model == "smollm2" else [0, 0])
    np.testing.assert_array_equal(got["logits_b"], got["logits_a"])
    if dtype == "q8_0":                                # compare the values the bytes stand for
        hd = r.config.head_dim
        deq = lambda a: quants.dequantize(np.ascontiguousarray(a).reshape(-1), quants.GGMLType.Q8_0,  # noqa: E731
                                          a.shape[:-1] + (hd,))
        a, b, tol = deq(got["gathered"]), deq(ref), 0.05
    else:
        a, b, tol = got["gathered"].astype(np.float32), ref.astype(np.float32), 2e-3
    scale = np.abs(b).max()
    assert np.abs(a - b).max() <= tol * scale
    assert np.abs(got["logits_a"] - ref_logits).max() <= 1e-2 * np.abs(ref_logits).max()
    assert int(np.argmax(got["logits_a"])) == int(np.argmax(ref_logits))


def test_rank_layout_router_then_each_instances_ranks_together():
    from pyengine.disagg.launch import layout, roles
    from pyengine.server.args import ServerArgs
    insts = layout(2, 1, 2, 3)
    assert [(i.role, i.ranks) for i in insts] == [("prefill", (1, 2)), ("prefill", (3, 4)), ("decode", (5, 6, 7))]
    assert roles(2, 1, 2, 3) == ([1, 3], [5])
    assert roles(1, 2) == ([1], [2, 3])                                   # without TP: 1 + P + D as before
    args = ServerArgs(prefill_tensor_parallel_size=None, decode_tensor_parallel_size=1)   # --tensor-parallel-size 2
    assert args.role_tp(2) == (2, 1)
    with pytest.raises(ValueError, match="tensor-parallel size must be >= 1"):
        layout(1, 1, 0, 1)
