"""S09-S11 LLMEngine over a fake model runner whose logits depend on the whole context read back through
the block tables: batching, paging, prefix caching, chunking and preemption must not change any output.
The reference is `reference_greedy`, which runs the same logits function with no engine at all."""
import random

import numpy as np
import pytest

from engine_fakes import EOS, FakeTokenizer, StepClock, context_logits, make_engine, reference_greedy, run_all
from pyengine.engine.llm_engine import EngineOverloaded
from pyengine.sampling_params import SamplingParams


def prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(1, 48) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def check_against_reference(final, ps, max_tokens=24):
    for i, p in enumerate(ps):
        out = final[f"r{i}"].outputs[0]
        ref = reference_greedy(p, max_tokens)
        assert out.token_ids == ref, f"request {i}"
        assert out.finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert out.text == FakeTokenizer().decode(ref, skip_special_tokens=True)


def add_all(engine, ps, params=None, **kw):
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params or greedy(), **kw)


def invariants(engine):
    live = [s for s in engine.scheduler.running]
    engine.block_manager.check_invariants(live)
    for s in engine.scheduler.waiting + engine.scheduler.preempted:
        assert not s.block_table


def test_single_request_matches_reference_and_streams_text():
    eng = make_engine()
    eng.add_request("r0", "hello", greedy(30))
    final = run_all(eng, check=invariants)
    ids = FakeTokenizer().encode("hello")
    assert final["r0"].prompt == "hello" and final["r0"].prompt_token_ids == ids
    check_against_reference(final, [ids], 30)
    assert eng.num_used_blocks() == 0 and not eng.has_unfinished_requests()


def test_concurrent_requests_equal_each_run_alone():
    ps = prompts(16, seed=1)
    eng = make_engine(num_blocks=256, max_num_seqs=16, max_num_batched_tokens=1024)
    add_all(eng, ps)
    final = run_all(eng, check=invariants)
    check_against_reference(final, ps)
    assert max(len(q) for q, _ in eng.runner.batches) == 16     # really batched
    assert eng.num_used_blocks() == 0


def test_preemption_and_tight_limits_do_not_change_outputs():
    ps = prompts(12, seed=2, lo=10, hi=30)
    # 24 blocks of 4 = 96 token slots for 12 requests of up to 29 + 24 tokens: constant preemption.
    eng = make_engine(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=32)
    add_all(eng, ps)
    final = run_all(eng, check=invariants)
    check_against_reference(final, ps)
    st = eng.stats()
    assert st["num_preemptions"] > 0
    assert any(o.metrics.num_preemptions for o in final.values())
    assert max(sum(q) for q, _ in eng.runner.batches) <= 32
    assert max(len(q) for q, _ in eng.runner.batches) <= 6
    assert eng.num_used_blocks() == 0


def test_chunked_prefill_equals_unchunked_and_mixes_with_decodes():
    ps = [list(range(1, 47)) * 2] + prompts(4, seed=3, lo=3, hi=8)    # one 92-token prompt + short ones
    finals = {}
    for chunked in (False, True):
        eng = make_engine(num_blocks=128, max_num_batched_tokens=100 if not chunked else 16,
                          enable_chunked_prefill=chunked, enable_prefix_caching=False)
        for i, p in enumerate(ps[1:], 1):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, greedy())
        for _ in range(3):
            eng.step()                                                 # short requests start decoding
        eng.add_request("r0", {"prompt_token_ids": ps[0]}, greedy())
        long_tables = []

        def check(engine):
            invariants(engine)
            req = engine.requests.get("r0")
            if req is not None and req.seqs[0].block_table:
                long_tables.append(list(req.seqs[0].block_table))
        finals[chunked] = run_all(eng, check=check)
        # the allocator keeps the chunked prompt's blocks consecutive while the decodes grow (zero-copy reads)
        prefill_tables = [t for t in long_tables if len(t) * 4 <= len(ps[0])]
        assert prefill_tables and all(t == list(range(t[0], t[0] + len(t))) for t in prefill_tables)
        batches = eng.runner.batches
        if chunked:
            assert max(sum(q) for q, _ in batches) <= 16
            # the long prompt is spread over several steps that also carry the decodes (1-token queries)
            mixed = [q for q, _ in batches if max(q) > 1 and q.count(1) >= 1]
            assert len(mixed) >= 5
        else:
            assert any(92 in q for q, _ in batches)
    for i in range(len(ps)):
        assert finals[True][f"r{i}"].outputs[0].token_ids == finals[False][f"r{i}"].outputs[0].token_ids
    check_against_reference(finals[True], ps)


