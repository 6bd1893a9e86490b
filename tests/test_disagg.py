"""S18 prefill/decode disaggregation, in one process: the router, a prefill and a decode instance (each its own
engine, model runner and paged KV cache) connected by `LoopbackNet`, the same messages as over MPI.

References: the colocated engine (one LLMEngine, the same configuration) run on the same prompts one at a time,
whose greedy continuations are the HF goldens' (tests/test_engine_real_model.py); token ids, text and logprobs
must be identical, for greedy and for seeded sampling. Accounting: blocks shipped = the prompt's blocks minus the
leading ones the decode side's prefix cache held (counted here from its block manager before the request), bytes
= blocks x block bytes; after aborts mid-prefill, mid-transfer and mid-decode, and after a damaged block or a dead
prefill instance, every instance holds 0 blocks and its bookkeeping checks out."""
import json
import os
from dataclasses import replace
import subprocess
import sys

import numpy as np
import pytest

from pyengine.disagg.decode_worker import DecodeWorker
from pyengine.disagg.kv_transfer import HEADER, LoopbackNet, block_nbytes
from pyengine.disagg.prefill_worker import PrefillWorker, prompt_hashes
from pyengine.disagg.router import RequestFailed, Router
from pyengine.engine.llm_engine import LLMEngine
from pyengine.engine.model_runner import ModelRunner
from pyengine.model_files import default_model_path
from pyengine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "generation_smollm2.json")
# prompts > 64 tokens are chunked, by the token budget alone: S11's chunk budget would size chunks beside decodes
# from measured step times, and the bits of a prompt's last tokens depend on how it was cut (an n > 1 request's
# siblings prefill beside choice 0's decodes): the colocated reference and the instances must cut alike every run
KW = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, target_itl_ms=0)


@pytest.fixture(scope="module")
def runners():
    mk = lambda: ModelRunner(default_model_path(), max_model_len=512, num_blocks=96, block_size=16,  # noqa: E731
                             max_num_batched_tokens=64, max_num_seqs=8)
    return mk(), mk()


@pytest.fixture(scope="module")
def golden_prompts():
    return [c["prompt_ids"] for c in json.load(open(GOLDEN))["cases"]]


class Cluster:
    """Router (rank 0) + prefill (rank 1) + decode (rank 2) on fresh engines over one LoopbackNet."""

    def __init__(self, runners, kw=KW, **router_kw):
        self.net = LoopbackNet(3)
        pre_eng = LLMEngine(runner=runners[0], **kw)
        dec_eng = LLMEngine(runner=runners[1], **kw)
        self.prefill = PrefillWorker(pre_eng, self.net.transport(1))
        self.decode = DecodeWorker(dec_eng, self.net.transport(2))
        self.router = Router(self.net.transport(0), runners[0].tokenizer, runners[0].gguf, [1], [2],
                             max_model_len=512, wait_s=0.0, **router_kw)
        self.prefill.start()
        self.decode.start()
        self.router.wait_ready(10)
        self.final: dict = {}
        self.failed: dict = {}

    def turn(self) -> list:
        for w in (self.prefill, self.decode):
            if w.t.rank not in self.net.dead:
                w.run_once()
        outs = self.router.step()
        for o in outs:
            if isinstance(o, RequestFailed):
                self.failed[o.request_id] = o.exc
            elif o.finished:
                self.final[o.request_id] = o
        return outs

    def run(self, until=None, max_turns=5000):
        for _ in range(max_turns):
            self.turn()
            if until is not None and until():
                return
            if until is None and not self.router.requests and self.quiet():
                return
        raise AssertionError("the cluster did not settle")

    def quiet(self) -> bool:
        return not any(self.net.inbox) and not self.prefill.transfers and not self.decode.adopting

    def settle(self):
        self.run()
        for _ in range(5):                        # the last stats reports
            self.turn()

    def engines(self):
        return self.prefill.engine, self.decode.engine

    def assert_no_blocks(self):
        for eng in self.engines():
            assert eng.num_used_blocks() == 0
            eng.block_manager.check_invariants(live=[])
            assert not eng.requests
        assert self.router.num_used_blocks() == 0 and not self.router.requests


def colocated(runner, prompts, params, choices=False, kw=KW):
    """The reference: one LLMEngine, the same configuration, each prompt alone (its first choice, or with
    ``choices`` all of them)."""
    outs = []
    for i, p in enumerate(prompts):
        eng = LLMEngine(runner=runner, **kw)
        eng.add_request(f"c{i}", p, params)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs.append(o.outputs if choices else o.outputs[0])
    return outs