@pytest.mark.parametrize("target_itl_ms", [None, 30.0, 10.0])
def test_itl_targeted_chunks_keep_outputs(target_itl_ms):
    """S11: chunks sized each step from a target ITL (fake clock: a step's time follows its batch) give the
    same greedy tokens as unchunked prefill and the engine-free reference: a derived target, a fixed one, and
    one below the decodes' own cost (minimum chunks)."""
    ps = [list(range(1, 47)) * 3] + prompts(4, seed=5, lo=3, hi=8)    # one 138-token prompt + short ones
    finals = {}
    for chunked in (False, True):
        eng = make_engine(num_blocks=160, max_num_batched_tokens=160, enable_chunked_prefill=chunked,
                          enable_prefix_caching=False, target_itl_ms=target_itl_ms, max_model_len=256)
        StepClock(eng)
        for i, p in enumerate(ps[1:], 1):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(40))
        for _ in range(3):
            eng.step()
        eng.add_request("r0", {"prompt_token_ids": ps[0]}, greedy(40))
        finals[chunked] = run_all(eng, check=invariants)
        if chunked:
            long_chunks = [max(q) for q, c in eng.runner.batches if max(q) > 1 and q.count(1) >= 1]
            assert len(long_chunks) >= 3 and len(set(long_chunks)) >= 2, long_chunks   # really varied chunks
            assert eng.stats()["target_itl_ms"] > 0
    for i in range(len(ps)):
        assert finals[True][f"r{i}"].outputs[0].token_ids == finals[False][f"r{i}"].outputs[0].token_ids
    check_against_reference(finals[True], ps, max_tokens=40)


def test_unchunked_prompt_longer_than_budget_is_rejected():
    eng = make_engine(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        eng.add_request("r", {"prompt_token_ids": [1] * 17}, greedy(4))


def test_prefix_cache_hits_skip_work_and_keep_outputs():
    system = list(range(1, 41))                                       # 40 tokens = 10 full blocks
    ps = [system + p for p in prompts(6, seed=4, lo=2, hi=6)]
    results = {}
    for caching in (False, True):
        eng = make_engine(num_blocks=128, enable_prefix_caching=caching)
        eng.add_request("r0", {"prompt_token_ids": ps[0]}, greedy())
        first = run_all(eng)
        for i, p in enumerate(ps[1:], 1):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, greedy())
        rest = run_all(eng, check=invariants)
        results[caching] = ({**first, **rest}, eng.runner.tokens_computed, eng.stats())
    assert {k: v.outputs[0].token_ids for k, v in results[True][0].items()} == \
        {k: v.outputs[0].token_ids for k, v in results[False][0].items()}
    check_against_reference(results[True][0], ps)
    final, computed, st = results[True]
    assert computed <= results[False][1] - 5 * 40                      # 5 later requests skipped the system prompt
    assert all(final[f"r{i}"].metrics.num_cached_tokens == 40 for i in range(1, 6))
    assert final["r0"].metrics.num_cached_tokens == 0
    assert st["prefix_cache_hits"] >= 50 and 0 < st["prefix_cache_hit_rate"] < 1
    assert results[False][2]["prefix_cache_hits"] == 0


def test_preempted_sequence_recomputes_from_prefix_cache():
    # Preemption frees blocks, but full computed blocks stay cached: re-admission hits them.
    ps = prompts(8, seed=5, lo=17, hi=30)
    eng = make_engine(num_blocks=22, max_num_seqs=8, max_num_batched_tokens=64)
    add_all(eng, ps)
    final = run_all(eng, check=invariants)
    check_against_reference(final, ps)
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0


def test_n_greater_than_one_shares_prompt_blocks():
    p = list(range(5, 30))                                             # 25 tokens: 6 full blocks
    eng = make_engine(num_blocks=64)
    eng.add_request("g", {"prompt_token_ids": p}, greedy(12, n=3))
    final = run_all(eng, check=invariants)
    outs = final["g"].outputs
    assert [c.index for c in outs] == [0, 1, 2]
    ref = reference_greedy(p, 12)
    assert all(c.token_ids == ref for c in outs)
    assert eng.stats()["prefix_cache_hits"] == 2 * 6                   # siblings reused the prompt's blocks


def test_seeded_sampling_n_completions_match_direct_sampling():
    from pyengine.layers.sampler import make_rng, sample_row
    p = list(range(3, 12))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=15, n=3)
    eng = make_engine(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8)   # tight: preemptions
    eng.add_request("s", {"prompt_token_ids": p}, params)
    eng.add_request("other", {"prompt_token_ids": list(range(20, 40))}, greedy(20))
    final = run_all(eng, check=invariants)
    for c in final["s"].outputs:
        rng = make_rng(params, None, c.index)
        ctx, ref = list(p), []
        while len(ref) < 15:
            t = sample_row(context_logits(ctx), params, rng, p, ref)
            ref.append(t)
            ctx.append(t)
            if t == EOS:
                break
        assert c.token_ids == ref
    assert len({tuple(c.token_ids) for c in final["s"].outputs}) > 1


def test_random_aborts_never_leak_blocks():
    rng = random.Random(99)
    eng = make_engine(num_blocks=48, max_num_seqs=8, max_num_batched_tokens=24)
    ps = prompts(1200, seed=6, lo=2, hi=30)
    added, aborted = 0, 0
    while aborted < 1000:
        for _ in range(rng.randrange(0, 4)):
            p = ps[added]
            eng.add_request(f"r{added}", {"prompt_token_ids": p},
                            greedy(rng.randrange(1, 20), n=rng.choice([1, 1, 2])))
            added += 1
        eng.step()
        invariants(eng)
        for rid in list(eng.requests):
            if rng.random() < 0.3:
                out = eng.abort_request(rid)
                assert out.finished and all(c.finish_reason in ("abort", "stop", "length") for c in out.outputs)
                aborted += 1
    run_all(eng, check=invariants)
    assert eng.num_used_blocks() == 0
    eng.block_manager.check_invariants([])
    assert eng.abort_request("nope") is None


def test_rejections():
    eng = make_engine(num_blocks=8, max_model_len=64, max_waiting=2)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("a", {"prompt_token_ids": [1] * 60}, greedy(5))
    with pytest.raises(ValueError, match="KV blocks"):       # 40 tokens need 10 blocks of 4; the pool has 8
        eng.add_request("b", {"prompt_token_ids": [1] * 30}, greedy(10))
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request("c", {"prompt_token_ids": [1, 48]}, greedy(5))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("d", {"prompt_token_ids": []}, greedy(5))
    with pytest.raises(ValueError, match="prompt must be"):
        eng.add_request("d", 3.5, greedy(5))
    eng.add_request("e", "ab", greedy(5))
    with pytest.raises(ValueError, match="already"):
        eng.add_request("e", "ab", greedy(5))
    eng.add_request("f", "ab", greedy(5))
    with pytest.raises(EngineOverloaded):
        eng.add_request("g", "ab", greedy(5))
    eng.step()                                                        # both admitted: room again
    eng.add_request("g", "ab", greedy(5))
    run_all(eng)
    assert eng.num_used_blocks() == 0


def test_max_tokens_none_runs_to_the_context_limit():
    eng = make_engine(max_model_len=20)
    eng.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=None,
                                                                         ignore_eos=True))
    out = run_all(eng)["r"].outputs[0]
    assert len(out.token_ids) == 17 and out.finish_reason == "length"
    assert out.token_ids == reference_greedy([1, 2, 3], 17, ignore_eos=True)


def test_stop_strings_and_logprobs_flow_through():
    p = [5, 6, 7]
    ref = reference_greedy(p, 30, ignore_eos=True)
    text = FakeTokenizer().decode(ref)
    stop = text[6:8]
    eng = make_engine()
    eng.add_request("r", {"prompt_token_ids": p},
                    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=2))
    out = run_all(eng)["r"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert len(out.logprobs) == len(out.token_ids)
    lp = np.log(np.exp(context_logits(p).astype(np.float64)) / np.exp(context_logits(p).astype(np.float64)).sum())
    assert out.logprobs[0][ref[0]] == pytest.approx(lp[ref[0]])


def test_metrics_and_stats():
    eng = make_engine()
    add_all(eng, prompts(3, seed=8))
    final = run_all(eng)
    for out in final.values():
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == len(out.outputs[0].token_ids)
        assert m.ttft >= 0 and all(x >= 0 for x in m.inter_token_latencies())
    st = eng.stats()
    for key in ("running", "waiting", "preempted", "used_blocks", "total_blocks", "prefix_cache_hits",
                "prefix_cache_misses", "prefix_cache_hit_rate", "prompt_tokens", "generation_tokens"):
        assert key in st
    assert st["generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in final.values())
    assert st["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in final.values())
    assert st["running"] == st["waiting"] == 0 and st["total_blocks"] == 64


def test_priority_orders_service_through_the_engine():
    eng = make_engine(max_num_seqs=1, max_num_batched_tokens=64, aging_steps=10**6)
    order = []
    for rid, prio in (("low", 3), ("mid", 1), ("high", -2), ("mid2", 1)):
        eng.add_request(rid, {"prompt_token_ids": [1, 2, 3]}, greedy(3, ignore_eos=True), priority=prio)
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["high", "mid", "mid2", "low"]
    with pytest.raises(ValueError, match="priority"):
        eng.add_request("x", "ab", greedy(2), priority="urgent")


def test_bos_follows_the_tokenizer_flag():
    class BosTokenizer(FakeTokenizer):
        add_bos_token = True
        bos_token_id = 47
    plain = make_engine()
    plain.add_request("a", "abc", greedy(2))
    with_bos = make_engine(tokenizer=BosTokenizer())
    with_bos.add_request("a", "abc", greedy(2))
    assert run_all(plain)["a"].prompt_token_ids == [1, 2, 3]             # SmolLM2 / HF: no BOS
    assert run_all(with_bos)["a"].prompt_token_ids == [47, 1, 2, 3]      # Gemma-style add_bos_token