def disaggregated(runners, prompts, params):
    c = Cluster(runners)
    outs = []
    for i, p in enumerate(prompts):
        c.router.add_request(f"d{i}", p, params)
        c.settle()
        outs.append(c.final[f"d{i}"].outputs[0])
    c.assert_no_blocks()
    return outs, c


def same(a, b):
    assert a.token_ids == b.token_ids
    assert a.text == b.text and a.finish_reason == b.finish_reason
    if a.logprobs is not None:
        assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob


def test_greedy_golden_prompts_identical_to_colocated(runners, golden_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = colocated(runners[0], golden_prompts, params)
    got, c = disaggregated(runners, golden_prompts, params)
    for a, b in zip(got, ref):
        same(a, b)
    gold = [g["greedy_ids"][:12] for g in json.load(open(GOLDEN))["cases"]]
    assert sum(r.token_ids == g for r, g in zip(ref, gold)) >= len(gold) - 1     # the reference is HF's greedy
    # every prompt went through a transfer, every block shipped or found in the decode side's prefix cache
    bs = runners[0].block_size
    total = sum(-(-len(p) // bs) for p in golden_prompts)
    assert c.router.totals["blocks_sent"] + c.router.totals["blocks_cached"] == total
    assert c.router.totals["transfers"] == len(golden_prompts)


def test_seeded_sampling_identical_to_colocated(runners, golden_prompts):
    prompts = golden_prompts[:4]
    for seed in (1, 7):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=10, logprobs=1, stop=["\n\n"])
        ref = colocated(runners[0], prompts, params)
        got, _ = disaggregated(runners, prompts, params)
        for a, b in zip(got, ref):
            same(a, b)


def test_only_blocks_missing_on_the_decode_side_are_shipped(runners):
    rng = np.random.default_rng(3)
    base = rng.integers(1000, 20000, 100).tolist()             # 6 full blocks + 4 tokens
    c = Cluster(runners)
    bs = runners[0].block_size
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    sent_before = 0
    for i, prompt in enumerate([base, base[:80] + [7, 8, 9], base + [5] * 40, base]):
        dec_bm = c.decode.engine.block_manager
        hashes = prompt_hashes(prompt, bs)
        cached = 0
        for h in hashes[:(len(prompt) - 1) // bs]:              # what its prefix cache holds, leading blocks only
            if h not in dec_bm.cached:
                break
            cached += 1
        c.router.add_request(f"r{i}", prompt, params)
        c.settle()
        sent = c.prefill.counters["blocks"] - sent_before
        sent_before = c.prefill.counters["blocks"]
        assert sent == -(-len(prompt) // bs) - cached
        assert c.decode.counters["blocks"] == c.prefill.counters["blocks"]
        if i:
            assert cached > 0                                   # later prompts share a prefix with earlier ones
    assert c.decode.counters["bytes"] == c.prefill.counters["bytes"] == \
        c.prefill.counters["blocks"] * (HEADER.size + block_nbytes(runners[1].kv_cache))
    assert c.router.totals["blocks_sent"] == c.prefill.counters["blocks"]
    c.assert_no_blocks()


def long_prompt(n=200, seed=5):
    return np.random.default_rng(seed).integers(1000, 20000, n).tolist()


def test_aborts_mid_prefill_mid_transfer_mid_decode_leave_no_blocks(runners):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    c = Cluster(runners)
    c.decode.blocks_per_poll = 2                                # a 13-block transfer takes several turns
    # mid-prefill: 200 tokens take 4 chunked steps of 64
    c.router.add_request("a", long_prompt(), params)
    c.run(until=lambda: c.prefill.engine.counters["steps"] >= 2)
    assert c.prefill.engine.num_used_blocks() > 0 and "a" not in c.final
    c.router.abort_request("a")
    c.settle()
    c.assert_no_blocks()
    # mid-transfer: some blocks adopted, not all
    c.router.add_request("b", long_prompt(seed=6), params)
    c.run(until=lambda: any(ad.received >= 2 for ad in c.decode.adopting.values()))
    assert c.decode.engine.num_used_blocks() > 0
    c.router.abort_request("b")
    c.settle()
    c.assert_no_blocks()
    # mid-decode: tokens are streaming from the decode instance
    c.router.add_request("d", long_prompt(seed=7), params)
    c.run(until=lambda: c.decode.engine.counters["generation_tokens"] >= 5)
    c.router.abort_request("d")
    c.settle()
    c.assert_no_blocks()
    assert not c.final and not c.failed


def test_damaged_block_fails_the_request_cleanly(runners, monkeypatch):
    c = Cluster(runners)
    real = c.prefill.t.send_buffer

    def corrupt(dest, buf):
        if bytes(buf[:1]) == b"B":
            buf = buf.copy()
            buf[-1] ^= 0x40                                    # one bit of the last V value
        real(dest, buf)
    monkeypatch.setattr(c.prefill.t, "send_buffer", corrupt)
    c.router.add_request("x", long_prompt(), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    c.settle()
    assert "checksum" in str(c.failed["x"])
    assert c.decode.counters["transfer_failures"] == 1
    c.assert_no_blocks()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_dead_prefill_fails_its_requests_while_decode_keeps_serving(runners):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    c = Cluster(runners)
    c.router.add_request("running", long_prompt(40), params)
    c.run(until=lambda: c.decode.engine.counters["generation_tokens"] >= 3)
    c.router.add_request("victim", long_prompt(), params)
    c.run(until=lambda: c.prefill.engine.counters["steps"] >= 2)
    c.net.dead.add(1)                                          # the prefill rank stops taking part ...
    c.router.instances[1].info["pid"] = dead_pid()             # ... and its process is gone
    c.router._checked = 0.0
    c.run(until=lambda: "victim" in c.failed)
    assert "prefill instance rank 1" in str(c.failed["victim"]) and type(c.failed["victim"]).__name__ == "ParallelError"
    c.router.add_request("after", long_prompt(30, seed=9), params)   # no prefill left: the decode side prefills
    c.run(until=lambda: "running" in c.final and "after" in c.final)
    assert len(c.final["running"].outputs[0].token_ids) == 30 and len(c.final["after"].outputs[0].token_ids) == 30
    assert c.router.failure() is None                          # still serving
    c.settle()
    dec = c.decode.engine
    assert dec.num_used_blocks() == 0 and not dec.requests
    dec.block_manager.check_invariants(live=[])
    ref = colocated(runners[0], [long_prompt(30, seed=9)], params)[0]
    assert c.final["after"].outputs[0].token_ids == ref.token_ids


def test_router_refuses_what_an_engine_would(runners):
    c = Cluster(runners)
    with pytest.raises(ValueError, match="max_model_len"):
        c.router.add_request("big", [5] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="out of range"):
        c.router.add_request("vocab", [10 ** 7], SamplingParams(max_tokens=2))
    assert not c.router.requests and not any(c.net.inbox)


def test_step_trace_accounts_for_every_decode_token_and_adopted_block(runners, monkeypatch, tmp_path):
    """PYENGINE_STEP_TRACE: the decode rank's records name, for each request, one step per token it decoded
    (the reference: the request's own output length, minus the first token, which the prefill side sampled),
    and their adopted blocks add up to the blocks the transfer counters say were shipped."""
    from pyengine.disagg.step_trace import read
    monkeypatch.setenv("PYENGINE_STEP_TRACE", str(tmp_path))
    c = Cluster(runners)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = {"s": long_prompt(40, seed=11), "l": long_prompt(150, seed=12)}
    c.router.add_request("s", prompts["s"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    c.run(until=lambda: c.decode.engine.counters["generation_tokens"] >= 2)
    c.router.add_request("l", prompts["l"], params)
    c.settle()
    for w in (c.prefill, c.decode, c.router):
        w.trace.close()
    steps = read(str(tmp_path / "rank2-decode.jsonl"))
    assert sorted(os.listdir(tmp_path)) == ["rank0-router.jsonl", "rank1-prefill.jsonl", "rank2-decode.jsonl"]
    for rid in prompts:
        mine = [s for s in steps if rid in s["rids"]]
        assert len(mine) == len(c.final[rid].outputs[0].token_ids) - 1
        assert all(s["ctx"] >= len(prompts[rid]) + 1 for s in mine)     # the batch held this context
    assert sum(s["adopt_blocks"] for s in steps) == c.decode.counters["blocks"] == c.prefill.counters["blocks"]
    assert all(s["t0"] <= s["t1"] and s["cpu"] >= 0 and s["adopt_s"] >= 0 and s["gc_s"] >= 0 for s in steps)
    assert all(a["t1"] <= b["t0"] for a, b in zip(steps, steps[1:]))     # one line per step, in order
    pre = read(str(tmp_path / "rank1-prefill.jsonl"))
    assert sum(s["rids"].count(rid) for s in pre for rid in prompts) == 2   # each first token: one prefill step
    # the router saw every output message of both instances once, after the step that made it, in order
    routed = read(str(tmp_path / "rank0-router.jsonl"))
    made = {(rid, s["t1"]) for s in steps + pre for rid in s["rids"] if rid in prompts}
    assert {(rid, m["t_step"]) for m in routed for rid in m["rids"]} == made
    assert sum(len(m["rids"]) for m in routed) == len(made)
    assert all(m["t_step"] <= m["t_recv"] <= m["t_out"] for m in routed)


def test_bench_joins_client_arrivals_with_the_decode_steps():
    """bench/disagg.py's join, on arrivals and steps whose gaps are known: the client's gap, the rank's
    step-to-step time and the delivery come out as constructed, a gap ending while a long sequence decodes is
    counted 'with', and a request whose chunks do not match its steps is skipped."""
    from pyengine.bench.disagg import join_trace, slow_gap_causes, split_itls
    from pyengine.bench.serve import Result
    def step(t0, t1, rids, ctx, adopt=0.0):
        return {"t0": t0, "t1": t1, "cpu": t1 - t0, "rids": rids, "ctx": ctx, "adopt_s": adopt, "gc_s": 0.0,
                "loop_s": 0.0}
    steps = [step(1.00, 1.05, ["a-0"], 70), step(1.05, 1.10, ["a-0"], 71),
             step(1.12, 1.20, ["a-0", "L-0"], 3000, adopt=0.02), step(1.20, 1.25, ["a-0", "L-0"], 3001)]
    short = Result(ok=True, id="a", arrivals=[0.9, 1.051, 1.102, 1.203, 1.254])
    long_ = Result(ok=True, id="L", arrivals=[1.0, 1.201, 1.252])
    stray = Result(ok=True, id="b", arrivals=[1.0, 1.1, 1.2])               # no steps of its own: skipped
    gaps, skipped = join_trace([short, long_, stray], ["short", "long", "short"], steps, long_len=2048)
    assert skipped == 1 and len(gaps) == 3
    assert [round(g["client"], 3) for g in gaps] == [0.051, 0.101, 0.051]
    assert [round(g["engine"], 3) for g in gaps] == [0.05, 0.10, 0.05]
    assert [round(g["delivery"], 3) for g in gaps] == [0.002, 0.003, 0.004]
    assert [g["long"] for g in gaps] == [False, True, True]
    routed = [{"t_step": 1.10, "t_recv": 1.1005, "t_out": 1.1012, "rids": ["a-0"]}]     # the router's trace
    split = join_trace([short], ["short"], steps, long_len=2048, router=routed)[0]
    assert "router" not in split[1] and round(split[0]["router"], 4) == 0.0012 and round(split[0]["http"], 4) == 0.0008
    without, with_long, first = split_itls([short, long_], ["short", "long"])
    assert [round(x, 3) for x in first] == [0.151]                    # its hand-off: prefill token -> decode token
    assert [round(x, 3) for x in without] == [0.051] and [round(x, 3) for x in with_long] == [0.101, 0.051]
    slow = [{"client": 0.05, "wall": 0.05, "cpu": 0.05, "adopt": 0.0, "gc": 0.0, "loop": 0.0, "delivery": 0.002}] * 8
    slow += [{"client": 0.09, "wall": 0.05, "cpu": 0.05, "adopt": 0.04, "gc": 0.0, "loop": 0.0, "delivery": 0.002},
             {"client": 0.09, "wall": 0.09, "cpu": 0.05, "adopt": 0.0, "gc": 0.0, "loop": 0.0, "delivery": 0.002},
             {"client": 0.09, "wall": 0.05, "cpu": 0.05, "adopt": 0.0, "gc": 0.0, "loop": 0.0, "delivery": 0.042}]
    assert slow_gap_causes(slow) == {"adoption": 1, "step wall, core taken": 1, "delivery": 1}


def test_a_decode_step_reaches_the_router_as_one_message(runners, monkeypatch):
    """Router delivery batching: every decode step sends its outputs in one message (so the router hands a step's
    tokens to their streams together), one entry per request that got a token; the streams stay exact."""
    c = Cluster(runners)
    sent = []
    real = c.decode.t.send

    def spy(dest, msg):
        if dest == 0 and msg["op"] in ("out", "outs"):
            sent.append((c.decode.engine.counters["steps"], msg))
        real(dest, msg)
    monkeypatch.setattr(c.decode.t, "send", spy)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [long_prompt(30, seed=21), long_prompt(45, seed=22)]
    for i, p in enumerate(prompts):
        c.router.add_request(f"b{i}", p, params)
    c.settle()
    steps = [s for s, _ in sent]
    assert all(m["op"] == "outs" for _, m in sent) and len(steps) == len(set(steps))    # one message a step
    assert any(len({x for x, _ in m["outs"]}) == 2 for _, m in sent)                  # both in one step's message
    assert sum(len(m["outs"]) for _, m in sent) == 2 * (8 - 1)                          # every decoded token once
    ref = colocated(runners[0], prompts, params)
    assert [c.final[f"b{i}"].outputs[0].token_ids for i in range(2)] == [r.token_ids for r in ref]


def test_a_prefill_rank_waiting_on_a_full_window_does_not_spin(runners, monkeypatch):
    """While every block of its transfer's window is still in flight (MPI has not completed the sends: the decode
    side takes blocks between its steps), a prefill turn does nothing and says so, so that its loop sleeps; once
    the sends complete it moves blocks again and the request finishes exactly."""
    from pyengine.tuning import TRANSFER_WINDOW as WINDOW
    c = Cluster(runners)
    in_flight = {"n": WINDOW}                                    # the window is full (loopback sends never are)
    monkeypatch.setattr(c.prefill.t, "pending", lambda dest=None: in_flight["n"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    c.router.add_request("w", long_prompt(200, seed=31), params)
    c.run(until=lambda: any(tr.next is not None for tr in c.prefill.transfers.values()))   # "have" arrived
    tr = next(iter(c.prefill.transfers.values()))
    assert c.prefill.work() is False and tr.sent == 0
    assert c.prefill.run_once() is False and tr.sent == 0       # nothing to do: Instance.run sleeps
    in_flight["n"] = 0                                           # the sends completed
    c.settle()
    assert c.final["w"].outputs[0].token_ids == colocated(runners[0], [long_prompt(200, seed=31)], params)[0].token_ids
    c.assert_no_blocks()


# --- n > 1: several choices of one prompt --------------------------------------------------------------------------
def choices_of(c, rid):
    return sorted(c.final[rid].outputs, key=lambda o: o.index)


def test_n_choices_identical_to_colocated_greedy_and_seeded(runners, golden_prompts):
    """n = 3 through the router: every choice (tokens, text, finish reason, logprobs) equals the colocated
    engine's choice of that index, greedy and seeded; the prompt's full blocks move once, each further choice
    sends only its last block (on a fresh decode instance: nothing else is cached there), and both instances end
    with no block in use."""
    bs = runners[0].block_size
    prompts = golden_prompts[:2] + [long_prompt(100, seed=41), long_prompt(64, seed=42)]   # 64: a full last block
    cases = [SamplingParams(temperature=0.0, n=3, max_tokens=10, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0.9, top_p=0.95, n=3, seed=7, max_tokens=10, logprobs=1, stop=["\n\n"])]
    distinct = 0
    for params in cases:
        refs = colocated(runners[0], prompts, params, choices=True)
        for p, ref in zip(prompts, refs):
            c = Cluster(runners)
            c.router.add_request("d", p, params)
            c.settle()
            got = choices_of(c, "d")
            assert [o.index for o in got] == [0, 1, 2] and c.final["d"].prompt_token_ids == p
            for a, b in zip(got, ref):
                same(a, b)
            if params.seed is not None:
                distinct += len({tuple(o.token_ids) for o in ref}) == 3
            blocks, shared = -(-len(p) // bs), (len(p) - 1) // bs
            t = c.router.totals
            assert t["transfers"] == 3 and t["blocks_cached"] == 2 * shared
            assert t["blocks_sent"] == blocks + 2 * (blocks - shared) == c.prefill.counters["blocks"]
            assert c.decode.counters["blocks"] == t["blocks_sent"]
            c.assert_no_blocks()
    assert distinct >= 2                                 # seeded: the choices are different streams


def test_n_choices_without_prefix_caching(runners, golden_prompts):
    """With prefix caching off each choice computes and ships its whole prompt (the decode side caches nothing:
    "have 0"); prompts whose n copies the colocated engine prefills in one step come out identical to it."""
    kw = dict(KW, enable_prefix_caching=False)
    bs = runners[0].block_size
    params = SamplingParams(temperature=0.9, n=3, seed=5, max_tokens=8, logprobs=1)
    short = [p for p in golden_prompts if 3 * len(p) <= KW["max_num_batched_tokens"]][:2]
    assert len(short) == 2
    for p, ref in zip(short, colocated(runners[0], short, params, choices=True, kw=kw)):
        c = Cluster(runners, kw=kw)
        c.router.add_request("d", p, params)
        c.settle()
        for a, b in zip(choices_of(c, "d"), ref):
            same(a, b)
        assert c.router.totals["blocks_sent"] == 3 * -(-len(p) // bs) and c.router.totals["blocks_cached"] == 0
        c.assert_no_blocks()
    c = Cluster(runners, kw=kw)
    c.router.add_request("l", long_prompt(100, seed=44), replace(params, ignore_eos=True))
    c.settle()
    assert [len(o.token_ids) for o in choices_of(c, "l")] == [8, 8, 8]
    assert c.router.totals["blocks_sent"] == 3 * 7 and c.router.totals["blocks_cached"] == 0
    c.assert_no_blocks()


def test_n_choices_with_some_ending_at_their_first_token(runners):
    """A choice whose first token stops it (here: a stop token id equal to that choice's first token) sends no
    blocks, only that token; the request still ends with every choice equal to the colocated engine's, whether
    the choice that ended early is a later one or choice 0 (whose blocks the others read on the prefill side)."""
    p = long_prompt(40, seed=43)
    base = SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=6)
    firsts = [o.token_ids[0] for o in colocated(runners[0], [p], base, choices=True)[0]]
    assert len(set(firsts)) == 3                          # the seed gives three different first tokens
    bs = runners[0].block_size
    for stop in ([firsts[1]], [firsts[0]], [firsts[0], firsts[2]]):
        params = SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=6, stop_token_ids=stop, logprobs=0)
        ref = colocated(runners[0], [p], params, choices=True)[0]
        assert sum(len(o.token_ids) == 1 for o in ref) == len(stop)
        c = Cluster(runners)
        c.router.add_request("d", p, params)
        c.settle()
        for a, b in zip(choices_of(c, "d"), ref):
            same(a, b)
        shipped = 3 - len(stop)                           # the choices still running after their first token
        assert c.router.totals["transfers"] == shipped
        assert c.router.totals["blocks_sent"] == -(-len(p) // bs) + (shipped - 1)
        c.assert_no_blocks()


def test_n_choices_aborts_mid_prefill_mid_transfer_mid_decode_leave_no_blocks(runners):
    """Aborts of an n = 3 request at every stage: while its prompt is prefilled, while choice 0's blocks or a later
    choice's block are moving, while choice 0 decodes and the others are still on the prefill side, and once all
    three decode; each leaves zero blocks in use on both instances."""
    params = SamplingParams(temperature=0.0, n=3, max_tokens=40, ignore_eos=True)
    c = Cluster(runners)
    c.decode.blocks_per_poll = 2                                # a 13-block transfer takes several turns
    stages = {
        "prefill": lambda: c.prefill.engine.counters["steps"] >= 2,
        "transfer of choice 0": lambda: any(ad.received >= 2 for ad in c.decode.adopting.values()),
        "transfer of choice 1": lambda: any(ad.index == 1 for ad in c.decode.adopting.values()),
        "choice 0 decoding alone": lambda: c.decode.engine.counters["generation_tokens"] >= 2 and
                                           c.prefill.engine.requests,
        "all decoding": lambda: c.decode.engine.counters["generation_tokens"] >= 3 * 5,
    }
    for k, (stage, until) in enumerate(stages.items()):
        for eng in c.engines():
            eng.counters["generation_tokens"] = eng.counters["steps"] = 0
        c.router.add_request(f"a{k}", long_prompt(200, seed=50 + k), params)
        c.run(until=until)
        assert sum(e.num_used_blocks() for e in c.engines()) > 0, stage
        c.router.abort_request(f"a{k}")
        c.settle()
        c.assert_no_blocks()
    assert not c.final and not c.failed


def test_n_choices_dead_prefill_fails_a_request_not_wholly_adopted(runners):
    """A prefill instance lost after choice 0 is adopted but before the others are: the request fails (its other
    choices' first tokens and K/V are gone with it) and the decode instance frees choice 0's blocks; a request
    whose choices are all adopted keeps decoding to its end."""
    params = SamplingParams(temperature=0.0, n=2, max_tokens=30, ignore_eos=True)
    c = Cluster(runners)
    c.router.add_request("whole", long_prompt(40, seed=60), params)
    c.run(until=lambda: c.router.requests["whole"].stage == "decode")
    c.router.add_request("half", long_prompt(120, seed=61), params)
    c.run(until=lambda: "half" in c.decode.engine.requests and c.decode.engine.requests["half"].seqs[0].status.value
          == "running")
    assert c.router.requests["half"].stage == "transfer"
    c.net.dead.add(1)
    c.router.instances[1].info["pid"] = dead_pid()
    c.router._checked = 0.0
    c.run(until=lambda: "half" in c.failed and "whole" in c.final)
    assert type(c.failed["half"]).__name__ == "ParallelError"
    ref = colocated(runners[0], [long_prompt(40, seed=60)], params, choices=True)[0]
    assert [o.token_ids for o in choices_of(c, "whole")] == [o.token_ids for o in ref]
    c.run(until=lambda: not c.router.requests and not c.decode.adopting and not c.decode.engine.requests)
    dec = c.decode.engine
    assert dec.num_used_blocks() == 0 and not dec.requests
    dec.block_manager.check_invariants(live=[])


def test_add_and_commit_prefilled_refuse_what_they_cannot_adopt(runners):
    """The decode-side hooks for n > 1 refuse clearly and lose nothing: a sequence index the request does not
    have, a sequence adopted twice, the same request with another prompt, and a commit without blocks whose token
    does not end the sequence (the request is then aborted: no block stays in use)."""
    eng = LLMEngine(runner=runners[1], **KW)
    p, params = long_prompt(40, seed=70), SamplingParams(temperature=0.0, n=2, max_tokens=5, ignore_eos=True)
    seq = eng.add_prefilled("r", p, params, index=0)
    assert len(seq.block_table) == 3 and not eng.scheduler.waiting and not eng.scheduler.running
    with pytest.raises(ValueError, match="no sequence 2"):
        eng.add_prefilled("r", p, params, index=2)
    with pytest.raises(ValueError, match="adopted already"):
        eng.add_prefilled("r", p, params, index=0)
    with pytest.raises(ValueError, match="another prompt"):
        eng.add_prefilled("r", p[:-1], params, index=1)
    assert eng.num_used_blocks() == 3
    with pytest.raises(RuntimeError, match="without its KV blocks"):
        eng.commit_prefilled("r", 1234, index=1)
    assert eng.num_used_blocks() == 0 and not eng.requests
    eng.block_manager.check_invariants(live=[])


def test_n_choices_of_concurrent_requests_and_a_decode_side_short_of_slots(runners):
    """Requests with n = 3, n = 2 and n = 1 at once (their transfers interleave; each request's sequences still go
    in turn), then n = 3 on instances with 2 sequence slots (the third choice's offer waits until a slot frees):
    every choice's tokens are the colocated engine's, every sequence moved once, no block is left in use."""
    params = {"a": SamplingParams(temperature=0.0, n=3, max_tokens=8, ignore_eos=True),
              "b": SamplingParams(temperature=0.8, n=2, seed=9, max_tokens=8, ignore_eos=True),
              "c": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)}
    prompts = {"a": long_prompt(70, seed=80), "b": long_prompt(35, seed=81), "c": long_prompt(50, seed=82)}
    refs = {rid: colocated(runners[0], [prompts[rid]], params[rid], choices=True)[0] for rid in params}
    c = Cluster(runners)                                      # (after the references: they reuse its runners)
    for rid in params:
        c.router.add_request(rid, prompts[rid], params[rid])
    c.settle()
    for rid in params:
        assert [o.token_ids for o in choices_of(c, rid)] == [o.token_ids for o in refs[rid]]
    assert c.router.totals["transfers"] == 3 + 2 + 1
    c.assert_no_blocks()
    # the same n = 3 prompt again: the decode side's prefix cache still holds its full blocks, for every choice
    bs, sent = runners[0].block_size, c.router.totals["blocks_sent"]
    dec_bm = c.decode.engine.block_manager
    assert all(h in dec_bm.cached for h in prompt_hashes(prompts["a"], bs))
    c.router.add_request("a2", prompts["a"], params["a"])
    c.settle()
    assert [o.token_ids for o in choices_of(c, "a2")] == [o.token_ids for o in refs["a"]]
    assert c.router.totals["blocks_sent"] - sent == 3 * (-(-70 // bs) - 69 // bs)   # each choice's last block
    c.assert_no_blocks()
    kw = dict(KW, max_num_seqs=2)
    p = long_prompt(60, seed=83)
    ref = colocated(runners[0], [p], params["a"], choices=True, kw=kw)[0]
    c = Cluster(runners, kw=kw)
    c.router.add_request("s", p, params["a"])
    c.run(until=lambda: len(c.decode.offers) == 1 and len(c.decode.engine.scheduler.running) == 2)
    c.settle()
    assert [o.token_ids for o in choices_of(c, "s")] == [o.token_ids for o in ref]
    assert c.router.totals["transfers"] == 3
    c.assert_no_blocks()


def test_n_choices_under_a_grammar(runners):
    """Structured outputs with n = 3: each choice's grammar matcher advances by its own first token on the decode
    side (commit_prefilled), so every choice is the colocated engine's and a full match of the regex (Python's
    `re`, the independent reference)."""
    import re
    from pyengine.sampling_params import StructuredOutputsParams
    rx = r"(\+33|0)[1-9]( [0-9]{2}){4}"
    p = runners[0].tokenizer.encode("Write a phone number: ", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex=rx))
    ref = colocated(runners[0], [p], params, choices=True)[0]
    c = Cluster(runners)
    c.router.add_request("s", p, params)
    c.settle()
    got = choices_of(c, "s")
    assert [o.token_ids for o in got] == [o.token_ids for o in ref] and len({o.text for o in got}) == 3
    assert all(re.fullmatch(rx, o.text) for o in got)
    c.assert_no_blocks()


def test_instances_take_the_routers_automaton_instead_of_compiling(runners, monkeypatch):
    """Issue 27 in S18: the router (whose server compiled the grammar in its worker) sends the automaton with
    the request; the instances install it and never compile on their step loops. Here the three share one
    process, so the compile caches are emptied after the router's check and compiling is made to fail: the
    request still finishes, with the colocated engine's tokens."""
    import re
    from pyengine.sampling_params import StructuredOutputsParams
    from pyengine.structured import matcher
    rx = r"[a-z]{3}-[0-9]{4}"
    p = runners[0].tokenizer.encode("A code: ", add_special_tokens=False)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(regex=rx))
    ref = colocated(runners[0], [p], params)[0]
    c = Cluster(runners)
    sent, send = [], c.router.t.send
    monkeypatch.setattr(c.router.t, "send", lambda rank, msg: (sent.append((rank, msg["op"])), send(rank, msg)))
    c.router.add_request("g", p, params)
    matcher._cache.clear()
    matcher._refusals.clear()

    def no_compiling(kind, spec):
        raise AssertionError("an instance compiled the grammar on its step loop")
    monkeypatch.setattr(matcher, "grammar_rules", no_compiling)
    c.settle()
    c.router.add_request("g2", p, params)        # the same grammar again: not sent again
    c.settle()
    assert not c.failed, c.failed
    for rid in ("g", "g2"):
        got = c.final[rid].outputs[0]
        assert got.token_ids == ref.token_ids and re.fullmatch(rx, got.text)
    ops = [m for m in sent if m[1] in ("grammar", "prefill")]
    assert ops == [(1, "grammar"), (2, "grammar"), (1, "prefill"), (1, "prefill")]   # prefill rank 1, decode 2
    c.assert_no_blocks()


def test_six_choices_identical_to_colocated(runners):
    """n = 6: the colocated engine's steps carry 18-23 rows (5 decodes beside a 16-token tail), where a row's
    bits once depended on the batch (a product of 21+ rows through the 1536-input down projection left the
    small kernel); every choice, logprobs too, equals the colocated engine's."""
    params = SamplingParams(temperature=0.8, n=6, seed=11, max_tokens=12, logprobs=1)
    p = long_prompt(100, seed=43)
    (ref,) = colocated(runners[0], [p], params, choices=True)
    c = Cluster(runners)
    c.router.add_request("d", p, params)
    c.settle()
    got = choices_of(c, "d")
    assert [o.index for o in got] == list(range(6))
    for a, b in zip(got, ref):
        same(a, b)
    c.assert_no_blocks()
